import copy
import json
import os

import pytest

import jctr  # noqa: F401  (64-bit keys on before tests touch JAX)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def load_json(name: str) -> dict:
    with open(os.path.join(CONFIGS, name), encoding="utf-8") as f:
        return json.load(f)


def tiny_config(tmp_path, model: str = "dlrm", **solver) -> dict:
    """A shipped *_synthetic config with its data redirected under tmp_path."""
    cfg = copy.deepcopy(load_json(f"{model}_synthetic.json"))
    data = cfg["layers"][0]
    data["source"] = str(tmp_path / model / "train" / "_file_list.txt")
    data["eval_source"] = str(tmp_path / model / "eval" / "_file_list.txt")
    cfg["solver"].update(solver)
    return cfg


@pytest.fixture
def tiny(tmp_path):
    return lambda model="dlrm", **solver: tiny_config(tmp_path, model, **solver)
