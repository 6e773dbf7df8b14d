"""``python -m jctr.data.tools.gen_csv --feature_spec_in YAML``: random CSV files for a feature
spec.

Writes every CSV chunk file the YAML names (relative to ``--output``, default the YAML's
folder): categorical features uniform in ``[0, cardinality)`` (``auto`` counts as 100),
numerical features standard normal, labels 0/1. Useful to try transcoding end to end.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from jctr.data.feature_spec import load_feature_spec
from jctr.data.outputs import require_absent
from jctr.data.records import exit_on_data_error


def generate_csv(spec_path: str, output: str | None = None, size: int = 1000,
                 seed: int = 0, *, force: bool = False) -> list[str]:
    spec = load_feature_spec(spec_path, check_files=False)
    out_dir = output or spec.base
    require_absent([os.path.join(out_dir, os.path.relpath(path, spec.base))
                    for chunks in spec.source.values() for chunk in chunks
                    if chunk.type == "csv" for path in chunk.files], force=force)
    rng = np.random.default_rng(seed)
    labels = set(spec.channels.get("label", []))
    written = []
    for chunks in spec.source.values():
        for chunk in chunks:
            if chunk.type != "csv":
                continue
            per_file = np.full(len(chunk.files), size // len(chunk.files))
            per_file[: size % len(chunk.files)] += 1
            for path, n in zip(chunk.files, per_file):
                cols = {}
                for f in chunk.features:
                    card = spec.features[f].get("cardinality")
                    if f in labels:
                        cols[f] = rng.integers(0, 2, n)
                    elif card is not None:
                        cols[f] = rng.integers(0, 100 if card == "auto" else int(card), n)
                    else:
                        cols[f] = rng.normal(size=n).astype(np.float32)
                target = os.path.join(out_dir, os.path.relpath(path, spec.base))
                os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
                pacsv.write_csv(pa.table(cols), target,
                                pacsv.WriteOptions(include_header=False))
                written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jctr.data.tools.gen_csv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--feature_spec_in", required=True)
    ap.add_argument("--output", help="folder to write into (default: the YAML's folder)")
    ap.add_argument("--size", type=int, default=1000, help="rows per mapping")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="overwrite CSV files that exist")
    args = ap.parse_args(argv)
    return exit_on_data_error(lambda: print("\n".join(generate_csv(
        args.feature_spec_in, args.output, args.size, args.seed, force=args.force))))


if __name__ == "__main__":
    sys.exit(main())
