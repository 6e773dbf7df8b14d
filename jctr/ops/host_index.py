"""Compiled host kernels of an open-addressing index from int64 keys to row numbers of column
arrays (numba, ``nogil``: threads run them beside each other and beside a training step). The
streaming statistics (:mod:`jctr.online.key_index`) and the CPU memory database
(:mod:`jctr.stores.hash_map`) keep their keys with it.

The index holds row numbers (-1: empty slot) and compares keys through the key column, so any
int64 is a key; it is kept at most half full (linear probing from a splitmix64 home slot). Rows
are handed out in insertion order; deleting many rows means compacting the columns and
rebuilding the index (:func:`rebuild`; :func:`rebuild_distinct` when the keys are known
distinct), a few of them :func:`erase_rows` (the last row moved into each hole, the slot
emptied by backward shift: no tombstones).

Example::

    index = np.full(index_size(1000), -1, np.int64)
    keys = np.empty(1000, np.int64)
    rows = np.empty(3, np.int64)
    n = upsert(index, keys, 0, np.array([7, 9, 7]), rows)   # n == 2, rows == [0, 1, 0]
    find(index, keys, np.array([9, 8]))                      # [1, -1]
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from jctr.ops import kernel_cache


def host_kernel(fn):
    kernel_cache.install()  # the cache follows the modules the kernel inlines from
    try:  # compiled once, then loaded from numba's on-disk cache
        return numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # no writable cache location (read-only install and home): no cache
        return numba.njit(nogil=True)(fn)


def _prefetch_codegen(write: int):
    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        # read or write, high locality, data cache
        builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, write),
                          ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return codegen


@intrinsic
def prefetch(typingctx, address):
    """Ask the CPU to bring the cache line at ``address`` (an int64) in: probes of keys a few
    places ahead overlap their memory latency with the work on the current key."""
    return types.void(types.int64), _prefetch_codegen(0)


@intrinsic
def prefetch_write(typingctx, address):
    """:func:`prefetch` of a line about to be written (``prefetchw`` where the CPU has it): the
    line comes in owned by this core, so the store does not wait for other cores' copies to
    be dropped (a line another thread read moments before: the split lookup's)."""
    return types.void(types.int64), _prefetch_codegen(1)


@intrinsic
def copy_bytes(typingctx, dst, src, n):
    """Copy ``n`` bytes from address ``src`` to address ``dst`` (int64s; the ranges do not
    overlap): one ``memcpy``. numba's slice assignment of one array's row into another walks
    its general copy loop, 2-3x the time for rows of ~100 bytes (docs/performance.md)."""
    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], i8p),
                           builder.inttoptr(args[1], i8p), args[2], 1)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64), codegen


@numba.njit(inline="always")
def home(key, mask):
    x = np.uint64(key)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return np.int64(x & np.uint64(mask))


@numba.njit(inline="always")
def slot_of(index, keys, k, mask):
    """The index slot holding key ``k``, or the empty slot where its probe ends."""
    s = home(k, mask)
    while True:
        r = index[s]
        if r < 0 or keys[r] == k:
            return s
        s = (s + 1) & mask


@intrinsic
def _load_row(typingctx, address, itemsize):
    """The row number an index slot at ``address`` holds, ``itemsize`` 4 (int32) or 8 (int64)
    bytes, as int64."""
    def codegen(context, builder, signature, args):
        address, itemsize = args
        i32, i64 = ir.IntType(32), ir.IntType(64)
        with builder.if_else(builder.icmp_unsigned("==", itemsize, ir.Constant(i64, 4))) \
                as (narrow, wide):
            with narrow:
                small = builder.sext(builder.load(builder.inttoptr(address, i32.as_pointer())),
                                     i64)
                narrow_block = builder.block
            with wide:
                large = builder.load(builder.inttoptr(address, i64.as_pointer()))
                wide_block = builder.block
        row = builder.phi(i64)
        row.add_incoming(small, narrow_block)
        row.add_incoming(large, wide_block)
        return row
    return types.int64(types.int64, types.int64), codegen


