"""HugeCTR's Parquet format: a file list of Parquet files plus ``_metadata.json``.

``_metadata.json`` (in the file list's folder) lists ``file_stats`` (``file_name``,
``num_rows``) and the ``labels``, ``conts`` (dense) and ``cats`` (slot) columns as
``{"col_name", "index"}``; columns may sit in any order in the files and are taken in the order
of their ``index``. Labels and dense columns are float, slot columns int64 with keys in
``[0, slot_size_array[s])`` (jctr adds slot offsets, as for Raw). Missing values are an error.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jctr.config.schema import DataConfig
from jctr.data.dataset import Dataset
from jctr.data.records import (
    DataError,
    RecordBlock,
    check_slot_keys,
    read_file_list,
    slot_offsets,
    write_file_list,
)


def read_metadata(folder: str) -> dict:
    path = os.path.join(folder, "_metadata.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except OSError as e:
        raise DataError(f"{path}: cannot read Parquet metadata: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
    for key in ("file_stats", "cats", "conts", "labels"):
        if not isinstance(meta.get(key), list):
            raise DataError(f"{path}: expected a list under \"{key}\"")
        for i, item in enumerate(meta[key]):
            need = ("file_name", "num_rows") if key == "file_stats" else ("col_name", "index")
            if not isinstance(item, dict) or any(k not in item for k in need):
                raise DataError(f"{path}: {key}[{i}]: expected an object with "
                                + " and ".join(f"\"{k}\"" for k in need))
    meta["_path"] = path
    return meta


class ParquetDataset(Dataset):
    """Batches from Parquet files; a unit is a file."""

    def __init__(self, file_list: str, data: DataConfig, **kw):
        super().__init__(data, **kw)
        self.files = read_file_list(file_list)
        self.meta = read_metadata(os.path.dirname(os.path.abspath(file_list)))
        path = self.meta["_path"]
        by_index = lambda items: [c["col_name"] for c in sorted(items, key=lambda c: c["index"])]
        self.labels = by_index(self.meta["labels"])
        self.conts = by_index(self.meta["conts"])
        self.cats = by_index(self.meta["cats"])
        for what, cols, want in (("labels", self.labels, data.label_dim),
                                 ("conts", self.conts, data.dense_dim),
                                 ("cats", self.cats, data.total_slots)):
            if len(cols) != want:
                cfg = {"labels": "label_dim", "conts": "dense_dim",
                       "cats": "the sparse inputs' slot_num summed"}[what]
                raise DataError(f"{path}: \"{what}\" lists {len(cols)} columns but the config "
                                f"has {want} ({cfg})")
        self.rows = {os.path.basename(s["file_name"]): int(s["num_rows"])
                     for s in self.meta["file_stats"]}
        # without slot_size_array (HugeCTR 3.x allows it) keys are global already
        self.offsets = (slot_offsets(data.slot_size_array) if data.slot_size_array
                        else np.zeros(data.total_slots, np.int64))

    def num_units(self) -> int:
        return len(self.files)

    def unit_name(self, index: int) -> str:
        return self.files[index]

    def check_units(self) -> None:
        """Every file's footer against ``_metadata.json`` (rows, columns), without reading it."""
        for i in self.host_units():
            path = self.files[i]
            try:
                meta = pq.ParquetFile(path).metadata
                names = set(meta.schema.names)
            except Exception as e:  # noqa: BLE001 - a damaged footer fails in many ways
                raise DataError(f"{path}: cannot read Parquet file ({type(e).__name__}: "
                                f"{str(e)[:200]})") from e
            want_rows = self.rows.get(os.path.basename(path))
            if want_rows is None:
                raise DataError(f"{self.meta['_path']}: file_stats has no entry for "
                                f"\"{os.path.basename(path)}\"")
            if meta.num_rows != want_rows:
                raise DataError(f"{path}: holds {meta.num_rows} rows but _metadata.json's "
                                f"file_stats says {want_rows}")
            for name in (*self.labels, *self.conts, *self.cats):
                if name not in names:
                    raise DataError(f"{path}: missing column \"{name}\" (listed in "
                                    "_metadata.json)")

    def _read_unit(self, index: int) -> RecordBlock:
        path = self.files[index]
        try:
            table = pq.read_table(path)
            names = set(table.column_names)  # decoding names can fail on a damaged footer
        except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways inside Arrow
            raise DataError(f"{path}: cannot read Parquet file ({type(e).__name__}: "
                            f"{str(e)[:200]})") from e
        base = os.path.basename(path)
        want_rows = self.rows.get(base)
        if want_rows is None:
            raise DataError(f"{self.meta['_path']}: file_stats has no entry for \"{base}\"")
        if table.num_rows != want_rows:
            raise DataError(f"{path}: holds {table.num_rows} rows but _metadata.json's "
                            f"file_stats says {want_rows}")

        def column(name: str, kind: str) -> np.ndarray:
            if name not in names:
                raise DataError(f"{path}: missing column \"{name}\" (listed in _metadata.json)")
            col = table.column(name)
            if col.null_count:
                row = int(np.argmax(np.asarray(col.is_null())))
                raise DataError(f"{path}: row {row}: column \"{name}\" is null (missing values "
                                "are not allowed)")
            t = col.type
            ok = pa.types.is_floating(t) if kind == "float" else pa.types.is_integer(t)
            if not ok:
                want = "float" if kind == "float" else "int64"
                raise DataError(f"{path}: column \"{name}\" has type {t}; expected {want}")
            return col.to_numpy()

        n = table.num_rows
        label = np.stack([column(c, "float") for c in self.labels], 1).astype(np.float32) \
            if self.labels else np.zeros((n, 0), np.float32)
        dense = np.stack([column(c, "float") for c in self.conts], 1).astype(np.float32) \
            if self.conts else np.zeros((n, 0), np.float32)
        keys = np.stack([column(c, "int") for c in self.cats], 1).astype(np.int64)
        if self.data.slot_size_array:
            check_slot_keys(keys, self.data.slot_size_array, path)
        keys += self.offsets[None, :]
        return RecordBlock(label, dense, np.ones(keys.shape, np.int32), keys.ravel())


def write_parquet_dataset(folder: str, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                          ) -> str:
    """Write (label, dense, per-slot keys) parts as Parquet files, ``_metadata.json`` and
    ``_file_list.txt``; returns the file list."""
    os.makedirs(folder, exist_ok=True)
    files, stats = [], []
    for i, (label, dense, keys) in enumerate(parts):
        cols = {}
        for j in range(label.shape[1]):
            cols["label" if label.shape[1] == 1 else f"label{j}"] = label[:, j].astype(np.float32)
        for j in range(dense.shape[1]):
            cols[f"I{j + 1}"] = dense[:, j].astype(np.float32)
        for j in range(keys.shape[1]):
            cols[f"C{j + 1}"] = keys[:, j].astype(np.int64)
        name = f"part_{i:04d}.parquet"
        path = os.path.join(folder, name)
        pq.write_table(pa.table(cols), path)
        files.append(path)
        stats.append({"file_name": name, "num_rows": int(label.shape[0])})
    names = list(cols)
    meta = {"file_stats": stats,
            "labels": [{"col_name": c, "index": names.index(c)} for c in names
                       if c.startswith("label")],
            "conts": [{"col_name": c, "index": names.index(c)} for c in names
                      if c.startswith("I")],
            "cats": [{"col_name": c, "index": names.index(c)} for c in names
                     if c.startswith("C")]}
    with open(os.path.join(folder, "_metadata.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    lst = os.path.join(folder, "_file_list.txt")
    write_file_list(lst, files)
    return lst
