"""Norm files with variable-length records (multi-hot data), decoded straight into batches.

A Norm record's length depends on its slots' ``nnz`` words, so records can only be found by
walking the file from its start. :func:`open_varlen_records` reads a file's bytes into memory
(a recycled buffer) and checks its header; :func:`decode_var_batch` then has the compiled
kernels (:mod:`jctr.data.record_kernels`) walk, validate and decode a batch's records in one pass,
writing every field straight into the batch arrays (labels, dense features, padded keys and
segments of every sparse input). Records are validated in file order as they are read (lengths,
``nnz``, check-Sum lengths and byte sums, the header's record count); resuming mid-file or
shuffling first validates the records before (all of them, for shuffling).

Anything the kernels reject goes to the general parser (:func:`jctr.data.norm.read_norm_file`)
or to :func:`jctr.data.dataset.build_batch`, which name the file, record, slot and field: the
kernels only decide *whether* data is valid, the numpy code stays the one place that words the
error. Without numba, files are read by the general parser.

Example::

    records = open_varlen_records("part_0.data", label_dim=1, dense_dim=13, slot_num=26,
                                  key_type="I64", check="None")
    chunk = records.slice(0, 8192)
"""

from __future__ import annotations

import functools
import os

import numpy as np

from jctr.data import buffers
from jctr.data import record_kernels as kernels
from jctr.data.norm import HEADER_BYTES, _parse_header, read_norm_file
from jctr.data.records import DataError, RecordBlock

WINDOW_BYTES = 2 << 20  # file bytes read at a time when reading in order (stay in cache)