@numba.njit(inline="always")
def fetch_ahead(index_at, index_bytes, keys_at, key16, key8, mask):
    """Ask for the lines a probe will need later: the home slot of ``key16`` (the key 16
    places on), and the key of the row the home slot of ``key8`` (8 places on) holds (that
    slot came in meanwhile), so probes do not wait for memory one after the other (a probe
    reads the index, then a key at the row it names: two dependent misses). Returns that row
    (-1: none). Addresses and scalars only: the same code as an inlined helper that took the
    arrays cost ~100 ns a key, 4-5x the whole probe, and so did a helper inserting a key into
    the arrays (numba inlines the code, not the arrays' reference counting around it;
    docs/performance.md): the kernels write their inserts out in their loops."""
    prefetch(index_at + index_bytes * home(key16, mask))
    r = _load_row(index_at + index_bytes * home(key8, mask), index_bytes)
    if r >= 0:
        prefetch(keys_at + 8 * r)
    return r


@host_kernel
def find(index, keys, queries):
    """Row of each query key, -1 where absent."""
    mask = index.size - 1
    index_at, index_bytes, keys_at = index.ctypes.data, index.itemsize, keys.ctypes.data
    last = queries.size - 1
    out = np.empty(queries.size, np.int64)
    for i in range(queries.size):
        fetch_ahead(index_at, index_bytes, keys_at, queries[min(i + 16, last)],
                    queries[min(i + 8, last)], mask)
        out[i] = index[slot_of(index, keys, queries[i], mask)]
    return out


@host_kernel
def rebuild(index, keys, n):
    """The index of rows ``0 .. n-1``, from an empty one. Returns the first row whose key an
    earlier row holds already (the index is then incomplete), -1 when all are distinct."""
    index[:] = -1
    mask = index.size - 1
    for r in range(n):
        if r + 16 < n:  # the home slot of a key further on, fetched while this one probes
            prefetch(index.ctypes.data + index.itemsize * home(keys[r + 16], mask))
        s = slot_of(index, keys, keys[r], mask)
        if index[s] >= 0:
            return r
        index[s] = r
    return -1


@numba.njit(inline="always")
def _fill_distinct(index, keys, n, skip, skipping):
    index[:] = -1
    mask = index.size - 1
    for r in range(n):
        if r + 32 < n:
            prefetch(index.ctypes.data + index.itemsize * home(keys[r + 32], mask))
        k = keys[r]
        if skipping and k == skip:
            continue
        s = home(k, mask)
        while index[s] >= 0:
            s = (s + 1) & mask
        index[s] = r


@host_kernel
def rebuild_distinct(index, keys, n):
    """:func:`rebuild` for keys known to be distinct (the kept rows of an index being
    compacted): no key is compared, so a probe reads only the index (1.5x faster: 9M rows
    0.19 -> 0.13 s, docs/performance.md)."""
    _fill_distinct(index, keys, n, np.int64(0), False)


@host_kernel
def rebuild_distinct_except(index, keys, n, skip):
    """:func:`rebuild_distinct` of the rows whose key is not ``skip`` (a column that marks
    freed rows with it: :mod:`jctr.stores.row_file`)."""
    _fill_distinct(index, keys, n, skip, True)


def index_size(rows: int) -> int:
    """Slots for ``rows`` rows: a power of two at least twice as many (at least 1,024)."""
    return 1 << max(10, int(2 * max(rows, 1) - 1).bit_length())


