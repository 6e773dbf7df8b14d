"""Arrays in memory-mapped files that have no name: memory the operating system can page out
to disk (as it pages a mapped table's rows) where anonymous memory has nowhere to go, for
structures that grow with the keys a table larger than memory holds (streaming statistics, a
row file's index). The price is the 4 KB pages of a file mapping: random access runs ~1.7x
slower than in anonymous memory on transparent huge pages (docs/performance.md), so callers
move there only past a share of the memory."""

from __future__ import annotations

import errno
import mmap
import os
import tempfile

import numpy as np


def allocate(fd: int, size: int) -> None:
    """The open file ``fd`` at least ``size`` bytes long, its blocks allocated: a write into
    a mapped page the disk has no room for kills the process (SIGBUS), so the room is taken
    as the file grows, where a full disk is an :class:`OSError` and the file stays as it
    was. A file system without ``fallocate`` gets a sparse file."""
    have = os.fstat(fd).st_size
    if have >= size:
        return
    try:
        os.posix_fallocate(fd, have, size - have)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.ftruncate(fd, have)
            raise
        os.ftruncate(fd, size)


class MappedArrays:
    """Arrays in unnamed files of ``folder`` (``O_TMPFILE``: nothing to remove, whatever
    ends the process), one file a name, mapped shared: the page cache holds them and the
    operating system writes them out under memory pressure as it does a mapped table's rows.
    An array asked for again with more rows is the same file grown (its rows kept, nothing
    copied; new rows read 0).

    Example::

        files = MappedArrays("runs/online")
        keys = files.array("keys", np.int64, 1 << 20)
    """

    def __init__(self, folder: str):
        self.folder = folder
        self._files: dict[str, object] = {}

    def array(self, name: str, dtype, rows: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = tempfile.TemporaryFile(dir=self.folder,
                                                           prefix=".jctr-mapped-")
        size = max(rows * dtype.itemsize, mmap.PAGESIZE)
        try:
            allocate(f.fileno(), size)
        except OSError as e:
            raise OSError(e.errno, f"{self.folder}: no room for {size:,} bytes of {name} "
                          f"(a mapped file of {size >> 20:,} MiB: {e.strerror}); free space "
                          "there") from e
        try:
            mapped = mmap.mmap(f.fileno(), size)
        except OSError as e:  # a file system that cannot map files (some network ones)
            raise OSError(e.errno, f"{self.folder}: cannot map a file there for {name} "
                          f"({e.strerror})") from e
        # the array keeps its mapping open; an older, shorter one of the same file stays
        # valid (the same pages) until its last view goes
        return np.frombuffer(mapped, dtype, rows)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
