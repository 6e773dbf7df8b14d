"""``python -m jctr.data.tools.from_csv``: any CSV of CTR samples to Norm files, vocabularies
fitted on the training file, and (with ``--model``) a training config ready to run.

Columns are the label (``--label``), dense features (``--dense``: ``log1p`` of the value, missing
and negative values 0), integers to treat as categorical (``--bucketize``: values above 2 become
``floor(ln(v)^2)``, as the Criteo winners did) and every other column is categorical (text or
integers; ``--drop`` leaves columns out). Names may be listed with ranges: ``I1..I13``.

Each categorical field's vocabulary comes from the training file alone: values seen at least
``--min-count`` times get ids 1..V (most frequent first); every other value, including values
only the validation or test files hold, gets the field's out-of-vocabulary id 0. A missing
value is the empty string, a value like any other. The vocabularies are written to
``vocab.json`` (JSON, no pickle), so new files can be converted later with ``--vocab``.

Validation and test files are given separately (``--valid``, ``--test``, any number of test
files), or carved out of the training file's end with ``--split 0.8,0.1,0.1``; with neither,
the last 10% of the training file is the validation set. A summary (rows per split, fields,
vocabulary sizes, out-of-vocabulary shares) goes to stderr.

Example (train on your own CSV in three commands)::

    python -m jctr.data.tools.from_csv --train train.csv --valid valid.csv --test test.csv \\
        --label click --drop id --min-count 2 --output data/mine --model deepfm
    python -m jctr.train --config data/mine/deepfm.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from jctr.data.norm import write_norm_file
from jctr.data.outputs import require_empty_folder
from jctr.data.records import DataError, RecordBlock, exit_on_data_error, write_file_list

VOCAB_FILE = "vocab.json"
ROWS_PER_FILE = 1 << 20
_RANGE = re.compile(r"^(.*?)(\d+)\.\.(.*?)(\d+)$")


def expand_names(text: str | None) -> list[str]:
    """``"I1..I3,C1"`` -> ``["I1", "I2", "I3", "C1"]``."""
    out: list[str] = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        m = _RANGE.match(item)
        if m and m.group(1) == m.group(3) and int(m.group(2)) <= int(m.group(4)):
            out += [f"{m.group(1)}{i}" for i in range(int(m.group(2)), int(m.group(4)) + 1)]
        else:
            out.append(item)
    return out


@dataclass
class Layout:
    """Which column is what; categorical fields in file order."""

    label: str
    dense: list[str]
    categorical: list[str]
    bucketized: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"label": self.label, "dense": self.dense, "categorical": self.categorical,
                "bucketized": self.bucketized}


def read_vocab(path: str) -> tuple[Layout, dict[str, list[str]]]:
    """The layout and vocabularies of a ``vocab.json`` this converter wrote."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read the vocabulary file: "
                        f"{getattr(e, 'strerror', None) or e}") from None
    expected = "expected the vocab.json that python -m jctr.data.tools.from_csv writes"
    if not text.strip():
        raise DataError(f"{path}: empty file; {expected}")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise DataError(f"{path}: not JSON ({e}); {expected}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("layout"), dict) \
            or not isinstance(doc.get("vocabularies"), dict):
        raise DataError(f"{path}: expected an object with \"layout\" and \"vocabularies\" "
                        f"({expected})")
    lay = doc["layout"]
    try:
        layout = Layout(str(lay["label"]), list(lay["dense"]), list(lay["categorical"]),
                        list(lay.get("bucketized", [])))
    except (KeyError, TypeError) as e:
        raise DataError(f"{path}: layout: missing or malformed field {e}") from None
    vocab = doc["vocabularies"]
    missing = [c for c in layout.categorical if not isinstance(vocab.get(c), list)]
    if missing:
        raise DataError(f"{path}: vocabularies: no list for field(s) {', '.join(missing)}")
    return layout, vocab


def read_csv(path: str, *, sep: str | None, columns: list[str] | None) -> pa.Table:
    """The whole file as strings (types are decided per role, not guessed)."""
    try:
        with open(path, "rb") as f:
            # utf-8-sig: a byte-order mark (spreadsheet exports) is not part of the first name
            first = f.readline().decode("utf-8-sig", "replace")
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror}") from e
    if sep is None:
        sep = "\t" if "\t" in first else ","
    names = columns or [c.strip() for c in first.rstrip("\r\n").split(sep)]
    try:
        table = pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(column_names=names, skip_rows=0 if columns else 1,
                                           block_size=1 << 26),
            parse_options=pacsv.ParseOptions(delimiter=sep),
            convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in names},
                                                 strings_can_be_null=False))
    except pa.ArrowInvalid as e:
        raise DataError(f"{path}: {e}") from e
    if table.num_rows == 0:
        raise DataError(f"{path}: no data rows" + ("" if columns else " after the header line"))
    return table