@host_kernel
def upsert(index, keys, n, queries, out):
    """Row of each query key into ``out``; a key not there yet gets a new row (``n``,
    ``n + 1``, ...; its key written into ``keys``). The key column must have room for
    ``n + queries.size`` rows and the index twice that many slots. Returns the new row count."""
    mask = index.size - 1
    index_at, index_bytes, keys_at = index.ctypes.data, index.itemsize, keys.ctypes.data
    last = queries.size - 1
    for i in range(queries.size):
        fetch_ahead(index_at, index_bytes, keys_at, queries[min(i + 16, last)],
                    queries[min(i + 8, last)], mask)
        k = queries[i]
        s = slot_of(index, keys, k, mask)
        r = index[s]
        if r < 0:  # a new key: the next row (written here, not in a helper: see fetch_ahead)
            r = n
            index[s] = r
            keys[r] = k
            n += 1
        out[i] = r
    return n


@host_kernel
def upsert_values(index, keys, n, queries, src, dest, stamps, now):
    """:func:`upsert` that writes each query's row of ``src`` into its row of ``dest`` and
    ``now`` into its row of ``stamps``, in the queries' order, so the last of a key given twice
    is what stays (the hash map's insert: no dedupe pass before it, no scatter after).
    ``dest`` and ``keys`` need room for ``n + queries.size`` rows. Returns the new row count."""
    mask = index.size - 1
    index_at, index_bytes, keys_at = index.ctypes.data, index.itemsize, keys.ctypes.data
    last = queries.size - 1
    m, width = queries.size, src.shape[1]
    row_bytes = dest.itemsize * width
    for i in range(m):
        r = fetch_ahead(index_at, index_bytes, keys_at, queries[min(i + 16, last)],
                        queries[min(i + 8, last)], mask)
        if r >= 0:  # that key's row of values is written soon too
            prefetch(dest.ctypes.data + row_bytes * r)
        k = queries[i]
        s = slot_of(index, keys, k, mask)
        r = index[s]
        if r < 0:  # a new key: the next row
            r = n
            index[s] = r
            keys[r] = k
            n += 1
        for j in range(width):
            dest[r, j] = src[i, j]
        stamps[r] = now
    return n


@host_kernel
def erase_rows(index, keys, n, queries, values, stamps, parts, sizes):
    """Rows ``0 .. n-1`` without the query keys' (absent ones, and a key's repeats,
    skipped), in time proportional to the queries: each erased row takes the last row (key,
    values, stamp, partition; its index slot follows it) and its slot is emptied by backward
    shift (a later entry of the probe run whose home does not lie after the hole moves into
    it), so no tombstone is left and probes stay as long as they were; ``sizes`` (rows per
    partition) counts each erased row off. Returns the new row count."""
    mask = index.size - 1
    width = values.shape[1]
    for i in range(queries.size):
        s = slot_of(index, keys, queries[i], mask)
        r = index[s]
        if r < 0:
            continue
        sizes[parts[r]] -= 1
        hole, j = s, s
        while True:  # backward-shift deletion
            j = (j + 1) & mask
            rj = index[j]
            if rj < 0:
                break
            h = home(keys[rj], mask)
            stays = (hole < h <= j) if hole <= j else (h > hole or h <= j)
            if not stays:
                index[hole] = rj
                hole = j
        index[hole] = -1
        last = n - 1
        if r != last:  # the last row into the erased one
            k = keys[last]
            index[slot_of(index, keys, k, mask)] = r
            keys[r] = k
            for c in range(width):
                values[r, c] = values[last, c]
            stamps[r] = stamps[last]
            parts[r] = parts[last]
        n -= 1
    return n


@host_kernel
def scatter_found(index, keys, queries, src, dest, held):
    """Each query key's row of ``src`` into its row of ``dest`` (marked in ``held``), for the
    query keys the index holds; the others are passed over. Returns how many were found. A
    scan's rows into the rows of the keys asked for, in one pass: no found mask, no copy of
    the found rows before their scatter (a pass over a 5M-row RocksDB table: ~450 ns a
    stored row in the find, mask and scatter; docs/performance.md)."""
    mask = index.size - 1
    index_at, index_bytes, keys_at = index.ctypes.data, index.itemsize, keys.ctypes.data
    last = queries.size - 1
    m, width = queries.size, src.shape[1]
    row_bytes = dest.itemsize * width
    found = 0
    for i in range(m):
        r = fetch_ahead(index_at, index_bytes, keys_at, queries[min(i + 16, last)],
                        queries[min(i + 8, last)], mask)
        if r >= 0:  # where that key's row goes, if it is the key asked for
            prefetch(dest.ctypes.data + row_bytes * r)
        r = index[slot_of(index, keys, queries[i], mask)]
        if r >= 0:
            for j in range(width):
                dest[r, j] = src[i, j]
            held[r] = True
            found += 1
    return found


