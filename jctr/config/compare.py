"""What differs between two parsed configs: a resumed run names the fields that changed.

Differences are split in two: *structural* ones change the shape of the training state (a
layer, an embedding's width, an optimizer type), so a checkpoint of one config cannot continue
under the other; the rest (learning rates, schedules, solver settings, table capacities, data
paths) may change between runs.

Example::

    structural, other = config_differences(load_config("old.json"), load_config("new.json"))
    # structural == ['layers[4] "fc2" params.num_output: 256 -> 512']
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

from jctr.config.schema import ModelConfig

# fields that may change between a checkpoint and the run that resumes it
_FREE_OPTIMIZER = {"learning_rate", "beta1", "beta2", "epsilon", "momentum_factor",
                   "initial_accu_value", "warmup_steps", "decay_start", "decay_steps",
                   "decay_power", "end_lr"}
_FREE_EMBEDDING = {"max_vocabulary_size_per_gpu", "plan_file", "init_range", "replicated",
                   "l2_lambda", "l1_lambda", "l2_rows", "growable", "eviction"}
_FREE_DATA = {"name", "source", "eval_source", "check", "num_samples", "eval_num_samples",
              "cache_eval_data", "synthetic", "shuffle", "format", "slot_size_array",
              "float_label_dense", "test_sources"}


def config_differences(old: ModelConfig, new: ModelConfig) -> tuple[list[str], list[str]]:
    """``(structural, other)`` differences from ``old`` to ``new``, one line per field, named
    by the field's path (``layers[3] "fc1" params.num_output: 256 -> 512``)."""
    structural: list[str] = []
    other: list[str] = []

    def walk(path: str, a: Any, b: Any, free: set[str], strict: bool) -> None:
        if is_dataclass(a) and type(a) is type(b):
            for f in fields(a):
                if f.name == "path":
                    continue
                walk(f"{path}.{f.name}", getattr(a, f.name), getattr(b, f.name), free,
                     strict and f.name not in free)
        elif a != b:
            (structural if strict else other).append(f"{path}: {_show(a)} -> {_show(b)}")

    walk("optimizer", old.optimizer, new.optimizer, _FREE_OPTIMIZER, True)
    walk("layers[0]", old.data, new.data, _FREE_DATA, True)
    if len(old.embeddings) != len(new.embeddings):
        structural.append(f"embedding layers: {len(old.embeddings)} -> {len(new.embeddings)}")
    for i, (a, b) in enumerate(zip(old.embeddings, new.embeddings)):
        walk(f"layers[{i + 1}] \"{a.name}\"", a, b, _FREE_EMBEDDING | _FREE_OPTIMIZER, True)
    if len(old.layers) != len(new.layers):
        structural.append(f"dense layers: {len(old.layers)} -> {len(new.layers)}")
    for a, b in zip(old.layers, new.layers):
        walk(f"{b.path} \"{a.name}\"", a, b, set(), True)
    walk("solver", old.solver, new.solver, {f.name for f in fields(old.solver)}, False)
    return structural, other


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
