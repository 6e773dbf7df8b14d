"""Compiled host kernels of the streaming statistics: the per-occurrence accumulation of shows
and clicks into rows found through :mod:`jctr.ops.host_index` (numba, ``nogil``: the reader
thread runs them beside the training step)."""

from __future__ import annotations

from jctr.ops.host_index import find, host_kernel, index_size, rebuild, row_or_new

__all__ = ["accumulate", "find", "index_size", "rebuild"]


@host_kernel
def accumulate(index, keys, show, click, delta, unseen, since, n, in_keys, in_show, in_click,
               nonclk_coeff, click_coeff):
    """Add each occurrence ``i`` (``in_show[i]`` shows, ``in_click[i]`` clicks) to its key's
    row, a new row (at ``n``, ``n + 1``, ...) for a key not there yet; the row's delta score
    grows by the occurrence's score, its unseen days go to 0 and it counts as pushed. The
    columns must have room for ``n + in_keys.size`` rows and the index twice that many slots.
    Returns the new row count."""
    mask = index.size - 1
    for i in range(in_keys.size):
        r, grown = row_or_new(index, keys, in_keys[i], mask, n)
        if grown != n:  # a new row: its counts start at 0
            show[r] = 0.0
            click[r] = 0.0
            delta[r] = 0.0
            n = grown
        sh, cl = in_show[i], in_click[i]
        show[r] += sh
        click[r] += cl
        delta[r] += click_coeff * cl + nonclk_coeff * (sh - cl)
        unseen[r] = 0
        since[r] = True
    return n


