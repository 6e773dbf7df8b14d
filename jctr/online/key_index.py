"""Compiled host kernels of the streaming statistics: the per-occurrence accumulation of shows
and clicks into rows found through :mod:`jctr.ops.host_index` (numba, ``nogil``: the reader
thread runs them beside the training step)."""

from __future__ import annotations

import numba

from jctr.ops.host_index import (
    find,
    home,
    host_kernel,
    index_size,
    prefetch,
    rebuild,
    rebuild_distinct,
    slot_of,
)

__all__ = ["accumulate", "find", "index_size", "rebuild", "rebuild_distinct", "shrink"]


@numba.njit(inline="always")
def _score(show, click, nonclk_coeff, click_coeff):
    """:meth:`jctr.online.feature_stats.ScoreRule.score` of one key, in the kernels."""
    return click_coeff * click + nonclk_coeff * (show - click)


@host_kernel
def accumulate(index, keys, show, click, delta, unseen, since, n, in_keys, in_show, in_click,
               nonclk_coeff, click_coeff):
    """Add each occurrence ``i`` (``in_show[i]`` shows, ``in_click[i]`` clicks) to its key's
    row, a new row (at ``n``, ``n + 1``, ...) for a key not there yet; the row's delta score
    grows by the occurrence's score, its unseen days go to 0 and it counts as pushed. The
    columns must have room for ``n + in_keys.size`` rows and the index twice that many slots.
    Returns the new row count.

    The keys' memory is fetched ahead in two stages (the index slot of the key ``2 * AHEAD``
    places on, then the columns' row of the key ``AHEAD`` on, through its now cached slot):
    each occurrence touches seven arrays at random places, so latency, not work, bounds it."""
    mask = index.size - 1
    m = in_keys.size
    ahead = 16
    for i in range(m):
        if i + 2 * ahead < m:
            prefetch(index.ctypes.data + index.itemsize * home(in_keys[i + 2 * ahead], mask))
        if i + ahead < m:
            q = index[home(in_keys[i + ahead], mask)]
            if q >= 0:
                prefetch(keys.ctypes.data + 8 * q)
                prefetch(show.ctypes.data + 8 * q)
                prefetch(click.ctypes.data + 8 * q)
                prefetch(delta.ctypes.data + 8 * q)
                prefetch(unseen.ctypes.data + unseen.itemsize * q)
                prefetch(since.ctypes.data + q)
        k = in_keys[i]
        s = slot_of(index, keys, k, mask)
        r = index[s]
        if r < 0:  # a new row, its counts at 0 (inserted here: see host_index.fetch_ahead)
            r = n
            index[s] = r
            keys[r] = k
            n += 1
            show[r] = 0.0
            click[r] = 0.0
            delta[r] = 0.0
        sh, cl = in_show[i], in_click[i]
        show[r] += sh
        click[r] += cl
        delta[r] += _score(sh, cl, nonclk_coeff, click_coeff)
        unseen[r] = 0
        since[r] = True
    return n


@host_kernel
def shrink(keys, show, click, unseen, delta, since, n, decay, nonclk_coeff, click_coeff,
           delete_threshold, max_unseen, deleted):
    """A day's shrink of rows ``0 .. n-1`` in one pass, in place: show and click decay by
    ``decay``; a row whose score is then below ``delete_threshold`` or unseen for more than
    ``max_unseen`` days goes (its key into ``deleted``, room for ``n``), the others move up,
    in order. Returns (rows kept, keys deleted). One sequential pass over the columns instead
    of masks, a copy of each column and fresh memory for it (docs/performance.md)."""
    kept = 0
    gone = 0
    for i in range(n):
        sh = show[i] * decay
        cl = click[i] * decay
        if _score(sh, cl, nonclk_coeff, click_coeff) < delete_threshold \
                or unseen[i] > max_unseen:
            deleted[gone] = keys[i]
            gone += 1
            continue
        keys[kept] = keys[i]
        show[kept] = sh
        click[kept] = cl
        unseen[kept] = unseen[i]
        delta[kept] = delta[i]
        since[kept] = since[i]
        kept += 1
    return kept, gone