@host_kernel
def keep_absent(index, keys, queries, src, out_keys, out_rows):
    """The query keys the index does not hold, and their rows of ``src``, packed in order
    into ``out_keys`` / ``out_rows`` (room for every query). Returns how many. A scan's
    rows but those of a set of keys, in one pass (no mask, no two compressing copies)."""
    mask = index.size - 1
    index_at, index_bytes, keys_at = index.ctypes.data, index.itemsize, keys.ctypes.data
    last = queries.size - 1
    m, width = queries.size, src.shape[1]
    kept = 0
    for i in range(m):
        fetch_ahead(index_at, index_bytes, keys_at, queries[min(i + 16, last)],
                    queries[min(i + 8, last)], mask)
        if index[slot_of(index, keys, queries[i], mask)] < 0:
            out_keys[kept] = queries[i]
            for j in range(width):
                out_rows[kept, j] = src[i, j]
            kept += 1
    return kept


class KeySet:
    """Distinct int64 keys gathered batch by batch, through the compiled index: a set of
    millions of keys without sorting them (``np.unique`` of their concatenation sorts).

    Example::

        seen = KeySet()
        seen.add(np.array([5, 3, 5])); seen.add(np.array([9, 3]))
        seen.keys()                          # [5, 3, 9]: each once, in the order they came
        seen.contains(np.array([3, 4]))      # [True, False]
        seen.positions(np.array([9, 4]))     # [2, -1]
    """

    def __init__(self, capacity: int = 1 << 16):
        self._keys = np.empty(capacity, np.int64)
        self._index = np.full(index_size(capacity), -1, np.int64)
        self._n = 0
        self._rows = np.empty(0, np.int64)

    def clear(self) -> None:
        """No keys (the memory kept)."""
        self._index[:] = -1
        self._n = 0

    def add(self, keys: np.ndarray) -> None:
        keys = np.ascontiguousarray(keys, np.int64)
        need = self._n + keys.size
        if need > self._keys.size:  # room for every key to be new, the index half full
            grown = np.empty(max(need, 2 * self._keys.size), np.int64)
            grown[:self._n] = self._keys[:self._n]
            self._keys = grown
            self._index = np.empty(index_size(grown.size), np.int64)
            rebuild_distinct(self._index, self._keys, self._n)
        if self._rows.size < keys.size:
            self._rows = np.empty(keys.size, np.int64)
        self._n = int(upsert(self._index, self._keys, self._n, keys, self._rows[:keys.size]))

    def keys(self) -> np.ndarray:
        """Each key once, in the order they were first added."""
        return self._keys[:self._n].copy()

    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self.positions(keys) >= 0

    def absent_rows(self, keys: np.ndarray, rows: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """The keys not in the set and their rows (``rows[i]`` is key ``i``'s), in order."""
        keys = np.ascontiguousarray(keys, np.int64)
        rows = np.ascontiguousarray(rows)
        out_keys = np.empty(keys.size, np.int64)
        out_rows = np.empty_like(rows)
        n = keep_absent(self._index, self._keys, keys, rows, out_keys, out_rows)
        return out_keys[:n], out_rows[:n]

    def positions(self, keys: np.ndarray) -> np.ndarray:
        """Each key's place in :meth:`keys` (the order added), -1 where absent."""
        return find(self._index, self._keys, np.ascontiguousarray(keys, np.int64))

    def __len__(self) -> int:
        return self._n
