"""Format-neutral types of the readers: the data error, columnar record blocks, file lists and
slot offsets (every format reads into a :class:`RecordBlock` or decodes straight into batches).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from jctr.errors import UserError


class DataError(UserError, ValueError):
    """Input data that does not match its format or the config; names file, record and field."""


def exit_on_data_error(action) -> int:
    """Run a command-line action: a user error becomes ``error: ...`` on stderr and exit code 2
    (:func:`jctr.errors.run_command`)."""
    from jctr.errors import run_command

    return run_command(action)


@dataclass
class RecordBlock:
    """Columnar samples: labels, dense features, per-slot key counts and the flat keys."""

    label: np.ndarray  # float32 [R, label_dim]
    dense: np.ndarray  # float32 [R, dense_dim]
    nnz: np.ndarray  # int32 [R, slot_num]
    keys: np.ndarray  # int64 [sum(nnz)], record-major, slot order within a record

    def __len__(self) -> int:
        return self.label.shape[0]

    def key_offsets(self) -> np.ndarray:
        """int64 [R + 1]: keys of record r are keys[off[r]:off[r+1]] (computed once: a file
        is sliced into many batches)."""
        off = self.__dict__.get("_offsets")
        if off is None:
            off = np.zeros(len(self) + 1, np.int64)
            np.cumsum(self.nnz.sum(axis=1, dtype=np.int64), out=off[1:])
            self.__dict__["_offsets"] = off
        return off

    def slice(self, start: int, stop: int) -> RecordBlock:
        off = self.key_offsets()
        return RecordBlock(self.label[start:stop], self.dense[start:stop], self.nnz[start:stop],
                           self.keys[off[start]:off[stop]])

    def take(self, perm: np.ndarray) -> RecordBlock:
        """The records at ``perm``, in that order."""
        off = self.key_offsets()
        counts = self.nnz.sum(axis=1)[perm].astype(np.int64)
        first = np.cumsum(counts) - counts
        idx = np.repeat(off[:-1][perm] - first, counts) + np.arange(int(counts.sum()))
        # np.take: numpy 2.4 indexes rows with an array 3-15x slower (docs/performance.md)
        return RecordBlock(*(np.take(a, perm, axis=0) for a in (self.label, self.dense,
                                                               self.nnz)), self.keys[idx])

    @staticmethod
    def concat(blocks: list[RecordBlock]) -> RecordBlock:
        if len(blocks) == 1:
            return blocks[0]
        return RecordBlock(*(np.concatenate([getattr(b, f) for b in blocks])
                             for f in ("label", "dense", "nnz", "keys")))


MAX_FILE_LIST_BYTES = 256 << 20  # a list of millions of paths; more is not a list


def write_file_list(path: str, files: list[str]) -> None:
    """A file list: the count, then one data file per line (relative to the list's folder)."""
    base = os.path.dirname(os.path.abspath(path))
    lines = [str(len(files))] + [os.path.relpath(os.path.abspath(f), base) for f in files]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def read_file_list(path: str) -> list[str]:
    """Data files of a file list; relative entries resolve against the list's folder, then the
    working directory (HugeCTR's convention)."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise DataError(f"{path}: not a regular file (a folder or a device); a source is a "
                        "file list: the count, then one data file per line")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_LIST_BYTES + 1)
    except OSError as e:
        raise DataError(f"{path}: cannot read file list: {e.strerror}") from e
    if len(raw) > MAX_FILE_LIST_BYTES:
        raise DataError(f"{path}: larger than {MAX_FILE_LIST_BYTES >> 20} MiB: not a file list "
                        "(the count, then one data file per line); is it a data file?")
    try:
        lines = [ln.strip() for ln in raw.decode("utf-8").splitlines()]
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not a text file list (byte {e.start} is not UTF-8); a source "
                        "is a file list: the count, then one data file per line") from None
    lines = [ln for ln in lines if ln]
    if not lines:
        raise DataError(f"{path}: empty file list; expected a count line, then file paths")
    try:
        count = int(lines[0])
    except ValueError:
        raise DataError(f"{path}: line 1: expected the number of files, got {lines[0]!r}") from None
    files = lines[1:]
    if count != len(files):
        raise DataError(f"{path}: line 1 says {count} files but {len(files)} are listed")
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for i, name in enumerate(files):
        # normalized: errors name runs/../data/x.data as data/x.data
        cand = name if os.path.isabs(name) else os.path.normpath(os.path.join(base, name))
        if not os.path.exists(cand) and os.path.exists(name):
            cand = name
        if not os.path.exists(cand):
            raise DataError(f"{path}: line {i + 2}: data file {name!r} does not exist")
        if not os.path.isfile(cand):
            raise DataError(f"{path}: line {i + 2}: {name!r} is not a regular file (a folder "
                            "or a device)")
        out.append(cand)
    return out


def slot_offsets(slot_size_array) -> np.ndarray:
    sizes = np.asarray(slot_size_array, np.int64)
    return np.cumsum(sizes) - sizes


def check_slot_keys(keys: np.ndarray, slot_size_array, where: str, first_record: int = 0):
    """Raise naming the record and slot of the first key outside its slot's range."""
    sizes = np.asarray(slot_size_array, np.int64)
    bad = (keys < 0) | (keys >= sizes[None, :])
    if bad.any():
        r, s = np.argwhere(bad)[0]
        raise DataError(f"{where}: record {first_record + int(r)}: slot {int(s)} key "
                        f"{int(keys[r, s])} is outside slot_size_array[{int(s)}] = "
                        f"{int(sizes[s])}")
