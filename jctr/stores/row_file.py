"""Rows of fixed width in plain files: the streaming ``sparse_store`` of type ``row_file``
(HugeCTR's SSD-backed embedding training cache kept its rows in plain files too).

A table is a folder holding its key column (``keys.i64``, little-endian int64) and its rows
(``rows.f32``, float32 ``[capacity, width]``), both memory-mapped, and ``table.json`` (the
width and the rows handed out). The index from key to row (the compiled open-addressing index
of :mod:`jctr.ops.host_index`) is built from the key column when a table opens and lives in
memory (past a quarter of the memory left, 16-32 bytes a row, in an unnamed mapped file in
the table's folder, paged as the rows are: :class:`jctr.runtime.mapped.MappedArrays`). A
batch's reads and writes are one gather or scatter on the mapped files: memory speed while
the files sit in the page cache (RocksDB goes through a Python object a row), and the
operating system pages a table larger than memory in and out. An erased row's key becomes
``FREE`` and new keys take freed rows first.

A write is flushed to disk before it returns (``durable=False``, an eviction's spill whose
folder is the run's scratch: left to the page cache, the row count not recorded each time). It
is not atomic by itself: the streaming
runner saves what a pass's write-back overwrites first (an undo file) and puts it back when a
run stops in between, as it does for RocksDB; rows written beyond the recorded count before a
crash are not read again.

Example::

    store = RowFileStore("runs/online/rows")
    store.insert("online.t", keys, rows)            # rows: float32 [n, width]
    rows, found = store.lookup("online.t", keys, width)
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator

import numpy as np

from jctr.ops import host_index
from jctr.ops.host_index import host_kernel, slot_of
from jctr.ops.host_sort import unique
from jctr.runtime.direct_io import replace_json
from jctr.runtime.host_memory import room_left
from jctr.runtime.mapped import MappedArrays, allocate
from jctr.stores.base import (
    StoreError,
    as_keys,
    as_values,
    check_dim,
    no_rows,
    scatter_rows,
)

FREE = np.int64(np.iinfo(np.int64).min)  # a freed row's key (the device tables' EMPTY_KEY)
MARKER = "jctr-row-file.json"  # what makes a folder a store of this kind
FORMAT = {"format": "jctr-row-file", "version": 1}


@host_kernel
def _place(index, keys, queries, free_rows, n_free, n, out):
    """The row of each query key into ``out``: its own, else a freed one (the stack
    ``free_rows[:n_free]`` from its top), else ``n, n + 1, ...`` (its key written into
    ``keys``). Returns (n_free, n) after. A slot left pointing at a freed row matches no key
    but the one that row holds now, so it only lengthens probes until the next rebuild."""
    mask = index.size - 1
    for i in range(queries.size):
        k = queries[i]
        s = slot_of(index, keys, k, mask)
        r = index[s]
        if r < 0:
            if n_free > 0:
                n_free -= 1
                r = free_rows[n_free]
            else:
                r = n
                n += 1
            keys[r] = k
            index[s] = r
        out[i] = r
    return n_free, n


def _grow(path: str, size: int) -> None:
    """``path`` at least ``size`` bytes long, its blocks allocated (:func:`jctr.runtime.
    mapped.allocate`): a full disk is an error naming the file when the table grows, not a
    SIGBUS at a write into a mapped page."""
    with open(path, "ab") as f:
        try:
            allocate(f.fileno(), size)
        except OSError as e:
            raise StoreError(f"row_file {path}: no room to grow it to {size:,} bytes "
                             f"({e.strerror}); nothing was written") from e


class _Table:
    """One table's mapped files and in-memory index."""

    def __init__(self, folder: str, width: int | None = None):
        self.folder = folder
        info = os.path.join(folder, "table.json")
        if width is not None:  # a new table
            os.makedirs(folder, exist_ok=True)
            self.width, self.count = int(width), 0
            replace_json(info, {"width": self.width, "count": 0})
        else:
            try:
                with open(info) as f:
                    doc = json.load(f)
                self.width, self.count = int(doc["width"]), int(doc["count"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise StoreError(f"row_file {info}: unreadable ({e})") from e
        self.capacity = 0
        self._mapped: MappedArrays | None = None  # the index's file, once it is that large
        self.keys = np.zeros(0, np.int64)
        self.rows = np.zeros((0, self.width), np.float32)
        self._map(max(self.count, self._file_rows()))
        live = self.keys[:self.count] != FREE
        self.free = np.flatnonzero(~live)[::-1].astype(np.int64)  # a stack: lowest on top
        self.n_free = self.free.size
        self.live = int(live.sum())
        self._reindex()

    # an index past this share of the memory left (16-32 bytes a row: ~24 GB for a billion
    # rows) goes into a mapped file of its own, paged as the rows are
    INDEX_IN_MEMORY_SHARE = 0.25

    def _reindex(self) -> None:
        """The index of the live rows, sized for the capacity; no erased key's slot left."""
        size = host_index.index_size(self.capacity)
        room = room_left()
        if self._mapped is not None or (room is not None
                                        and 8 * size > self.INDEX_IN_MEMORY_SHARE * room):
            self._mapped = self._mapped or MappedArrays(self.folder)
            self.index = self._mapped.array("index", np.int64, size)
            self.index[:] = -1
        else:
            self.index = np.full(size, -1, np.int64)
        host_index.rebuild_distinct_except(self.index, self.keys, self.count, FREE)
        self.stale = 0  # index slots of erased keys since the last rebuild

    def _file_rows(self) -> int:
        path = os.path.join(self.folder, "keys.i64")
        return os.path.getsize(path) // 8 if os.path.exists(path) else 0

    def _map(self, rows: int) -> None:
        """Map the files with room for ``rows`` rows (grown files: new keys ``FREE``)."""
        rows = max(rows, 1024)
        kp, rp = os.path.join(self.folder, "keys.i64"), os.path.join(self.folder, "rows.f32")
        old = self._file_rows()
        for path, size in ((kp, 8 * rows), (rp, 4 * self.width * rows)):
            _grow(path, size)
        self.keys = np.memmap(kp, np.int64, "r+", shape=(rows,))
        self.rows = np.memmap(rp, np.float32, "r+", shape=(rows, self.width))
        if old < rows:
            self.keys[old:] = FREE
        self.capacity = rows

    def place(self, keys: np.ndarray, record: bool = True) -> np.ndarray:
        """Each key's row (new keys get one, the files grown as needed); ``record``: the
        rows handed out written to ``table.json`` at once."""
        need = self.count + keys.size
        if need > self.capacity or 2 * (self.count + self.stale + keys.size) > self.index.size:
            if need > self.capacity:
                self.flush()
                self._map(max(need, 2 * self.capacity))
            self._reindex()
        out = np.empty(keys.size, np.int64)
        before = self.n_free
        self.n_free, count = _place(self.index, self.keys, keys, self.free, self.n_free,
                                    self.count, out)
        self.live += (before - self.n_free) + (count - self.count)
        if count != self.count:  # the count first: rows beyond it are never read again
            self.count = count
            if record:
                replace_json(os.path.join(self.folder, "table.json"),
                             {"width": self.width, "count": count})
        return out

    def find(self, keys: np.ndarray) -> np.ndarray:
        return host_index.find(self.index, self.keys, keys)

    def erase(self, keys: np.ndarray) -> int:
        rows = self.find(keys)
        rows = unique(rows[rows >= 0])
        if rows.size:
            self.keys[rows] = FREE
            if self.n_free + rows.size > self.free.size:
                self.free = np.concatenate([self.free[:self.n_free], rows[::-1]])
            else:
                self.free[self.n_free:self.n_free + rows.size] = rows[::-1]
            self.n_free += rows.size
            self.live -= rows.size
            self.stale += rows.size
        return int(rows.size)

    def flush(self) -> None:
        if self.capacity:
            self.keys.flush()
            self.rows.flush()


class RowFileStore:
    """A folder of tables of fixed-width float32 rows (see the module docstring). Every call
    holds the store's lock: the streaming runner reads ahead and writes back on another
    thread."""

    def __init__(self, path: str, *, label: str = "path", durable: bool = True):
        self.path = path
        # durable False (an eviction's spill: the run's scratch, its rows in every
        # checkpoint): writes stay in the page cache, not flushed or counted on disk each time
        self.durable = durable
        marker = os.path.join(path, MARKER)
        if os.path.isdir(path) and os.listdir(path) and not os.path.exists(marker):
            raise StoreError(f"{label} {path}: holds files that are not a jctr row_file store "
                             "(a RocksDB sparse_store is opened with type rocks_db); nothing "
                             "was written there")
        os.makedirs(os.path.join(path, "meta"), exist_ok=True)
        if not os.path.exists(marker):
            replace_json(marker, FORMAT)
        self._lock = threading.RLock()
        self._tables: dict[str, _Table] = {}

    def _folder(self, table: str) -> str:
        return os.path.join(self.path, "tables", table)

    def _table(self, table: str, width: int | None = None) -> _Table | None:
        t = self._tables.get(table)
        if t is None:
            if os.path.exists(os.path.join(self._folder(table), "table.json")):
                t = _Table(self._folder(table))
            elif width is not None:
                t = _Table(self._folder(table), width)
            else:
                return None
            self._tables[table] = t
        if width is not None:
            check_dim(f"row_file {self.path}", table, t.width, width)
        return t

    def insert(self, table: str, keys, values) -> None:
        """Write (overwrite) rows; a key given twice keeps its last row."""
        keys = as_keys(keys)
        self._write(table, keys, as_values(values, keys.size))

    def _write(self, table: str, keys: np.ndarray, rows: np.ndarray) -> None:
        if keys.size:
            with self._lock:
                t = self._table(table, rows.shape[1])
                at = t.place(keys, record=self.durable)  # first: it may map grown files
                scatter_rows(t.rows, at, rows)  # 1.8x numpy's row scatter into the map
                if self.durable:
                    t.flush()

    def ingest_columns(self, table: str, keys, columns: list[np.ndarray]) -> None:
        """:meth:`insert` of rows given as float32 column blocks side by side (a row
        store's vector, optimizer slots, ...). Packed first: one scatter of whole rows is
        ~3x faster than a scatter per block into column slices (2.5M rows of 22 floats:
        0.14 s against 0.38-0.51 s)."""
        keys = as_keys(keys)
        if keys.size:
            self._write(table, keys, np.concatenate(
                [np.asarray(c, np.float32).reshape(keys.size, -1) for c in columns], axis=1))

    def lookup(self, table: str, keys, dim: int) -> tuple[np.ndarray, np.ndarray]:
        keys, values, found = no_rows(keys, dim)
        with self._lock:
            t = self._table(table)
            if t is None or not keys.size:
                return values, found
            check_dim(f"row_file {self.path}", table, t.width, dim)
            rows = t.find(keys)
            found = rows >= 0
            if found.all():
                return np.take(t.rows, rows, axis=0), found
            values[found] = np.take(t.rows, rows[found], axis=0)
            return values, found

    lookup_by_scan = lookup  # a point read is a gather here: no scan is cheaper

    def erase(self, table: str, keys) -> None:
        keys = as_keys(keys)
        with self._lock:
            t = self._table(table)
            if t is not None and keys.size and t.erase(keys):
                t.flush()

    def scale_columns(self, table: str, at: int, factors: np.ndarray) -> None:
        """Columns ``at, at + 1, ...`` of every row multiplied by ``factors`` (float32), in
        place (the streaming statistics' daily decay of a row store's admission counts)."""
        f = np.asarray(factors, np.float32)
        with self._lock:
            t = self._table(table)
            if t is None:
                return
            for start in range(0, t.count, 1 << 20):
                t.rows[start:start + (1 << 20), at:at + f.size] *= f
            t.flush()

    def items(self, table: str, chunk: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(keys, rows) of every stored row, ``chunk`` at a time (copies)."""
        with self._lock:
            t = self._table(table)
            if t is None:
                return
            keys, rows, count = t.keys, t.rows, t.count
        for start in range(0, count, chunk):
            k = np.array(keys[start:start + chunk])
            live = k != FREE
            yield k[live], np.array(rows[start:start + chunk][live])

    def size(self, table: str) -> int:
        with self._lock:
            t = self._table(table)
            return 0 if t is None else t.live

    estimated_rows = size

    def get_meta(self, table: str) -> dict | None:
        path = os.path.join(self.path, "meta", table + ".json")
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise StoreError(f"row_file {path}: unreadable ({e})") from e

    def set_meta(self, table: str, meta: dict | None) -> None:
        path = os.path.join(self.path, "meta", table + ".json")
        if meta is None:
            if os.path.exists(path):
                os.remove(path)
            return
        replace_json(path, meta)

    def drop_table(self, table: str) -> None:
        with self._lock:
            self._tables.pop(table, None)
            shutil.rmtree(self._folder(table), ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            for t in self._tables.values():
                t.flush()
                if t._mapped is not None:
                    t._mapped.close()
            self._tables.clear()