def _column(table: pa.Table, name: str, path: str) -> pa.Array:
    if name not in table.column_names:
        raise DataError(f"{path}: no column \"{name}\"; the columns are "
                        f"{', '.join(table.column_names)}")
    return table.column(name).combine_chunks()


def _numbers(table: pa.Table, name: str, path: str) -> np.ndarray:
    """float64 values of a numeric column; NaN where empty."""
    col = _column(table, name, path)
    empty = pc.equal(pc.utf8_trim_whitespace(col), "")
    try:
        values = pc.cast(pc.if_else(empty, None, col), pa.float64())
    except pa.ArrowInvalid as e:
        raise DataError(f"{path}: column \"{name}\": expected numbers ({e})") from None
    return values.to_numpy(zero_copy_only=False)


def _tokens(table: pa.Table, name: str, path: str, bucketize: bool) -> pa.Array:
    """A categorical field's values as strings; bucketized integers as their bucket."""
    if not bucketize:
        return _column(table, name, path)
    v = _numbers(table, name, path)
    with np.errstate(invalid="ignore", divide="ignore"):
        bucket = np.where(v > 2, np.floor(np.log(np.maximum(v, 1)) ** 2), np.floor(v))
    text = pa.array(bucket, pa.float64()).cast(pa.int64(), safe=False).cast(pa.string())
    return pc.if_else(pa.array(np.isnan(v)), "", text)


def fit_vocabularies(table: pa.Table, layout: Layout, min_count: int, path: str
                     ) -> dict[str, list[str]]:
    """Per field, the training values seen at least ``min_count`` times, most frequent first
    (ties in text order); their ids are 1.. in this order."""
    vocab = {}
    for name in layout.categorical:
        counts = pc.value_counts(_tokens(table, name, path, name in layout.bucketized))
        values = counts.field("values").to_numpy(zero_copy_only=False).astype(str)
        n = counts.field("counts").to_numpy()
        keep = n >= min_count
        order = np.lexsort((values[keep], -n[keep]))
        vocab[name] = values[keep][order].tolist()
    return vocab


def encode(table: pa.Table, layout: Layout, vocab: dict[str, list[str]], path: str
           ) -> RecordBlock:
    """One record per row: the label, log1p dense values, one key per field. Keys of field f
    are ``offset[f] + id`` with offsets the running sum of the fields' sizes (V + 1)."""
    label = _numbers(table, layout.label, path)
    bad = np.isnan(label)
    if bad.any():
        raise DataError(f"{path}: row {int(np.argmax(bad)) + 1}: column \"{layout.label}\" "
                        "(the label) is missing or not a number")
    bad = (label != 0.0) & (label != 1.0)
    if bad.any():  # a click label; a rating or a probability would train a wrong model
        row = int(np.argmax(bad))
        raise DataError(f"{path}: row {row + 1}: column \"{layout.label}\" (the label) is "
                        f"{label[row]:g}; expected 0 or 1 (a click or none)")
    dense, keys = encode_features(table, layout, vocab, path)
    return RecordBlock(label.astype(np.float32)[:, None], dense,
                       np.ones(keys.shape, np.int32), keys.ravel())


