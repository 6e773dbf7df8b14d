"""Compiled host kernels that put rows in key order for the stores' sorted writes (RocksDB's
write batches and bulk loads take keys in their byte order): a radix argsort of uint64 keys
and a gather of column blocks into packed rows (numba, ``nogil``).

numpy's ``argsort`` of 64-bit integers is a comparison sort: 0.76 s for 4M keys on an AVX2
machine, where its ``sort`` of the same keys takes 0.11 s; a streaming pass's write-back sorts
that many. The radix sort here is stable, so a key given twice keeps its positions in order.

Example::

    order = argsort_u64(np.array([5, 1, 5, 0], np.uint64))   # [3, 1, 0, 2]
    out = np.empty((4, 3), np.float32)
    gather_rows(out, 0, np.arange(8, dtype=np.float32).reshape(4, 2), order)  # out[:, 0:2]
"""

from __future__ import annotations

import numpy as np

from jctr.ops.host_index import host_kernel, prefetch

_BITS = 11  # digits of 11 bits: 6 passes over 64-bit keys, 2,048 counters a pass (in L1)
_PASSES = -(-64 // _BITS)
_RADIX = 1 << _BITS
_SMALL = 4096  # below this numpy's argsort is as fast (no histogram passes to pay for)


@host_kernel
def _radix_argsort(keys, order, spare_keys, spare_order):
    """Positions of ``keys`` in ascending order (stable) into ``order`` (``keys`` and the
    spare buffers are overwritten)."""
    n = keys.size
    counts = np.zeros((_PASSES, _RADIX), np.int64)
    mask = np.uint64(_RADIX - 1)
    for i in range(n):  # every pass's histogram in one read of the keys
        k = keys[i]
        order[i] = i
        for p in range(_PASSES):
            counts[p, np.int64((k >> np.uint64(p * _BITS)) & mask)] += 1
    src_k, src_o, dst_k, dst_o = keys, order, spare_keys, spare_order
    moves = 0
    for p in range(_PASSES):
        c = counts[p]
        if c.max() == n:  # every key has this digit: the pass would not move one
            continue
        total = 0
        for d in range(_RADIX):
            here = c[d]
            c[d] = total
            total += here
        shift = np.uint64(p * _BITS)
        for i in range(n):
            k = src_k[i]
            d = np.int64((k >> shift) & mask)
            at = c[d]
            c[d] = at + 1
            dst_k[at] = k
            dst_o[at] = src_o[i]
        src_k, src_o, dst_k, dst_o = dst_k, dst_o, src_k, src_o
        moves += 1
    if moves % 2:  # the last pass wrote the spare positions
        order[:] = spare_order


def _simd_argsort() -> bool:
    """Whether numpy's own argsort of 64-bit integers is its AVX-512 one (x86-simd-sort):
    2.5M keys in ~0.12 s, 2-3x this radix sort; elsewhere a comparison sort, slower."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:  # numpy < 2
        return False
    return bool(__cpu_features__.get("AVX512_SKX"))


SIMD_ARGSORT = _simd_argsort()


def argsort_u64(keys: np.ndarray, *, stable: bool = True) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` of uint64 ``keys`` (int64 positions): by one sort
    of packed values (:func:`_packed_argsort`; 2.5M keys ~0.05 s) where the keys' top bits
    tell most of them apart, else by radix (4M random keys in 0.35 s instead of 0.92 s; an
    AVX2 machine). ``stable=False``: equal keys may come in any order (numpy's vectorized
    argsort where the CPU has AVX-512, :data:`SIMD_ARGSORT`, when the packed sort does not
    take the keys)."""
    keys = np.asarray(keys, np.uint64)
    if keys.size < _SMALL:
        return np.argsort(keys, kind="stable" if stable else None)
    packed = _packed_argsort(keys)
    if packed is not None:
        return packed[0]
    if not stable and SIMD_ARGSORT:
        return np.argsort(keys)
    return _radix_order(keys)


def _radix_order(keys: np.ndarray) -> np.ndarray:
    order = np.empty(keys.size, np.int64)
    _radix_argsort(keys.copy(), order, np.empty_like(keys), np.empty_like(order))
    return order


_REPAIR = 4  # a packed sort's repair may move up to this many positions a key, on average


def ascending_last(values: np.ndarray) -> np.ndarray:
    """Positions of uint64 ``values`` in ascending order, a value given more than once by
    its last position only (a key's latest row: the stores' sorted writes)."""
    values = np.asarray(values, np.uint64)
    if values.size < _SMALL:
        order = np.argsort(values, kind="stable")
    else:
        packed = _packed_argsort(values)
        if packed is not None and not packed[1]:  # no two equal (the sort saw every tie)
            return packed[0]
        order = _radix_order(values) if packed is None else packed[0]
    if order.size < 2:
        return order
    ordered = np.take(values, order)
    last = np.empty(ordered.size, bool)
    last[-1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=last[:-1])
    return order if last.all() else order[last]


def _packed_argsort(keys: np.ndarray) -> tuple[np.ndarray, bool] | None:
    """The stable argsort of ``keys`` by one sort of values, not of positions: each key with
    its position in the low ``log2(n)`` bits (numpy sorts 2.5M uint64 values in ~0.03 s, by
    AVX-512 or AVX2 code, where its argsort takes 0.2-0.3 s and the radix sort 0.16-0.4).
    Keys whose span leaves those bits free are shifted up whole (less the least: exact);
    others keep their top bits, and the runs whose top bits tie are put in order by their
    whole keys (insertion: ties stay in position order). The keys of a table file's write
    (bytes reversed: a key below 2**40 has no low bits) tie only when equal. None when the
    repair would move more than :data:`_REPAIR` positions a key (keys told apart by their
    low bits alone); else the order and whether two keys were equal."""
    n = keys.size
    shift = max(1, (n - 1).bit_length())
    least = keys.min()
    whole = int(keys.max() - least) < 1 << (64 - shift)
    packed = np.empty(n, np.uint64)
    _pack(keys, np.uint64(shift), least if whole else np.uint64(0), whole, packed)
    packed.sort()
    shift = np.uint64(shift)
    order = np.empty(n, np.int64)
    ties = _unpack_order(packed, keys, shift, order, _REPAIR * n)
    return None if ties < 0 else (order, ties > 0)


@host_kernel
def _pack(keys, shift, least, whole, packed):
    for i in range(keys.size):
        if whole:
            packed[i] = ((keys[i] - least) << shift) | np.uint64(i)
        else:
            packed[i] = ((keys[i] >> shift) << shift) | np.uint64(i)


@host_kernel
def _unpack_order(packed, keys, shift, order, budget):
    """``order``: the positions in ``packed`` (sorted), each run of equal top bits sorted by
    ``keys`` (stable); returns -1 if that took more than ``budget`` moves, else 1 if two
    keys were equal, 0 if not."""
    n = packed.size
    low = (np.uint64(1) << shift) - np.uint64(1)
    ties = 0
    start = 0
    top = packed[0] >> shift
    order[0] = np.int64(packed[0] & low)
    for i in range(1, n + 1):
        if i < n:
            order[i] = np.int64(packed[i] & low)
            here = packed[i] >> shift
            if here == top:
                continue
            top = here
        for j in range(start + 1, i):  # a run of tied top bits (mostly none: i == start + 1)
            p = order[j]
            k = keys[p]
            m = j
            while m > start and keys[order[m - 1]] > k:
                order[m] = order[m - 1]
                m -= 1
            order[m] = p
            if m > start and keys[order[m - 1]] == k:
                ties = 1
            budget -= j - m
            if budget < 0:
                return -1
        start = i
    return ties


_AHEAD = 16  # rows between the fetch of a source row's line and its copy


@host_kernel
def _gather(out, at, block, order):
    width = block.shape[1]
    n = order.size
    base = block.ctypes.data
    row_bytes = block.strides[0]
    for i in range(n):
        if i + _AHEAD < n:
            prefetch(base + order[i + _AHEAD] * row_bytes)
        r = order[i]
        for c in range(width):
            out[i, at + c] = block[r, c]


def take_rows(src: np.ndarray, order: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = src[order]`` along the first axis: float32 row blocks by the compiled
    gather (:func:`gather_rows`; 2.1x ``np.take``'s rate for 1.5M rows of 57 floats,
    docs/performance.md), any other array by ``np.take``."""
    if src.dtype == np.float32 and src.ndim == 2 and out.flags.c_contiguous:
        gather_rows(out, 0, src, order)
    else:
        np.take(src, order, axis=0, out=out)


def gather_rows(out: np.ndarray, at: int, block: np.ndarray, order: np.ndarray) -> None:
    """``out[:, at:at + w] = block[order]`` (float32, ``block`` [n, w] C-contiguous, ``out``
    [order.size, >= at + w]) in one pass: numpy's ``take`` into a temporary and the copy into
    the strided columns read and write every row twice."""
    block = np.ascontiguousarray(block, np.float32)
    if out.dtype != np.float32 or out.ndim != 2 or at + block.shape[1] > out.shape[1] \
            or order.size != out.shape[0]:
        raise ValueError(f"gather_rows: rows [{order.size}, {block.shape[1]}] at {at} do not "
                         f"fit {out.dtype} {out.shape}")
    order = np.ascontiguousarray(order, np.int64)
    if order.size and (order.min() < 0 or order.max() >= block.shape[0]):
        raise ValueError(f"gather_rows: positions outside the block's {block.shape[0]} rows")
    _gather(out, np.int64(at), block, order)  # compiled: no bounds checks of its own


def unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` (the distinct values, ascending) by a sort. numpy 2.3 and later
    find a plain ``np.unique``'s values with a hash set, as ``union1d``, ``intersect1d``,
    ``setdiff1d`` and ``isin`` then do: 756 ms for 1M random int64 keys, 3.9 s for 4M, against
    11 and 55 ms sorted (numpy 2.4.6; docs/performance.md)."""
    s = np.sort(np.ravel(values))
    if s.size < 2:
        return s
    keep = np.empty(s.size, bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def first_repeat(values: np.ndarray) -> int | None:
    """The smallest value ``values`` holds more than once, or None (a sort, see
    :func:`unique`)."""
    s = np.sort(np.ravel(values))
    same = np.flatnonzero(s[1:] == s[:-1])
    return int(s[same[0]]) if same.size else None


# a run at least this long (past the caches) is searched by values sorted first, when there
# are at least this many
_SORT_FIRST_RUN = 1 << 20
_SORT_FIRST_VALUES = 4096


def _in_sorted(values: np.ndarray, run: np.ndarray) -> np.ndarray:
    """Which of ``values`` the ascending ``run`` holds (a binary search each)."""
    if not run.size:
        return np.zeros(values.shape, bool)
    if run.size >= _SORT_FIRST_RUN and values.size >= _SORT_FIRST_VALUES:
        # values in order walk a run larger than the caches along one path (each search
        # starts where the last ended): 65,536 random keys in 20M, 57 -> 19 ms with the sort;
        # values from a narrow range (a chunk of a pass in key order) search only its part
        order = np.argsort(values, axis=None, kind="stable")
        ordered = np.ravel(values)[order]
        lo, hi = np.searchsorted(run, ordered[[0, -1]], side="left")
        found = np.zeros(values.size, bool)
        part = run[lo:hi + 1]
        if part.size:
            found[order] = _found(ordered, part)
        return found.reshape(values.shape)
    return _found(values, run)


def _found(values: np.ndarray, run: np.ndarray) -> np.ndarray:
    at = np.searchsorted(run, values)
    np.minimum(at, run.size - 1, out=at)
    return run[at] == values


def isin(values: np.ndarray, test: np.ndarray, *, test_sorted: bool = False) -> np.ndarray:
    """``np.isin(values, test)`` (bool, ``values``' shape) by a sort of ``test`` and a binary
    search of each value (see :func:`unique` for why not numpy's). ``test_sorted``: ``test``
    is ascending already, its sort skipped (a large set tested chunk by chunk, whose sort
    each call would cost more than the searches)."""
    test = np.ravel(test)
    return _in_sorted(np.asarray(values), test if test_sorted else np.sort(test))


def union_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The union of two ascending arrays of distinct values (``np.union1d``), ascending: ``b``'s
    new values inserted into ``a`` in one pass over it, not a sort of both (a set that only
    grows, joined with a few new keys at a time)."""
    if not a.size or not b.size:
        return (b if not a.size else a).copy()
    at = np.searchsorted(a, b)
    new = a[np.minimum(at, a.size - 1)] != b
    return np.insert(a, at[new], b[new])


class SortedRuns:
    """A set of int64 values that grows a few at a time and is read whole now and then: kept
    as ascending runs of distinct values, each run under half the size of the one before (the
    last two merged while it is not), so adding k values copies O(k log n) values over time
    instead of the whole set each time (:func:`union_sorted` into one array: 181 ms to join
    200,000 keys to 20M; docs/performance.md). A value may sit in two runs until they merge:
    :meth:`size_bound` is at most twice the set's size.

    Example::

        seen = SortedRuns()
        seen.add(unique(batch_keys))
        if seen.size_bound() > limit and len(seen.values()) > limit: ...
    """

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def add(self, values: np.ndarray) -> None:
        """Join ``values`` (ascending, distinct) to the set."""
        if not values.size:
            return
        self._runs.append(np.ascontiguousarray(values, np.int64))
        while len(self._runs) > 1 and 2 * self._runs[-1].size >= self._runs[-2].size:
            newer = self._runs.pop()
            self._runs[-1] = union_sorted(self._runs[-1], newer)

    def size_bound(self) -> int:
        """The set's size, or more (at most twice it)."""
        return sum(r.size for r in self._runs)

    def values(self) -> np.ndarray:
        """The set, ascending (its runs merged into one: the exact size is ``len`` of it)."""
        while len(self._runs) > 1:
            newer = self._runs.pop()
            self._runs[-1] = union_sorted(self._runs[-1], newer)
        return self._runs[0] if self._runs else np.zeros(0, np.int64)

    def contains(self, values: np.ndarray) -> np.ndarray:
        """Which of ``values`` the set holds."""
        values = np.asarray(values, np.int64)
        found = np.zeros(values.shape, bool)
        for run in self._runs:
            found |= _in_sorted(values, run)
        return found

    def remove(self, values: np.ndarray) -> None:
        """The set without ``values``."""
        gone = unique(np.asarray(values, np.int64))
        self._runs = [r for r in (run[~_in_sorted(run, gone)] for run in self._runs) if r.size]

    def replace(self, values: np.ndarray) -> None:
        """The set made ``values`` (ascending, distinct)."""
        self._runs = [np.ascontiguousarray(values, np.int64)] if values.size else []