class VarRecords:
    """A Norm data file of variable-length records; a unit of a Dataset. Behaves like a
    :class:`RecordBlock` for the loader (``len``, ``slice``, ``take``, ``load``).

    Read in order, the file passes through a window of ``WINDOW_BYTES`` (a recycled buffer the
    decode reads while it is still in cache); :meth:`load` (evaluation caches) and :meth:`take`
    (seeded shuffling) hold the whole body in memory instead. Records are validated lazily, in
    file order: ``starts[:frontier + 1]`` hold the body offsets of the validated records
    ``[0, frontier)`` and of the next one. The decode kernel validates and locates each record
    while it decodes it (one pass); jumping ahead (resuming) first walks the records in between,
    and ``take`` validates the whole file. Anything broken goes to the general parser
    (``general``), which raises the precise error.
    """

    def __init__(self, path: str, data_at: int, body_size: int, n: int, *, label_dim: int,
                 dense_dim: int, slot_num: int, key_width: int, wrap: bool, general,
                 body: np.ndarray | None = None, starts: np.ndarray | None = None):
        self.path = path
        self.data_at = data_at
        self.body_size = body_size
        self.n = n
        self.label_dim = label_dim
        self.dense_dim = dense_dim
        self.slot_num = slot_num
        self.key_width = key_width
        self.wrap = wrap
        self.general = general  # () -> RecordBlock: the general parser (raises the errors)
        self.body = body  # the whole body in memory, or None: read through windows
        self.sequential = starts is None
        if starts is None:
            starts = np.empty(n + 1, np.int64)
            starts[0] = 0
            self.frontier = 0
        else:  # a permutation of validated records
            self.frontier = n
        self.starts = starts
        self._window: np.ndarray | None = None
        self._base = 0  # body offset of the window's first byte
        self._window_bytes = WINDOW_BYTES

    def __len__(self) -> int:
        return self.n

    def load_bytes(self) -> int:
        """The memory :meth:`load` takes (nothing once loaded)."""
        return 0 if self.body is not None else self.body_size

    @property
    def fixed(self) -> int:
        return 4 * (self.label_dim + self.dense_dim)

    # -- reading
    def _read(self, at: int, nbytes: int) -> np.ndarray:
        """Body bytes ``[at, at + nbytes)`` in a recycled buffer followed by zeroed room for the
        decode kernel's overrun (``kernels.COPY_SLACK`` keys)."""
        slack = kernels.COPY_SLACK * 8
        buf = buffers.take(nbytes + slack)
        if buffers.read_at(self.path, self.data_at + at, buf[:nbytes]) != nbytes:
            raise DataError(f"{self.path}: truncated: the file shrank while being read")
        buf[nbytes:nbytes + slack] = 0
        return buf[:nbytes]

    def _fill(self, at: int) -> None:
        self._window = None  # let the pool recycle the old window's buffer
        self._window = self._read(at, min(self._window_bytes, self.body_size - at))
        self._base = at

    def _windows(self, first: int, stop: int, step) -> bool:
        """Run ``step(window, base, last, cur)`` -- a kernel call that finishes records from
        ``cur`` on and returns how many (-1: broken) -- over windows until record ``stop``."""
        cur = first
        while cur < stop:
            if self.body is not None:
                window, base = self.body, 0
            else:
                at = int(self.starts[cur])
                if self._window is None or not self._base <= at < self._base + self._window.size:
                    self._fill(at)
                window, base = self._window, self._base
            last = base + window.size == self.body_size
            got = step(window, base, last, cur)
            if got < 0 or (got == 0 and last):  # (the kernels give -1 there; never spin)
                return False
            cur += got
            if cur < stop:  # record cur runs past the window: the next window starts there
                at = int(self.starts[cur])
                if got == 0 and self._base == at:  # a record longer than the window
                    self._window_bytes *= 2
                self._fill(at)
        return True

    def advance(self, stop: int) -> bool:
        """Validate and locate records up to ``stop``; False if one of them is broken."""
        if self.frontier >= stop:
            return True

        def walk(window, base, last, cur):
            got = kernels.index_records(window, base, self.body_size, last, self.starts, cur,
                                        stop, self.n, self.fixed, self.slot_num,
                                        self.key_width, self.wrap)
            self.frontier = max(self.frontier, cur + got)
            return got

        return self._windows(self.frontier, stop, walk)

    def check_complete(self) -> None:
        """Every record validated to the end of the file (a resumed reader may start past all
        of them); a broken file raises the general parser's error."""
        if not self.advance(self.n):
            self.general()

    # -- the RecordBlock interface the loader uses
    def slice(self, start: int, stop: int) -> VarChunk:
        return VarChunk(self, start, stop)

    def load(self) -> VarRecords | RecordBlock:
        """The whole body in memory, every record validated (evaluation caches, shuffling); the
        general parser's block for a broken file (it raises)."""
        if self.body is None:
            self.body = self._read(0, self.body_size)
            self._window = None
        return self if self.advance(self.n) else self.general()

    def take(self, perm: np.ndarray) -> VarRecords | RecordBlock:
        """The records in the order ``perm`` (in memory)."""
        loaded = self.load()
        if isinstance(loaded, RecordBlock):
            return loaded.take(perm)
        return VarRecords(self.path, self.data_at, self.body_size, len(perm),
                          label_dim=self.label_dim, dense_dim=self.dense_dim,
                          slot_num=self.slot_num, key_width=self.key_width, wrap=self.wrap,
                          general=self.general, body=self.body, starts=self.starts[perm])


class VarChunk:
    """Records ``first..stop-1`` of a :class:`VarRecords`, not yet decoded."""

    def __init__(self, records: VarRecords, first: int, stop: int):
        self.records = records
        self.first = first
        self.stop = stop

    def __len__(self) -> int:
        return self.stop - self.first

    def to_block(self) -> RecordBlock:
        """The records as a RecordBlock (batches mixing formats; error paths)."""
        v, k = self.records, len(self)
        loaded = v.load()
        if isinstance(loaded, RecordBlock):
            return loaded.slice(self.first, self.stop)
        starts = v.starts[self.first:self.stop]
        label = np.empty((k, v.label_dim), np.float32)
        dense = np.empty((k, v.dense_dim), np.float32)
        nnz = np.empty((k, v.slot_num), np.int32)
        at = 4 if v.wrap else 0
        total = kernels.count_keys(v.body, starts, at, v.fixed, v.slot_num, v.key_width, nnz)
        keys = np.empty(total, np.int64)
        kernels.record_columns(v.body, starts, at, v.fixed, 4 * v.label_dim, v.slot_num,
                               v.key_width, label.view(np.uint8), dense.view(np.uint8), keys)
        return RecordBlock(label, dense, nnz, keys)

    def decode_into(self, row: int, fields: tuple, batch_size: int) -> bool:
        """Decode into rows ``row..`` of a batch's arrays (see :func:`decode_var_batch`)."""
        v = self.records
        if v.sequential and not v.advance(self.first):
            return False

        def decode(window, base, last, cur):
            got = kernels.decode_records(
                window, base, v.body_size, last, v.starts, cur, self.stop - cur, v.sequential,
                v.n, row + cur - self.first, v.fixed, 4 * v.label_dim, v.key_width, v.wrap,
                *fields, batch_size)
            if v.sequential:
                v.frontier = max(v.frontier, cur + got)
            return got

        return v._windows(self.first, self.stop, decode)


