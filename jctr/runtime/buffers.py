"""Page-aligned byte buffers kept for reuse across calls.

A new buffer's pages are new memory: faulted in and zero-filled at their first touch, and on
virtual machines that hand free memory back to their host also faulted in the hypervisor
(``jctr.runtime.direct_io``'s docstring). Writers that run often with buffers of about the
same size -- a RocksDB table file's chunks (a bulk load of a poll's online updates), a direct
write's staging buffer -- take one here and give it back: a 116k-row table file took 40 ms
with new buffers, 2x the compiled loop that fills them (``docs/performance.md``).

Example::

    with reused(8 << 20) as buf:  # a page-aligned np.uint8 array of 8 MB
        buf[:5] = 1
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator

import numpy as np

KEEP = 4  # buffers kept once given back (more are unmapped)
_free: list[mmap.mmap] = []
_lock = threading.Lock()


def take(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer of at least ``nbytes`` (a kept one if one is large enough: the
    smallest such). Give it back with :func:`give` once no view of it is used."""
    with _lock:
        fits = [m for m in _free if len(m) >= nbytes]
        if fits:
            best = min(fits, key=len)
            _free.remove(best)
            return best
    return mmap.mmap(-1, max(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE))


def give(buf: mmap.mmap) -> None:
    """``buf`` (from :func:`take`) kept for the next caller; past :data:`KEEP` buffers, the
    smallest one is unmapped."""
    with _lock:
        _free.append(buf)
        if len(_free) <= KEEP:
            return
        smallest = min(_free, key=len)
        _free.remove(smallest)
    with contextlib.suppress(BufferError):  # a view still held (a traceback): freed with it
        smallest.close()


@contextlib.contextmanager
def reused(nbytes: int) -> Iterator[np.ndarray]:
    """:func:`take` as an ``np.uint8`` array of ``nbytes``, given back on exit."""
    buf = take(nbytes)
    try:
        yield np.frombuffer(buf, np.uint8, nbytes)
    finally:
        give(buf)
