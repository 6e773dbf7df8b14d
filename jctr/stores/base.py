"""What every key-value store offers: tables of 64-bit keys to float32 vectors.

A table is named (HugeCTR's ``hps_et.<model>.<table>``); its vector size is fixed by the first
insert. Lookups return the vectors and a found-mask; missing keys read as zeros. Errors a
caller can recover from (a server gone away) are :class:`StoreUnavailable`; anything the user
must fix (a wrong path, a vector size that does not match) is a :class:`StoreError`.

Example::

    store = HashMapStore(VolatileDatabaseParams(type="hash_map"))
    store.insert("hps_et.m.t", np.array([1, 2]), np.ones((2, 8), np.float32))
    values, found = store.lookup("hps_et.m.t", np.array([2, 3]), 8)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from jctr.errors import UserError
from jctr.ops.hashing import mix64
from jctr.ops.host_sort import ascending_last


class StoreError(UserError, RuntimeError):
    """A store cannot be used as configured (message names the store and what is wrong)."""


class StoreUnavailable(UserError, RuntimeError):
    """A store did not answer (connection refused, timeout, cluster down): the lookup
    hierarchy treats its keys as missing and asks the next layer; a command (``load``) stops
    with this one-line message."""


class PartialUnavailable(StoreUnavailable):
    """Part of a store did not answer (one Redis master of several): ``values`` / ``found``
    hold what the rest answered, ``failed`` marks the keys whose part was down."""

    def __init__(self, message: str, values: np.ndarray, found: np.ndarray,
                 failed: np.ndarray):
        super().__init__(message)
        self.values, self.found, self.failed = values, found, failed


class KeyValueStore(Protocol):
    name: str  # "hash_map", "redis_cluster", "rocks_db", ... (metrics and messages)

    def lookup(self, table: str, keys: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """``(values [n, dim] float32, found [n] bool)`` for int64 ``keys``."""

    def insert(self, table: str, keys: np.ndarray, values: np.ndarray) -> None:
        """Insert or overwrite; a key given twice keeps its last vector."""

    def erase(self, table: str, keys: np.ndarray) -> None:
        """Remove keys (absent ones are ignored)."""

    def size(self, table: str) -> int:
        """Keys held by ``table`` (0 if it does not exist)."""

    def tables(self) -> list[str]:
        ...

    def get_meta(self, table: str) -> dict | None:
        """The table's manifest (what was loaded into it, written last by a load), or None."""

    def set_meta(self, table: str, meta: dict | None) -> None:
        """Write (None: remove) the table's manifest."""

    def drop_table(self, table: str) -> None:
        """Remove the table, its rows and its manifest."""

    def items(self, table: str, chunk: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """All (keys, values) of ``table`` in chunks."""

    def close(self) -> None:
        ...


def as_keys(keys) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(keys).reshape(-1), dtype=np.int64)


def as_values(values, n: int) -> np.ndarray:
    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.ndim != 2 or values.shape[0] != n:
        raise ValueError(f"expected values of shape [{n}, dim], got {values.shape}")
    return values


def first_beyond_int32(keys: np.ndarray) -> int | None:
    """The first key that does not fit in int32 (``supportlonglong`` false), or None."""
    keys = np.asarray(keys)
    if not keys.size or keys.dtype.itemsize <= 4:
        return None
    beyond = (keys < -2 ** 31) | (keys >= 2 ** 31)
    return int(keys[beyond][0]) if beyond.any() else None


def check_dim(where: str, table: str, have: int | None, dim: int) -> None:
    """A table keeps the vector size it was created with."""
    if have is not None and have != dim:
        raise StoreError(f"{where} table {table}: holds vectors of size {have}, asked for size "
                         f"{dim}")