def decode_var_batch(parts: list[VarChunk], batch_size: int, sparse) -> tuple | None:
    """(label, dense, keys per input, segments per input, mask) of a batch from consecutive
    chunks (of one file or several), in :class:`jctr.data.batch.Batch` layout; None if a record
    breaks a sparse input's limits (the caller's general path words the error)."""
    v0 = parts[0].records
    label_dim, dense_dim = v0.label_dim, v0.dense_dim
    n = sum(len(p) for p in parts)
    widths = [sp.slot_num if sp.one_hot else sp.max_feature_num_per_sample for sp in sparse]
    # each input's region, then kernels.COPY_SLACK entries the kernel may overwrite
    base = np.concatenate([[0], np.cumsum([w * batch_size + kernels.COPY_SLACK for w in widths])])
    label, dense, keys, segs = buffers.take_arrays(
        [(np.float32, batch_size * label_dim), (np.float32, batch_size * dense_dim),
         (np.int64, int(base[-1])), (np.int32, int(base[-1]))])
    label = label.reshape(batch_size, label_dim)
    dense = dense.reshape(batch_size, dense_dim)
    in_slots = np.array([sp.slot_num for sp in sparse], np.int64)
    in_m = np.array(widths, np.int64)
    in_max = np.array([sp.max_nnz for sp in sparse], np.int64)
    in_one_hot = np.array([sp.one_hot for sp in sparse], np.bool_)
    kernel_fields = (label.reshape(-1).view(np.uint32), dense.reshape(-1).view(np.uint32), keys,
                     segs, in_slots, in_m, base[:-1].astype(np.int64), in_max, in_one_hot)
    row = 0
    for p in parts:
        if not p.decode_into(row, kernel_fields, batch_size):
            return None
        row += len(p)
    label[n:] = 0
    dense[n:] = 0
    keys_out, segs_out = [], []
    for i, w in enumerate(widths):
        k = keys[base[i]:base[i] + batch_size * w]
        s = segs[base[i]:base[i] + batch_size * w]
        k[n * w:] = 0
        s[n * w:] = batch_size * int(in_slots[i])
        keys_out.append(k)
        segs_out.append(s)
    mask = np.zeros(batch_size, bool)
    mask[:n] = True
    return label, dense, tuple(keys_out), tuple(segs_out), mask


def open_varlen_records(path: str, *, label_dim: int, dense_dim: int, slot_num: int,
                        key_type: str = "I32", check: str = "None") -> VarRecords | RecordBlock:
    """A Norm data file for the kernels, its header validated (records are validated as they
    are read); a RecordBlock from the general parser where the header's record count cannot
    fit the file (it raises the precise error)."""
    kw = dict(label_dim=label_dim, dense_dim=dense_dim, slot_num=slot_num, key_type=key_type,
              check=check)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(HEADER_BYTES + 5), np.uint8)
    except OSError as e:
        raise DataError(f"{path}: cannot read data file: {e.strerror}") from e
    n, hdr_len = _parse_header(path, head, label_dim, dense_dim, slot_num, check)
    wrap = check == "Sum"
    # a record holds at least its label, dense and nnz words: a larger count is broken
    min_record = 4 * (label_dim + dense_dim + slot_num) + (5 if wrap else 0)
    if n == 0 or min_record == 0 or n * min_record > size - hdr_len:
        return read_norm_file(path, **kw)  # raises the precise error (or: no records)
    general = functools.cache(functools.partial(read_norm_file, path, **kw))
    return VarRecords(path, hdr_len, size - hdr_len, n, label_dim=label_dim,
                      dense_dim=dense_dim, slot_num=slot_num,
                      key_width=4 if key_type == "I32" else 8, wrap=wrap, general=general)
