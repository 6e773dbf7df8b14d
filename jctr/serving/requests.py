"""Raw rows to inference requests: the inputs a served model takes (``DES``, ``CATCOLUMN``,
``ROWINDEX``), made from CSV-like rows with the ``vocab.json`` that ``python -m
jctr.data.tools.from_csv`` wrote, exactly as it encoded the training data (log1p dense values, the
same vocabulary ids and key offsets, bucketized integers, the out-of-vocabulary id 0).

Values are matched as text, as the converter read the CSV: give ``"5"`` (not ``5.0``) for a
categorical value written ``5`` in the file; a missing field is the empty string. Columns the
model does not use (the label, an id) are ignored.

Example::

    enc = RowEncoder.from_vocab("data/mine/vocab.json")
    body = enc.request([{"site": "a", "n": "20", "price": "3"}])   # KServe v2 JSON
    # or on the command line: python -m jctr.serve request --vocab data/mine/vocab.json \
    #     --rows new.csv > request.json
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pyarrow as pa

from jctr.data.records import DataError
from jctr.data.tools.from_csv import Layout, encode_features, read_csv, read_vocab


class RowEncoder:
    """Encodes raw rows as the converter encoded the training data (see the module)."""

    def __init__(self, layout: Layout, vocab: dict[str, list[str]], source: str = "vocab.json"):
        self.layout = layout
        self.vocab = vocab
        self.source = source

    @classmethod
    def from_vocab(cls, path: str | os.PathLike) -> RowEncoder:
        """Read a ``vocab.json`` written by ``python -m jctr.data.tools.from_csv``."""
        path = os.fspath(path)
        layout, vocab = read_vocab(path)
        return cls(layout, vocab, path)

    def _table(self, rows: Any, where: str) -> pa.Table:
        if isinstance(rows, pa.Table):
            return rows
        if isinstance(rows, dict):
            rows = [rows]
        if not isinstance(rows, (list, tuple)) or not all(isinstance(r, dict) for r in rows):
            raise DataError(f"{where}: expected a list of rows (dicts of column -> value), a "
                            "pyarrow Table or a CSV path")
        names = self.layout.dense + self.layout.categorical
        return pa.table({name: pa.array(["" if r.get(name) is None else str(r[name])
                                         for r in rows], pa.string()) for name in names})

    def features(self, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(dense [n, dense fields] float32, keys [n, fields] int64)`` of ``rows``: a list
        of dicts, a pyarrow Table of strings, or the path of a CSV (with a header line)."""
        where = self.source
        if isinstance(rows, (str, os.PathLike)):
            where = os.fspath(rows)
            rows = read_csv(where, sep=None, columns=None)
        return encode_features(self._table(rows, where), self.layout, self.vocab, where)

    def inputs(self, rows: Any) -> dict[str, np.ndarray]:
        """The model's input tensors by name: ``DES`` (absent without dense fields),
        ``CATCOLUMN`` (one key per field and row) and ``ROWINDEX`` (its row offsets)."""
        dense, keys = self.features(rows)
        out = {"DES": dense} if self.layout.dense else {}
        out["CATCOLUMN"] = keys.reshape(-1)
        out["ROWINDEX"] = np.arange(keys.size + 1, dtype=np.int32)
        return out

    def request(self, rows: Any) -> dict:
        """A KServe v2 (Triton) JSON request body for ``POST /v2/models/<name>/infer``."""
        dtypes = {"DES": "FP32", "CATCOLUMN": "INT64", "ROWINDEX": "INT32"}
        return {"inputs": [{"name": name, "datatype": dtypes[name], "shape": list(x.shape),
                            "data": x.reshape(-1).tolist()}
                           for name, x in self.inputs(rows).items()],
                "outputs": [{"name": "OUTPUT0"}]}


def main(argv: list[str]) -> int:
    """``python -m jctr.serve request --vocab V --rows FILE.csv``: the JSON request body."""
    import argparse

    from jctr.errors import run_command

    ap = argparse.ArgumentParser(prog="python -m jctr.serve request",
                                 description="Print the KServe v2 request body of raw CSV rows, "
                                             "encoded with a from_csv vocab.json.")
    ap.add_argument("--vocab", required=True, help="vocab.json written by jctr.data.tools.from_csv")
    ap.add_argument("--rows", required=True, help="CSV with a header line (the label column "
                                                  "may be absent)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks with errors")
    args = ap.parse_args(argv)
    return run_command(lambda: print(json.dumps(
        RowEncoder.from_vocab(args.vocab).request(args.rows))), debug=args.debug)