def no_rows(keys, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(int64 keys, zero values [n, dim], found all False)``: a lookup's starting point."""
    keys = as_keys(keys)
    return keys, np.zeros((keys.size, dim), np.float32), np.zeros(keys.size, bool)


def key_columns(keys) -> np.ndarray:
    """Keys as the stores write them: each one's 8 little-endian bytes, [n, 8] uint8."""
    return np.ascontiguousarray(as_keys(keys).astype("<i8")).view(np.uint8).reshape(-1, 8)


def encoded_rows(keys, values, *, key_order: bool = False
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An insert as every store writes it (the one write path of Redis and RocksDB): each
    key once, its last vector; ``(keys, key bytes [n, 8], value bytes [n, 4 * dim])``,
    little-endian, laid out by numpy (no Python per key). Redis sends the byte columns as
    RESP bulk strings, RocksDB one bytes object per row (:func:`row_bytes`). ``key_order``:
    the rows in the order of their key bytes (RocksDB's, :func:`bytewise_order`; its memtable
    takes keys in order ~3x faster than random ones), else in the order given."""
    keys = as_keys(keys)
    values = as_values(values, keys.size)
    kcols = key_columns(keys)
    keep = bytewise_order(kcols) if key_order else last_occurrences(keys)
    if key_order or keep.size != keys.size:
        # np.take: indexing rows with an array is 3-10x slower in numpy 2.4
        keys, values, kcols = (np.take(x, keep, axis=0) for x in (keys, values, kcols))
    vcols = np.ascontiguousarray(values, "<f4").view(np.uint8).reshape(
        keys.size, 4 * values.shape[1])
    return keys, kcols, vcols


def bytewise_order(kcols: np.ndarray) -> np.ndarray:
    """The order RocksDB keeps keys of these bytes ([n, 8] little-endian, :func:`key_columns`)
    in, a key given twice by its last row only."""
    # bytewise order of the little-endian bytes: big-endian, sorted as native integers
    # (jctr.ops.host_sort: numpy's argsort 2-6x slower, of a byte-swapped view slower still)
    return ascending_last(kcols.view(">u8").ravel().astype(np.uint64))


def scatter_rows(dest: np.ndarray, rows: np.ndarray, src: np.ndarray) -> None:
    """``dest[rows] = src`` for a C-contiguous 2-D ``dest``, through a view of one field a
    row: numpy 2.4 scatters whole rows that way ~3x faster (55,000 rows of 16 floats 4.5 ->
    1.4 ms)."""
    width = dest.shape[1] * dest.itemsize
    if not dest.flags.c_contiguous or width == 0:
        dest[rows] = src
        return
    src = np.ascontiguousarray(src, dest.dtype)
    dest.view(f"V{width}").reshape(-1)[rows] = src.view(f"V{width}").reshape(-1)


def row_bytes(columns: np.ndarray) -> list[bytes]:
    """Each row of a [n, w] uint8 array as one bytes object, made by numpy."""
    columns = np.ascontiguousarray(columns)
    return columns.view(f"V{columns.shape[1]}").ravel().tolist()


def last_occurrences(keys: np.ndarray) -> np.ndarray:
    """Positions of the last occurrence of each distinct key (later writes win), ascending."""
    if keys.size < 2:
        return np.arange(keys.size)
    # sorted as the keys' bits: only which positions hold equal keys matters here, not how
    # negative keys rank
    return np.sort(ascending_last(np.ascontiguousarray(keys, np.int64).view(np.uint64)))


def put_found(values: np.ndarray, found: np.ndarray, positions: np.ndarray,
              replies: list[bytes | None]) -> None:
    """Write a batched get's replies (each a float32 vector's bytes, or None: absent) into
    rows ``positions`` of ``values`` and mark them ``found``."""
    hits = [i for i, v in enumerate(replies) if v is not None]
    if hits:
        idx = positions[hits]
        found[idx] = True
        values[idx] = np.frombuffer(b"".join([replies[i] for i in hits]),
                                    np.float32).reshape(-1, values.shape[1])


def partition_of(keys: np.ndarray, num_partitions: int) -> np.ndarray:
    """The partition of each key (the high bits of its hash; slots use the low bits)."""
    return ((mix64(keys.view(np.uint64)) >> np.uint64(40))
            % np.uint64(num_partitions)).astype(np.int64)
