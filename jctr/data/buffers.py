"""Recycled host buffers for readers: file bytes and batch arrays.

A reader allocates tens of MB per batch and per file. Fresh memory from the OS is faulted in
page by page on first write (the kernel zeroes every page): for multi-hot batches that cost as
much as decoding them. :func:`take` hands out a buffer that nobody references any more instead
of a fresh one. A buffer is free when the pool holds the only reference: the arrays carved from
it (batch fields, views of file bytes) keep a reference to it while anyone (a queue, a training
step, a device array sharing host memory) still holds them, so a buffer in use is never reused.

Example::

    buf = take(1 << 20)                           # uint8, at least 1 MiB
    keys, segs = take_arrays([(np.int64, 1000), (np.int32, 1000)])
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from jctr.data.records import DataError

MAX_BUFFERS = 8
MAX_POOLED_BYTES = 1 << 30
_ALIGN = 64

_lock = threading.Lock()
_pool: list[np.ndarray] = []


def _calibrate() -> int:
    """The reference count :func:`take` sees for a buffer only the pool holds (measured the
    same way, so interpreter differences in counting cancel out)."""
    probe = [np.empty(1, np.uint8)]
    return sys.getrefcount(probe[0])


_FREE_REFS = _calibrate()


def take(nbytes: int) -> np.ndarray:
    """A uint8 buffer of at least ``nbytes`` (contents undefined): a free pooled one of a
    similar size, or a new one that joins the pool."""
    with _lock:
        for i in range(len(_pool)):
            if (nbytes <= _pool[i].size <= 2 * nbytes + (1 << 20)
                    and sys.getrefcount(_pool[i]) == _FREE_REFS):
                return _pool[i]
        buf = np.empty(max(nbytes, 1), np.uint8)
        if len(_pool) == MAX_BUFFERS or sum(b.size for b in _pool) + buf.size > MAX_POOLED_BYTES:
            # make room: drop free buffers, oldest first; if all are in use, do not pool this one
            free = [i for i in range(len(_pool)) if sys.getrefcount(_pool[i]) == _FREE_REFS]
            if not free:
                return buf
            del _pool[free[0]]
        _pool.append(buf)
        return buf


def read_at(path: str, offset: int, out: np.ndarray) -> int:
    """Read file bytes from ``offset`` into ``out`` (one unbuffered read); the bytes read. An
    unreadable file is a DataError naming it."""
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            return f.readinto(out)
    except OSError as e:
        raise DataError(f"{path}: cannot read data file: {e.strerror}") from e


def take_arrays(fields: list[tuple[object, int]]) -> list[np.ndarray]:
    """Flat arrays of the given (dtype, count) carved from one recycled buffer (each aligned to
    64 bytes): one allocation and one reference for all the fields of a batch."""
    starts, offset = [], 0
    for dtype, count in fields:
        start = -(-offset // _ALIGN) * _ALIGN
        starts.append(start)
        offset = start + np.dtype(dtype).itemsize * count
    buf = take(offset)
    return [buf[s:s + np.dtype(d).itemsize * c].view(d) for s, (d, c) in zip(starts, fields)]
