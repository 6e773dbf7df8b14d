"""Compiled host kernels of the streaming statistics: an open-addressing index from int64 keys
to row numbers of column arrays, and the per-occurrence accumulation of shows and clicks
(numba, ``nogil``: the reader thread runs them beside the training step).

The index holds int32 row numbers (-1: empty slot) and compares keys through the key column, so
any int64 is a key; it is kept at most half full (linear probing from a splitmix64 home slot).
Rows are handed out in insertion order; deleting rows means compacting the columns and
rebuilding the index (:func:`rebuild`, once a day at the shrink).
"""

from __future__ import annotations

import numba
import numpy as np


def _njit(fn):
    try:  # compiled once, then loaded from numba's on-disk cache
        return numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # no writable cache location (read-only install and home): no cache
        return numba.njit(nogil=True)(fn)


@numba.njit(inline="always")
def _home(key, mask):
    x = np.uint64(key)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return np.int64(x & np.uint64(mask))


@numba.njit(inline="always")
def _slot_of(index, keys, k, mask):
    """The index slot holding key ``k``, or the empty slot where its probe ends."""
    s = _home(k, mask)
    while True:
        r = index[s]
        if r < 0 or keys[r] == k:
            return s
        s = (s + 1) & mask


@_njit
def accumulate(index, keys, show, click, delta, unseen, since, n, in_keys, in_show, in_click,
               nonclk_coeff, click_coeff):
    """Add each occurrence ``i`` (``in_show[i]`` shows, ``in_click[i]`` clicks) to its key's
    row, a new row (at ``n``, ``n + 1``, ...) for a key not there yet; the row's delta score
    grows by the occurrence's score, its unseen days go to 0 and it counts as pushed. The
    columns must have room for ``n + in_keys.size`` rows and the index twice that many slots.
    Returns the new row count."""
    mask = index.size - 1
    for i in range(in_keys.size):
        k = in_keys[i]
        s = _slot_of(index, keys, k, mask)
        r = index[s]
        if r < 0:
            r = n
            index[s] = r
            keys[r] = k
            show[r] = 0.0
            click[r] = 0.0
            delta[r] = 0.0
            n += 1
        sh, cl = in_show[i], in_click[i]
        show[r] += sh
        click[r] += cl
        delta[r] += click_coeff * cl + nonclk_coeff * (sh - cl)
        unseen[r] = 0
        since[r] = True
    return n


@_njit
def find(index, keys, queries):
    """Row of each query key, -1 where absent."""
    mask = index.size - 1
    out = np.empty(queries.size, np.int64)
    for i in range(queries.size):
        out[i] = index[_slot_of(index, keys, queries[i], mask)]
    return out


@_njit
def rebuild(index, keys, n):
    """The index of rows ``0 .. n-1``, from an empty one. Returns the first row whose key an
    earlier row holds already (the index is then incomplete), -1 when all are distinct."""
    index[:] = -1
    mask = index.size - 1
    for r in range(n):
        s = _slot_of(index, keys, keys[r], mask)
        if index[s] >= 0:
            return r
        index[s] = r
    return -1


def index_size(rows: int) -> int:
    """Slots for ``rows`` rows: a power of two at least twice as many (at least 1,024)."""
    return 1 << max(10, int(2 * max(rows, 1) - 1).bit_length())
