"""Sizes and CRC-32 checksums of the files a save wrote, recorded when it is complete and
checked before anything is read back: a damaged byte is refused with the file's name instead of
being trained from or served. Checkpoints keep the record in ``jctr_integrity.json``, inference
bundles (streaming training's base and delta models too) in their ``manifest.json`` ("files").

Example::

    record = file_digests("bundles/dlrm", skip={"manifest.json"})
    check_files("bundles/dlrm", record, ModelFileError, "bundle")
"""

from __future__ import annotations

import os
import zlib


def crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


# digests of files this process wrote, by what identifies the file as written (device,
# inode, size, modification time): recording a save's digests need not read back hundreds of
# MB that went past the page cache. Only recording uses them; checks always read the file.
_WRITTEN: dict[tuple[int, int, int, int], int] = {}
_REMEMBERED = 256


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def note_written(path: str, size: int, crc: int) -> None:
    """Remember that ``path`` (as it is now) holds ``size`` bytes of CRC-32 ``crc``, computed
    by its writer; :func:`file_digests` then records it without reading it."""
    st = os.stat(path)
    if st.st_size != size:
        return
    while len(_WRITTEN) >= _REMEMBERED:
        _WRITTEN.pop(next(iter(_WRITTEN)))
    _WRITTEN[_identity(st)] = crc


def file_digests(root: str, skip: set[str] | frozenset[str] = frozenset()
                 ) -> dict[str, list[int]]:
    """``{relative path: [size, crc32]}`` of every file under ``root`` (``skip``: relative
    paths left out)."""
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            full = os.path.join(base, name)
            rel = os.path.relpath(full, root)
            if rel not in skip:
                st = os.stat(full)
                crc = _WRITTEN.get(_identity(st))
                out[rel] = [st.st_size, crc32(full) if crc is None else crc]
    return out


def check_files(root: str, expected: dict, error: type[Exception], what: str,
                only: str | None = None) -> None:
    """Raise ``error`` naming the first file of ``expected`` (under ``root``; those under the
    relative folder ``only`` if given) that is missing or differs in size or checksum."""
    for rel, (size, crc) in expected.items():
        if only is not None and not rel.startswith(only.rstrip("/") + "/"):
            continue
        full = os.path.join(root, rel)
        if not os.path.isfile(full):
            raise error(f"{full}: missing from the {what}")
        if os.path.getsize(full) != size:
            raise error(f"{full}: damaged {what} file (size {os.path.getsize(full)}, "
                        f"expected {size})")
        if crc32(full) != crc:
            raise error(f"{full}: damaged {what} file (checksum mismatch)")
