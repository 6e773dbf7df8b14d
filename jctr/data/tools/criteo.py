"""``python -m jctr.data.tools.criteo``: raw Criteo data to Norm, Raw, Parquet or split binary.

Input: the Criteo TSV (no header: label, I1..I13, C1..C26, tab-separated) or the same columns as
CSV with a ``label,I1,...`` header; missing values allowed. Integer features: missing and
negative values become 0, then ``log(x + 1)`` (Raw keeps the integers; its reader applies the
log). Categorical features (8 hex digits) become keys in one of three ways:

* ``--mode hash``: a 63-bit hash of (slot, value): no vocabulary, Norm (I64) only;
* ``--mode buckets --buckets N``: the hash modulo N per slot (``slot_size_array`` = N each);
* ``--mode vocab --min-freq F``: per slot, values seen at least F times in the training split get
  ids 1..V in sorted order; everything else (rare, missing, unseen) is 0.

The validation split is the last ``--val-fraction`` of the rows (time order, as Criteo's) or a
seeded random subset with ``--shuffle-split``. The command prints a Data-layer JSON snippet.

    python -m jctr.data.tools.criteo --input day_0.tsv --output data/criteo --format parquet \\
        --mode vocab --min-freq 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from jctr.data.norm import write_norm_file
from jctr.data.outputs import require_empty_folder
from jctr.data.records import DataError, RecordBlock, exit_on_data_error, write_file_list
from jctr.ops import mix64

NUM_DENSE, NUM_CAT = 13, 26
COLUMNS = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
MISSING = np.int64(1 << 32)  # a categorical value no 8-hex-digit string can take

_NIBBLE = np.full(256, 255, np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _NIBBLE[_c] = 10 + _i


def _hex_values(arr: pa.Array, path: str, column: str) -> np.ndarray:
    """8-hex-digit strings -> int64 (MISSING where empty or null), vectorised on the buffers."""
    arr = arr.cast(pa.string())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n = len(arr)
    offsets = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset:arr.offset + n + 1]
    data = (np.frombuffer(arr.buffers()[2], np.uint8) if arr.buffers()[2] is not None
            else np.zeros(0, np.uint8))
    lengths = np.diff(offsets)
    valid = np.asarray(arr.is_valid()) & (lengths > 0)
    out = np.full(n, MISSING, np.int64)
    bad = valid & (lengths > 8)
    if bad.any():
        r = int(np.argmax(bad))
        raise DataError(f"{path}: row {r}: {column}: expected at most 8 hex digits")
    idx = np.nonzero(valid)[0]
    if idx.size:
        width = lengths[idx]
        pos = offsets[idx, None] + np.arange(8)[None, :]
        chars = data[np.minimum(pos, max(data.size - 1, 0))]
        nib = _NIBBLE[chars].astype(np.int64)
        inside = np.arange(8)[None, :] < width[:, None]
        if (inside & (nib == 255)).any():
            r = int(idx[np.argmax((inside & (nib == 255)).any(axis=1))])
            raise DataError(f"{path}: row {r}: {column}: not a hexadecimal value")
        nib = np.where(inside, nib, 0)
        shift = 4 * (width[:, None] - 1 - np.arange(8)[None, :])
        out[idx] = np.sum(np.where(inside, nib << np.maximum(shift, 0), 0), axis=1)
    return out


def read_criteo(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(label [n], ints [n, 13] int64, cats [n, 26] int64 with MISSING) of one file."""
    try:
        with open(path, "rb") as f:
            first = f.readline()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror}") from e
    header = first.startswith(b"label")
    delim = "\t" if b"\t" in first else ","
    ncols = first.count(delim.encode()) + 1
    if ncols != len(COLUMNS):
        raise DataError(f"{path}: row 0: expected {len(COLUMNS)} fields (label, 13 integer, "
                        f"26 categorical), got {ncols}")
    types = {c: pa.float64() for c in COLUMNS[:14]}
    types.update({c: pa.string() for c in COLUMNS[14:]})
    try:
        table = pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(column_names=None if header else COLUMNS,
                                           skip_rows=0),
            parse_options=pacsv.ParseOptions(delimiter=delim),
            convert_options=pacsv.ConvertOptions(column_types=types,
                                                 strings_can_be_null=True))
    except pa.ArrowInvalid as e:
        raise DataError(f"{path}: {e}") from e
    if table.column_names != COLUMNS:
        raise DataError(f"{path}: header: expected columns {COLUMNS[:3]}..., got "
                        f"{table.column_names[:3]}...")
    label_col = table.column("label")
    if label_col.null_count:
        r = int(np.argmax(np.asarray(label_col.is_null())))
        raise DataError(f"{path}: row {r}: label is missing")
    label = label_col.to_numpy().astype(np.float32)
    ints = np.stack([np.nan_to_num(table.column(c).to_numpy(zero_copy_only=False), nan=0.0)
                     for c in COLUMNS[1:14]], 1)
    ints = np.maximum(ints, 0).astype(np.int64)
    cats = np.stack([_hex_values(table.column(c).combine_chunks(), path, c)
                     for c in COLUMNS[14:]], 1)
    return label, ints, cats


