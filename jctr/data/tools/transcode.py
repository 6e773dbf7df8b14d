"""``python -m jctr.data.tools.transcode --input DIR --output DIR``: CSV + feature spec -> split
binary.

Reads ``DIR/feature_spec.yaml`` (or ``--feature_spec``) whose mappings are CSV chunks, and
writes every mapping as split binary (label bool, numerical float16, one file per categorical
feature of the smallest integer type) with a new ``feature_spec.yaml`` beside it. Cardinalities
written as ``auto`` are inferred (largest value + 1 over all mappings).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import yaml

from jctr.data.feature_spec import (
    load_feature_spec,
    read_mapping,
    split_binary_spec,
    write_split_binary,
)
from jctr.data.outputs import require_empty_folder
from jctr.data.records import DataError, exit_on_data_error


def transcode(input_dir: str, output_dir: str, spec_name: str = "feature_spec.yaml") -> str:
    spec = load_feature_spec(os.path.join(input_dir, spec_name))
    ch = spec.channels
    mappings = {m: read_mapping(spec, m) for m in spec.source}
    for m, cols in mappings.items():
        for f in ch.get("categorical", []):
            if len(cols[f]) and int(cols[f].min()) < 0:
                raise DataError(f"{spec.path}: source_spec.{m}: feature {f} holds the negative "
                                f"value {int(cols[f].min())}")
    cards = spec.cardinalities(mappings)
    for f, card in zip(ch.get("categorical", []), cards):
        top = max(int(cols[f].max()) + 1 if len(cols[f]) else 1 for cols in mappings.values())
        if card < top:
            raise DataError(f"{spec.path}: feature_spec.{f}.cardinality {card} is below the "
                            f"largest value + 1 = {top}")
    chunks = {}
    for m, cols in mappings.items():
        label = np.stack([cols[f] for f in ch["label"]], 1)
        dense = (np.stack([cols[f] for f in ch.get("numerical", [])], 1)
                 if ch.get("numerical") else np.zeros((len(label), 0)))
        cats = np.stack([cols[f] for f in ch["categorical"]], 1)
        chunks[m] = write_split_binary(output_dir, m, label, dense, cats, cards)
    out = split_binary_spec(len(ch["label"]), len(ch.get("numerical", [])), cards, chunks)
    out["metadata"] = {**spec.metadata, "transcoded_from": os.path.abspath(spec.path)}
    path = os.path.join(output_dir, "feature_spec.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(out, f, sort_keys=False)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jctr.data.tools.transcode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="folder with the CSV files and the YAML")
    ap.add_argument("--output", required=True, help="folder for the split binary dataset")
    ap.add_argument("--feature_spec", default="feature_spec.yaml",
                    help="YAML name inside --input")
    ap.add_argument("--force", action="store_true",
                    help="write into a non-empty --output folder (files of the same names are "
                         "replaced)")
    args = ap.parse_args(argv)
    return exit_on_data_error(
        lambda: require_empty_folder(args.output, force=args.force)
        or print(transcode(args.input, args.output, args.feature_spec)))


if __name__ == "__main__":
    sys.exit(main())
