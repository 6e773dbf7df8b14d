"""The CPU memory database: ``hash_map`` and ``parallel_hash_map``.

Each table is columns of rows (keys, values, stamps, partitions) and an open-addressing index
over them (slots at most half full, linear probing; compiled kernels of
:mod:`jctr.ops.host_index` that release the GIL). Rows are grown ``allocation_rate`` bytes at a
time. Partitions are HugeCTR's unit of overflow handling: every key belongs to one of
``num_partitions`` (by its hash), and a partition that grows past ``overflow_margin`` keys is
cut to ``overflow_margin * overflow_resolution_target`` by the ``overflow_policy``:
``evict_oldest`` drops the keys written (or, with ``refresh_time_after_fetch``, read) longest
ago, ``evict_random`` random ones. ``parallel_hash_map`` splits large lookups and inserts over
a thread pool of ``num_partitions`` threads (the kernels and numpy's gathers release the GIL).

Example::

    store = HashMapStore(VolatileDatabaseParams(type="hash_map", overflow_margin=1000))
    store.insert("hps_et.m.t", keys, vectors)
    values, found = store.lookup("hps_et.m.t", keys, dim)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jctr.config.hps import VolatileDatabaseParams
from jctr.ops import host_index
from jctr.stores.base import (
    StoreError,
    as_keys,
    as_values,
    check_dim,
    partition_of,
)

_PARALLEL_MIN = 32768  # keys per thread below which splitting a lookup costs more than it gains


class HostTable:
    """One table: key -> row (open addressing) and rows of values, stamps and partitions."""

    def __init__(self, dim: int, allocation_rate: int, num_partitions: int):
        self.dim = dim
        self.num_partitions = num_partitions
        self.grow_rows = max(1024, allocation_rate // (4 * dim))
        self.size = 0
        self.keys = np.empty(0, np.int64)
        self.values = np.empty((0, dim), np.float32)
        self.stamps = np.empty(0, np.int64)
        self.parts = np.empty(0, np.int32)
        self._sizes = np.zeros(num_partitions, np.int64)
        self._alloc_slots(16)

    def _alloc_slots(self, n: int) -> None:
        self.index = np.full(n, -1, _index_dtype(n))

    # -- probing (compiled: jctr.ops.host_index) ------------------------------------------------
    def find(self, keys: np.ndarray) -> np.ndarray:
        """Row of each key, -1 where absent."""
        return host_index.find(self.index, self.keys, keys)

    def _rebuild_slots(self, min_rows: int) -> None:
        slots = host_index.index_size(min_rows)
        self.index = np.empty(slots, _index_dtype(slots))
        host_index.rebuild_distinct(self.index, self.keys, self.size)  # keys distinct

    # -- updates ------------------------------------------------------------------------------
    def upsert(self, keys: np.ndarray, values: np.ndarray, now: int) -> None:
        need = self.size + keys.size  # room for every key to be new
        if need > self.keys.size:  # allocation_rate at a time
            self._grow_columns(max(need, self.keys.size + min(max(self.keys.size, 1024),
                                                              self.grow_rows)))
        if 2 * need > self.index.size:
            self._rebuild_slots(need)
        old = self.size
        # in the keys' order: a key given twice keeps its last row (values: as_values')
        self.size = int(host_index.upsert_values(self.index, self.keys, old, keys, values,
                                                 self.values, self.stamps, now))
        new_parts = partition_of(self.keys[old:self.size], self.num_partitions)
        self.parts[old:self.size] = new_parts
        self._sizes += np.bincount(new_parts, minlength=self.num_partitions)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows in all, made at once: a load that knows its rows grows no
        column again and again (each growth copies them all; its peak holds two sets)."""
        if rows > self.keys.size:
            self._grow_columns(rows)
        if 2 * rows > self.index.size:
            self._rebuild_slots(rows)

    def _grow_columns(self, rows: int) -> None:
        for name in ("keys", "values", "stamps", "parts"):
            setattr(self, name, _grown(getattr(self, name), rows))

    def remove_rows(self, drop: np.ndarray) -> None:
        """Remove the rows where ``drop`` (bool [size]) and compact the rest."""
        keep = ~drop
        n = int(keep.sum())
        for name in ("keys", "values", "stamps", "parts"):
            arr = getattr(self, name)
            arr[:n] = arr[:self.size][keep]
        self.size = n
        self._sizes = np.bincount(self.parts[:n], minlength=self.num_partitions)
        self._rebuild_slots(max(n, 8))

    def erase_keys(self, keys: np.ndarray) -> None:
        """Remove the rows of ``keys`` (absent ones skipped) in time proportional to them,
        not to the table: online updates erase a few keys of a large table at a time."""
        self.size = int(host_index.erase_rows(self.index, self.keys, self.size, keys,
                                              self.values, self.stamps, self.parts,
                                              self._sizes))

    def partition_sizes(self) -> np.ndarray:
        """Keys per partition (kept as rows come and go: an insert does not count them all)."""
        return self._sizes