def hash_keys(cats: np.ndarray) -> np.ndarray:
    """63-bit keys, distinct per (slot, value)."""
    slot = np.arange(cats.shape[1], dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        h = mix64(cats.astype(np.uint64) ^ (slot << np.uint64(40)) * np.uint64(0x9E3779B97F4A7C15))
    return (h >> np.uint64(1)).astype(np.int64)


def build_vocab(cats: np.ndarray, min_freq: int) -> list[np.ndarray]:
    vocab = []
    for s in range(cats.shape[1]):
        vals, counts = np.unique(cats[:, s], return_counts=True)
        keep = vals[(counts >= min_freq) & (vals != MISSING)]
        vocab.append(keep)
    return vocab


def apply_vocab(cats: np.ndarray, vocab: list[np.ndarray]) -> np.ndarray:
    out = np.zeros(cats.shape, np.int64)
    for s, keep in enumerate(vocab):
        pos = np.searchsorted(keep, cats[:, s])
        found = (pos < keep.size) & (keep[np.minimum(pos, max(keep.size - 1, 0))] == cats[:, s]) \
            if keep.size else np.zeros(cats.shape[0], bool)
        out[:, s] = np.where(found, pos + 1, 0)
    return out


def convert(inputs: list[str], output: str, fmt: str, mode: str, *, min_freq: int = 1,
            buckets: int = 1 << 20, val_fraction: float = 0.1, shuffle_split: bool = False,
            seed: int = 0, num_files: int = 4) -> dict:
    parts = [read_criteo(p) for p in inputs]
    label = np.concatenate([p[0] for p in parts])
    ints = np.concatenate([p[1] for p in parts])
    cats = np.concatenate([p[2] for p in parts])
    n = label.shape[0]
    n_val = int(round(n * val_fraction))
    order = (np.random.default_rng(seed).permutation(n) if shuffle_split else np.arange(n))
    splits = {"train": order[: n - n_val], "val": order[n - n_val:]}
    if mode == "hash":
        if fmt != "norm":
            raise DataError("--mode hash gives 64-bit keys; only --format norm stores them "
                            "(use --mode buckets or vocab for raw, parquet, split_binary)")
        keys = hash_keys(cats)
        sizes = None
    elif mode == "buckets":
        keys = (hash_keys(cats) % buckets).astype(np.int64)
        sizes = [buckets] * NUM_CAT
    else:
        vocab = build_vocab(cats[splits["train"]], min_freq)
        keys = apply_vocab(cats, vocab)
        sizes = [int(v.size) + 1 for v in vocab]
    dense_log = np.log1p(ints.astype(np.float32))
    os.makedirs(output, exist_ok=True)
    paths = {}
    sb_chunks: dict[str, list[dict]] = {}
    for name, rows in splits.items():
        folder = os.path.join(output, name)
        if fmt != "split_binary":
            os.makedirs(folder, exist_ok=True)
        # each split's rows gathered once (np.take: numpy 2.4 indexes rows with an array
        # 3-15x slower), not again for every output file
        lab = label[rows][:, None]
        dense_rows, key_rows = (np.take(a, rows, axis=0) for a in (dense_log, keys))
        if fmt == "norm":
            offs = (np.cumsum(sizes) - sizes) if sizes else np.zeros(NUM_CAT, np.int64)
            k = key_rows + offs[None, :]
            chunks = np.array_split(np.arange(rows.size), num_files)
            files = []
            for i, c in enumerate(chunks):
                block = RecordBlock(lab[c], dense_rows[c], np.ones((c.size, NUM_CAT), np.int32),
                                    k[c].ravel())
                f = os.path.join(folder, f"part_{i:04d}.data")
                write_norm_file(f, block, key_type="I64", check="Sum")
                files.append(f)
            paths[name] = os.path.join(folder, "_file_list.txt")
            write_file_list(paths[name], files)
        elif fmt == "raw":
            from jctr.data.raw import write_raw_file

            paths[name] = os.path.join(folder, "data.bin")
            write_raw_file(paths[name], lab, np.take(ints, rows, axis=0), key_rows)
        elif fmt == "parquet":
            from jctr.data.parquet import write_parquet_dataset

            chunks = np.array_split(np.arange(rows.size), num_files)
            paths[name] = write_parquet_dataset(
                folder, [(lab[c], dense_rows[c], key_rows[c]) for c in chunks])
        elif fmt == "split_binary":
            from jctr.data.feature_spec import write_split_binary

            mapping = "train" if name == "train" else "test"
            sb_chunks[mapping] = write_split_binary(output, mapping, lab, dense_rows,
                                                    key_rows, sizes)
        else:
            raise DataError(f"unknown format {fmt!r}")
    if fmt == "split_binary":
        import yaml

        from jctr.data.feature_spec import split_binary_spec

        spec = split_binary_spec(1, NUM_DENSE, sizes, sb_chunks)
        path = os.path.join(output, "feature_spec.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(spec, f, sort_keys=False)
        paths = {"train": path, "val": path}
    layer = {"format": {"norm": "Norm", "raw": "Raw", "parquet": "Parquet",
                        "split_binary": "FeatureSpec"}[fmt],
             "source": paths["train"], "eval_source": paths["val"],
             "check": "Sum" if fmt == "norm" else "None"}
    if sizes:
        layer["slot_size_array"] = sizes
    if fmt == "raw":
        layer.update(num_samples=int(splits["train"].size),
                     eval_num_samples=int(splits["val"].size))
    return layer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jctr.data.tools.criteo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="TSV or CSV files, in order")
    ap.add_argument("--output", required=True)
    ap.add_argument("--format", choices=("norm", "raw", "parquet", "split_binary"),
                    default="norm")
    ap.add_argument("--mode", choices=("hash", "buckets", "vocab"), default="vocab")
    ap.add_argument("--min-freq", type=int, default=1)
    ap.add_argument("--buckets", type=int, default=1 << 20)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--shuffle-split", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-files", type=int, default=4)
    ap.add_argument("--force", action="store_true",
                    help="write into a non-empty --output folder (files of the same names are "
                         "replaced)")
    args = ap.parse_args(argv)

    def run() -> None:
        require_empty_folder(args.output, force=args.force)
        print(json.dumps(convert(
            args.input, args.output, args.format, args.mode, min_freq=args.min_freq,
            buckets=args.buckets, val_fraction=args.val_fraction,
            shuffle_split=args.shuffle_split, seed=args.seed, num_files=args.num_files),
            indent=1))

    return exit_on_data_error(run)

if __name__ == "__main__":
    sys.exit(main())