def encode_features(table: pa.Table, layout: Layout, vocab: dict[str, list[str]], path: str
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``(dense [n, dense fields] float32, keys [n, categorical fields] int64)`` of the rows,
    as :func:`encode` makes them (no label needed: what a served model is sent)."""
    n = table.num_rows
    dense = np.zeros((n, len(layout.dense)), np.float32)
    for j, name in enumerate(layout.dense):
        v = np.nan_to_num(_numbers(table, name, path), nan=0.0)
        dense[:, j] = np.log1p(np.maximum(v, 0.0))
    keys = np.zeros((n, len(layout.categorical)), np.int64)
    offset = 0
    for j, name in enumerate(layout.categorical):
        values = pa.array(vocab[name], pa.string())
        ids = pc.index_in(_tokens(table, name, path, name in layout.bucketized),
                          value_set=values)
        keys[:, j] = offset + pc.fill_null(ids, -1).to_numpy(zero_copy_only=False) + 1
        offset += len(vocab[name]) + 1
    return dense, keys


def write_split(block: RecordBlock, folder: str) -> str:
    """Norm files (I64 keys, checksums) plus their ``_file_list.txt``; returns the list."""
    os.makedirs(folder, exist_ok=True)
    files = []
    for i, start in enumerate(range(0, max(len(block), 1), ROWS_PER_FILE)):
        path = os.path.join(folder, f"part_{i:04d}.data")
        write_norm_file(path, block.slice(start, min(start + ROWS_PER_FILE, len(block))),
                        key_type="I64", check="Sum")
        files.append(path)
    write_file_list(os.path.join(folder, "_file_list.txt"), files)
    return os.path.join(folder, "_file_list.txt")


def _split(table: pa.Table, fractions: list[float]) -> list[pa.Table]:
    """Consecutive pieces (time order is kept: validation and test come last)."""
    n = table.num_rows
    cuts = np.round(np.cumsum(fractions) / sum(fractions) * n).astype(int)
    starts = np.concatenate([[0], cuts[:-1]])
    return [table.slice(int(a), int(b - a)) for a, b in zip(starts, cuts)]


def convert(train: str, output: str, *, label: str, dense: list[str], bucketize: list[str],
            drop: list[str], valid: str | None = None, tests: tuple[str, ...] = (),
            split: list[float] | None = None, min_count: int = 1, sep: str | None = None,
            columns: list[str] | None = None, vocab_file: str | None = None,
            report=None) -> tuple[dict, dict[str, int]]:
    """Convert; returns the Data layer (a dict for a JSON config, with ``slot_size_array``)
    and the rows written per split. Without ``valid`` or ``split`` the last 10% of the
    training file become the validation set (with ``vocab_file``, converting a later file,
    the training file is also the validation source, and the summary says so). ``report``
    (a print function) receives a summary: rows per split, fields, vocabulary sizes and
    out-of-vocabulary shares.

    Example::

        layer, rows = convert("train.csv", "data/mine", label="click", dense=[], bucketize=[],
                        drop=["id"], valid="valid.csv", tests=("test.csv",), min_count=2)
    """
    table = read_csv(train, sep=sep, columns=columns)
    for name in [label, *dense, *bucketize, *drop]:
        _column(table, name, train)
    taken = {label, *dense, *drop}
    layout = Layout(label, dense, [c for c in table.column_names if c not in taken],
                    [c for c in bucketize if c not in taken])
    if not layout.categorical:
        raise DataError(f"{train}: no categorical column left (label {label}, dense "
                        f"{len(dense)}, dropped {len(drop)} of {table.num_columns})")
    pieces: dict[str, tuple[pa.Table, str]] = {}
    if split:
        if valid or tests:
            raise DataError("--split carves validation and test sets out of --train; give "
                            "either --split or --valid/--test")
        parts = _split(table, split)
        table = parts[0]
        names = ["valid", "test"][:len(parts) - 1]
        pieces = {name: (part, f"{train} ({name} split)") for name, part in zip(names,
                                                                                   parts[1:])}
    else:
        if valid:
            pieces["valid"] = (read_csv(valid, sep=sep, columns=columns), valid)
        elif not vocab_file and table.num_rows >= 10:
            table, held = _split(table, [0.9, 0.1])
            pieces["valid"] = (held, f"{train} (its last 10%: no --valid or --split given)")
        for i, path in enumerate(tests):
            name = "test" if len(tests) == 1 else f"test{i + 1}"
            pieces[name] = (read_csv(path, sep=sep, columns=columns), path)
    if vocab_file:
        _, vocab = read_vocab(vocab_file)
        absent = [c for c in layout.categorical if c not in vocab]
        if absent:
            raise DataError(f"{vocab_file}: no vocabulary for column(s) {', '.join(absent)} "
                            f"of {train}")
    else:
        vocab = fit_vocabularies(table, layout, min_count, train)
    sizes = [len(vocab[f]) + 1 for f in layout.categorical]
    oov_keys = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # each field's id 0
    lines = []
    lists, rows = {}, {}
    for name, (piece, where) in {"train": (table, train), **pieces}.items():
        block = encode(piece, layout, vocab, where)
        lists[name] = write_split(block, os.path.join(output, name))
        rows[name] = piece.num_rows
        oov = (block.keys.reshape(len(block), -1) == oov_keys).mean() if len(block) else 0.0
        lines.append(f"  {name}: {piece.num_rows:,} rows from {where}; out-of-vocabulary "
                     f"values {100 * oov:.1f}%")
    if "valid" not in lists:
        lines.append("  no validation set: evaluation and early stopping read the training "
                     "file; give --valid or --split for a held-out set")
    if report is not None:
        report(f"[jctr] converted {train} into {output}: {len(layout.dense)} dense and "
               f"{len(layout.categorical)} categorical fields (vocabularies "
               f"{', '.join(f'{f} {n - 1:,}' for f, n in zip(layout.categorical, sizes))}; "
               f"{'from ' + vocab_file if vocab_file else f'min count {min_count}'})")
        for line in lines:
            report(line)
    with open(os.path.join(output, VOCAB_FILE), "w", encoding="utf-8") as f:
        json.dump({"layout": layout.to_json(), "min_count": min_count, "train": train,
                   "vocabularies": vocab}, f)
    layer = {"name": "data", "type": "Data", "format": "Norm", "check": "Sum",
             "source": lists["train"], "eval_source": lists.get("valid", lists["train"]),
             "label": {"top": "label", "label_dim": 1},
             "dense": {"top": "dense", "dense_dim": len(layout.dense)},
             "sparse": [{"top": "data1", "type": "DistributedSlot",
                         "max_feature_num_per_sample": len(sizes), "max_nnz": 1,
                         "slot_num": len(sizes)}],
             "slot_size_array": sizes}
    tests_out = {k: v for k, v in lists.items() if k.startswith("test")}
    if tests_out:
        layer["test_source"] = tests_out
    return layer, rows


def relative_sources(layer: dict, folder: str, base: str = "") -> dict:
    """The Data layer with its file lists (relative to ``base``) relative to ``folder``
    (where its config goes)."""
    def rel(path: str) -> str:
        return os.path.relpath(os.path.join(base, path), folder)

    out = {**layer, "source": rel(layer["source"]), "eval_source": rel(layer["eval_source"])}
    if "test_source" in layer:
        out["test_source"] = {k: rel(v) for k, v in layer["test_source"].items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jctr.data.tools.from_csv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="training CSV (vocabularies come from it)")
    ap.add_argument("--valid", help="validation CSV (early stopping watches it)")
    ap.add_argument("--test", action="append", default=[], help="test CSV (repeatable)")
    ap.add_argument("--split", help="fractions train,valid[,test] of --train, e.g. 0.8,0.1,0.1")
    ap.add_argument("--label", default="label", help="label column (0 or 1)")
    ap.add_argument("--dense", help="dense columns (log1p), e.g. I1..I13")
    ap.add_argument("--bucketize", help="integer columns to treat as categorical buckets")
    ap.add_argument("--drop", help="columns to leave out, e.g. id")
    ap.add_argument("--min-count", type=int, default=1,
                    help="values seen fewer times in --train share the OOV id 0")
    ap.add_argument("--sep", help="field separator (default: tab if the first line has one, "
                                  "else comma)")
    ap.add_argument("--columns", help="column names of files without a header line")
    ap.add_argument("--vocab", help="apply this vocab.json instead of fitting one")
    ap.add_argument("--output", required=True, help="a new or empty folder")
    ap.add_argument("--model", nargs="+", choices=("deepfm", "dcn", "dlrm", "wdl"),
                    help="also write <output>/<model>.json for each, a training config with "
                         "early stopping on the validation set (checkpoints and logs in "
                         "<output>/<model>/; its paths are taken from its own folder)")
    ap.add_argument("--force", action="store_true", help="write into a non-empty --output")
    args = ap.parse_args(argv)

    def run() -> None:
        if args.min_count < 1:
            raise DataError(f"--min-count: expected a positive integer, got {args.min_count}")
        split = None
        if args.split:
            try:
                split = [float(x) for x in args.split.split(",")]
            except ValueError:
                split = []
            if not 2 <= len(split) <= 3 or min(split) <= 0:
                raise DataError(f"--split: expected 2 or 3 positive fractions like "
                                f"0.8,0.1,0.1, got {args.split!r}")
        require_empty_folder(args.output, force=args.force)
        layer, rows = convert(args.train, args.output, label=args.label,
                        dense=expand_names(args.dense), bucketize=expand_names(args.bucketize),
                        drop=expand_names(args.drop), valid=args.valid, tests=tuple(args.test),
                        split=split, min_count=args.min_count, sep=args.sep,
                        columns=expand_names(args.columns) or None, vocab_file=args.vocab,
                        report=lambda line: print(line, file=sys.stderr))
        if args.model:
            from jctr.config.recipes import tabular_config

            # the config sits in --output: its data paths are relative to that folder
            local = relative_sources(layer, args.output)
            for model in dict.fromkeys(args.model):
                path = os.path.join(args.output, f"{model}.json")
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(tabular_config(model, local, train_rows=rows["train"],
                                             run_dir=model), f, indent=1)
                print(f"wrote {path}; train with: python -m jctr.train --config {path}")
        else:
            print(json.dumps(layer, indent=1))

    return exit_on_data_error(run)


if __name__ == "__main__":
    sys.exit(main())
