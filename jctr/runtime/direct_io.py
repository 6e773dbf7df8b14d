"""Large files written past the page cache (``O_DIRECT``).

A model's files (a base model's vectors, a day's feature statistics) are hundreds of MB
written once and not read back by the process that writes them. Written through the page
cache, every page of them is newly allocated memory; on virtual machines that hand free memory
back to their host (free page reporting, ballooning) each such page also faults in the
hypervisor: 300 MB took 0.70-0.86 s buffered and 0.15-0.16 s direct on this project's 2-core
VM (docs/performance.md, "Day-end cost, fourth round"). Direct writes move the bytes from a
small aligned staging buffer to the device and leave the cache to what is read.

A file system that refuses ``O_DIRECT`` (tmpfs on older kernels, some network file systems)
gets ordinary writes, as does a platform without it; ``JCTR_DIRECT_IO=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import zlib

from jctr.runtime import buffers

MIN_BYTES = 16 << 20
"""Files from this size on are worth writing directly (smaller ones: ordinary writes)."""

_ALIGN = 4096  # offsets, sizes and the buffer of a direct write are multiples of this
_STAGE = 8 << 20


def enabled() -> bool:
    """Whether large files are written directly (the platform has ``O_DIRECT`` and
    ``JCTR_DIRECT_IO`` is not ``0``)."""
    return hasattr(os, "O_DIRECT") and os.environ.get("JCTR_DIRECT_IO", "1") != "0"


@contextlib.contextmanager
def replacing(path: str, tmp: str | None = None):
    """A temporary file name beside ``path`` (``tmp``, default ``<path>.tmp<pid>``) for the
    block to write; moved onto ``path`` when the block ends, removed when it fails (a full
    disk leaves no partial file behind).

    Example::

        with replacing(path) as tmp:
            write_file(tmp, data)
    """
    tmp = tmp or f"{path}.tmp{os.getpid()}"
    try:
        yield tmp
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def replace_file(path: str, data: bytes) -> None:
    """``path`` holding ``data``, replaced whole: written beside it, synced, then moved onto it
    (a crash leaves the old file or the new one, never a part of either). For small files
    (records, markers, indexes); large ones go through :func:`write_file`.

    Example::

        replace_file("/run/progress.json", b'{"step": 10}')
    """
    with replacing(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def replace_json(path: str, doc) -> None:
    """:func:`replace_file` of ``doc`` as JSON."""
    replace_file(path, json.dumps(doc).encode())


class DirectWriter:
    """A new binary file written front to back (``write``, ``tell``, ``close``; not
    seekable, so ``zipfile`` and ``np.savez`` stream into it), past the page cache where the
    file system allows; ``close`` syncs it to the device (``fsync``).

    Example::

        with DirectWriter(path) as f:
            f.write(vectors.view(np.uint8))
    """

    def __init__(self, path: str, *, direct: bool | None = None, checksum: bool = False):
        self.path = path
        self.crc = 0 if checksum else None  # CRC-32 of the bytes written, if asked for
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self._fd = -1
        self._direct = False
        if enabled() if direct is None else direct:
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o666)
                self._direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:  # only "not on this file system" falls back
                    raise
        if self._fd < 0:
            self._fd = os.open(path, flags, 0o666)
        # page aligned, and kept for the next file (a new one's pages fault in again)
        self._stage = buffers.take(_STAGE) if self._direct else None
        self._used = 0  # bytes staged, not yet written
        self._pos = 0  # bytes accepted

    @property
    def direct(self) -> bool:
        """Whether the file is (still) written past the page cache."""
        return self._direct

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def read(self, size: int = -1) -> bytes:  # np.savez takes only objects with a read
        raise io.UnsupportedOperation(f"{self.path}: written front to back, not read")

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        """Nothing to do: staged bytes are written by :meth:`close` (a direct write needs
        whole blocks)."""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if self.crc is not None:
            self.crc = zlib.crc32(view, self.crc)
        if not self._direct:
            self._write_all(view)
        else:
            done = 0
            while done < size:
                n = min(size - done, _STAGE - self._used)
                self._stage[self._used: self._used + n] = view[done: done + n]
                self._used += n
                done += n
                if self._used == _STAGE:
                    self._write_stage(_STAGE)
        self._pos += size
        return size

    def _write_stage(self, nbytes: int) -> None:
        staged = memoryview(self._stage)[:nbytes]
        try:
            self._write_all(staged)
        finally:
            staged.release()
        self._used = 0

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                n = os.write(self._fd, view[done:])
            except OSError as e:
                # a file system that opened the file directly but refuses the write (e.g. a
                # larger logical block): the rest goes through the page cache
                if not self._direct or e.errno != errno.EINVAL:
                    raise
                self._buffered()
                continue
            if n <= 0:
                raise OSError(errno.EIO, f"{self.path}: short write")
            done += n
            if self._direct and n % _ALIGN:  # unaligned from here on: no longer direct
                self._buffered()

    def _buffered(self) -> None:
        import fcntl  # only where O_DIRECT exists (POSIX)

        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self._direct = False

    def close(self) -> None:
        """Write what is staged (the last block padded, then the file cut to its size),
        sync and close."""
        if self._fd < 0:
            return
        try:
            if self._used:  # only a direct file stages
                whole = -(-self._used // _ALIGN) * _ALIGN
                self._stage[self._used: whole] = bytes(whole - self._used)
                self._write_stage(whole)
                os.ftruncate(self._fd, self._pos)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
            if self._stage is not None:
                buffers.give(self._stage)
                self._stage = None

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None:  # a failed write (a full disk, ...): what is staged is dropped
            self._used = 0
        self.close()


def write_file(path: str, data) -> tuple[int, int]:
    """``data`` (bytes or a contiguous array) as the new file ``path``, synced: large data
    past the page cache (:class:`DirectWriter`), small data written as usual. Returns its
    size and CRC-32 (computed from memory: no reading back)."""
    view = memoryview(data).cast("B")
    with DirectWriter(path, direct=None if len(view) >= MIN_BYTES else False,
                      checksum=True) as f:
        f.write(view)
    return len(view), f.crc
