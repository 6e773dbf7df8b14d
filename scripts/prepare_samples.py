"""Convert the real Criteo and Avazu samples (``tests/data/deepctr_samples``, copies of
DeepCTR's, or ``--samples``) with jctr's CSV converter, as a user would, and write the shipped
configs ``configs/criteo_sample.json`` and ``configs/avazu_sample.json`` (DeepFM, early
stopping on the validation split, test AUC at the end).

    python scripts/prepare_samples.py
    python -m jctr.train --config configs/criteo_sample.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from jctr.data.tools.from_csv import main as from_csv  # noqa: E402
from jctr.data.tools.from_csv import relative_sources  # noqa: E402

SAMPLES = {
    # name: (file, converter arguments)
    "criteo_sample": ("criteo_sample.txt", ["--label", "label", "--dense", "I1..I13"]),
    "avazu_sample": ("avazu_sample.txt", ["--label", "click", "--drop", "id"]),
}


def prepare(name: str, samples: str, data_root: str, model: str = "deepfm") -> str:
    """Convert one sample under ``<data_root>/<name>`` (replacing an earlier conversion of
    this script) and return the config's path there."""
    file, extra = SAMPLES[name]
    output = os.path.join(data_root, name)
    if os.path.exists(os.path.join(output, "vocab.json")):  # ours: convert afresh
        shutil.rmtree(output)
    code = from_csv(["--train", os.path.join(samples, file), "--split", "0.8,0.1,0.1",
                     "--output", output, "--model", model, *extra])
    if code:
        raise SystemExit(code)
    return os.path.join(output, f"{model}.json")


def rebased(cfg: dict, here: str, there: str) -> dict:
    """A config written in folder ``here`` (paths relative to it) for folder ``there``."""
    def move(path: str) -> str:
        moved = os.path.relpath(os.path.join(here, path), there)
        return moved + "/" if path.endswith("/") else moved

    cfg["layers"][0] = relative_sources(cfg["layers"][0], there, base=here)
    for key in ("snapshot_prefix", "log_dir"):
        cfg["solver"][key] = move(cfg["solver"][key])
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", default=os.path.join(ROOT, "tests", "data", "deepctr_samples"))
    ap.add_argument("--data", default="./data", help="converted data go to <data>/<name>")
    args = ap.parse_args()
    for name in SAMPLES:
        path = prepare(name, args.samples, args.data)
        with open(path, encoding="utf-8") as f:
            cfg = rebased(json.load(f), os.path.dirname(path), os.path.join(ROOT, "configs"))
        with open(os.path.join(ROOT, "configs", f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        print(f"configs/{name}.json")


if __name__ == "__main__":
    main()