def _index_dtype(slots: int):
    """Row numbers of an index of ``slots`` slots (it holds at most half as many rows before
    it is rebuilt larger): int32 below 2**31 rows, half the bytes of int64."""
    return np.int32 if slots // 2 < 2**31 - 1 else np.int64


def hash_map_bytes(rows: int, dim: int) -> int:
    """Bytes a :class:`HostTable` of ``rows`` rows of ``dim`` floats takes, made at once
    (:meth:`HostTable.reserve`): its columns and its index (at most half full)."""
    slots = host_index.index_size(int(rows))
    return int(rows) * (8 + 4 * dim + 8 + 4) + np.dtype(_index_dtype(slots)).itemsize * slots


def _grown(arr: np.ndarray, rows: int) -> np.ndarray:
    out = np.empty((rows,) + arr.shape[1:], arr.dtype)
    out[:arr.shape[0]] = arr
    return out


class HashMapStore:
    """``hash_map`` / ``parallel_hash_map`` volatile database (see the module docstring)."""

    def __init__(self, params: VolatileDatabaseParams | None = None, seed: int = 0):
        self.params = params or VolatileDatabaseParams(type="hash_map")
        self.name = self.params.type
        self.num_partitions = self.params.partitions
        self._tables: dict[str, HostTable] = {}
        self._meta: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(seed)
        self._pool = (ThreadPoolExecutor(self.num_partitions, thread_name_prefix="hps-map")
                      if self.params.type == "parallel_hash_map" and self.num_partitions > 1
                      else None)
        self.evicted = 0  # keys dropped by the overflow policy (metrics)

    def _table(self, table: str, dim: int | None) -> HostTable | None:
        t = self._tables.get(table)
        if t is not None and dim is not None:
            check_dim(self.name, table, t.dim, dim)
        return t

    def lookup(self, table: str, keys, dim: int) -> tuple[np.ndarray, np.ndarray]:
        keys = as_keys(keys)
        with self._lock:
            t = self._table(table, dim)
            if t is None:
                return np.zeros((keys.size, dim), np.float32), np.zeros(keys.size, bool)
            rows = self._chunked(t.find, keys)
            found = rows >= 0
            if found.all():
                values = np.take(t.values, rows, axis=0)
            else:
                values = np.take(t.values, np.where(found, rows, 0), axis=0) if t.size else \
                    np.zeros((keys.size, dim), np.float32)
                values[~found] = 0.0
            if self.params.refresh_time_after_fetch and found.any():
                t.stamps[rows[found]] = time.monotonic_ns()
        return values, found

    def _chunked(self, fn, keys: np.ndarray) -> np.ndarray:
        if self._pool is None or keys.size < 2 * _PARALLEL_MIN:
            return fn(keys)
        parts = np.array_split(keys, min(self.num_partitions, keys.size // _PARALLEL_MIN))
        return np.concatenate(list(self._pool.map(fn, parts)))

    def reserve(self, table: str, rows: int, dim: int) -> None:
        """Room for ``rows`` rows of ``table`` made now (a load: see
        :meth:`HostTable.reserve`)."""
        with self._lock:
            t = self._table(table, dim)
            if t is None:
                t = self._tables[table] = HostTable(dim, self.params.allocation_rate,
                                                    self.num_partitions)
            t.reserve(int(rows))

    def insert(self, table: str, keys, values) -> None:
        keys = as_keys(keys)
        values = as_values(values, keys.size)
        if not keys.size:
            return
        with self._lock:
            t = self._table(table, values.shape[1])
            if t is None:
                t = self._tables[table] = HostTable(values.shape[1], self.params.allocation_rate,
                                                    self.num_partitions)
            t.upsert(keys, values, time.monotonic_ns())
            self._resolve_overflow(t)

    def _resolve_overflow(self, t: HostTable) -> None:
        margin = self.params.overflow_margin
        sizes = t.partition_sizes()
        over = np.flatnonzero(sizes > margin)
        if not over.size:
            return
        target = int(margin * self.params.overflow_resolution_target)
        drop = np.zeros(t.size, bool)
        for p in over:
            rows = np.flatnonzero(t.parts[:t.size] == p)
            n = rows.size - target
            if self.params.overflow_policy == "evict_oldest":
                victims = rows[np.argpartition(t.stamps[rows], n - 1)[:n]]
            else:
                victims = self._rng.choice(rows, n, replace=False)
            drop[victims] = True
        self.evicted += int(drop.sum())
        t.remove_rows(drop)

    def erase(self, table: str, keys) -> None:
        keys = as_keys(keys)
        with self._lock:
            t = self._tables.get(table)
            if t is None or not keys.size:
                return
            t.erase_keys(keys)

    def size(self, table: str) -> int:
        t = self._tables.get(table)
        return 0 if t is None else t.size

    def partition_sizes(self, table: str) -> np.ndarray:
        t = self._tables.get(table)
        return np.zeros(self.num_partitions, np.int64) if t is None else t.partition_sizes()

    def tables(self) -> list[str]:
        return sorted(self._tables)

    def get_meta(self, table: str) -> dict | None:
        return self._meta.get(table)

    def set_meta(self, table: str, meta: dict | None) -> None:
        if meta is None:
            self._meta.pop(table, None)
        else:
            self._meta[table] = dict(meta)

    def swap_tables(self, a: str, b: str) -> None:
        """Tables ``a`` and ``b`` exchange their rows and manifests at once (see
        :meth:`jctr.stores.rocksdb.RocksDBStore.swap_tables`)."""
        with self._lock:
            for t in (a, b):
                if t not in self._tables:
                    raise StoreError(f"{self.name}: no table {t} to swap")
            self._tables[a], self._tables[b] = self._tables[b], self._tables[a]
            meta_a, meta_b = self._meta.pop(a, None), self._meta.pop(b, None)
            if meta_b is not None:
                self._meta[a] = meta_b
            if meta_a is not None:
                self._meta[b] = meta_a

    def drop_table(self, table: str) -> None:
        with self._lock:
            self._tables.pop(table, None)
            self._meta.pop(table, None)

    def table_keys(self, table: str) -> np.ndarray:
        """Every key ``table`` holds (a copy, in no order; none for a table not there)."""
        with self._lock:
            t = self._tables.get(table)
            return np.zeros(0, np.int64) if t is None else t.keys[:t.size].copy()

    def items(self, table: str, chunk: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        with self._lock:
            t = self._tables.get(table)
            if t is None:
                return
            keys, values = t.keys[:t.size].copy(), t.values[:t.size].copy()
        for i in range(0, keys.size, chunk):
            yield keys[i:i + chunk], values[i:i + chunk]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
