"""Norm files with variable-length records (multi-hot data), decoded straight into batches.

A Norm record's length depends on its slots' ``nnz`` words, so records can only be found by
walking the file from its start. :func:`open_varlen_records` reads a file's bytes into memory
(a recycled buffer) and checks its header; :func:`decode_var_batch` then has the compiled
kernels (:mod:`jctr.data.kernels`) walk, validate and decode a batch's records in one pass,
writing every field straight into the batch arrays (labels, dense features, padded keys and
segments of every sparse input). Records are validated in file order as they are read (lengths,
``nnz``, check-Sum lengths and byte sums, the header's record count); resuming mid-file or
shuffling first validates the records before (all of them, for shuffling).

Anything the kernels reject goes to the general parser (:func:`jctr.data.norm.read_norm_file`)
or to :func:`jctr.data.loader.build_batch`, which name the file, record, slot and field: the
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

from jctr.data import buffers, kernels
from jctr.data.norm import DataError, RecordBlock, _parse_header, read_norm_file


class VarRecords:
    """A Norm file's bytes in memory; a unit of a Dataset. Behaves like a :class:`RecordBlock`
    for the loader (``len``, ``slice``, ``take``, ``load``).

    Records are validated lazily, in file order: ``starts[:frontier + 1]`` hold the starts of
    the validated records ``[0, frontier)`` and of the next one. Reading in order, the decode
    kernel validates and locates each record while it decodes it (one pass); jumping ahead
    (resuming) first walks the records in between. ``take`` validates the whole file and
    permutes the starts (seeded shuffling). Anything broken is handed to the general parser,
    which raises the precise error.
    """

    def __init__(self, path: str, body: np.ndarray, n: int, *, label_dim: int, dense_dim: int,
                 slot_num: int, key_width: int, wrap: bool, general, starts=None):
        self.path = path
        self.body = body
        self.n = n
        self.label_dim = label_dim
        self.dense_dim = dense_dim
        self.slot_num = slot_num
        self.key_width = key_width
        self.wrap = wrap
        self.general = general  # () -> RecordBlock: the general parser (raises the errors)
        self.sequential = starts is None
        if starts is None:
            starts = np.empty(n + 1, np.int64)
            starts[0] = 0
            self.frontier = 0
        else:  # a permutation of validated records
            self.frontier = n
        self.starts = starts

    def __len__(self) -> int:
        return self.n

    @property
    def fixed(self) -> int:
        return 4 * (self.label_dim + self.dense_dim)

    def advance(self, stop: int) -> bool:
        """Validate and locate records up to ``stop``; False if one of them is broken."""
        if self.frontier < stop:
            if not kernels.index_records(self.body, self.starts, self.frontier, stop, self.n,
                                         self.fixed, self.slot_num, self.key_width, self.wrap):
                return False
            self.frontier = stop
        return True

    def slice(self, start: int, stop: int) -> VarChunk:
        return VarChunk(self, start, stop)

    def take(self, perm: np.ndarray) -> VarRecords | RecordBlock:
        if not self.advance(self.n):
            from jctr.data.loader import _take

            return _take(self.general(), perm)
        return VarRecords(self.path, self.body, len(perm), label_dim=self.label_dim,
                          dense_dim=self.dense_dim, slot_num=self.slot_num,
                          key_width=self.key_width, wrap=self.wrap, general=self.general,
                          starts=self.starts[perm])

    def load(self) -> VarRecords | RecordBlock:
        """Every record validated (evaluation caches); the general parser's block for a
        broken file (it raises)."""
        return self if self.advance(self.n) else self.general()


class VarChunk:
    """Records ``first..stop-1`` of a :class:`VarRecords`, not yet decoded."""

    def __init__(self, records: VarRecords, first: int, stop: int):
        self.records = records
        self.first = first
        self.stop = stop

    def __len__(self) -> int:
        return self.stop - self.first

    def to_block(self) -> RecordBlock:
        v, k = self.records, len(self)
        if not v.advance(self.stop):
            return v.general().slice(self.first, self.stop)
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
        ok = kernels.decode_records(v.body, v.starts, self.first, len(self), v.sequential, v.n,
                                    row, v.fixed, 4 * v.label_dim, v.key_width, v.wrap, *fields,
                                    batch_size)
        if ok and v.sequential:
            v.frontier = max(v.frontier, self.stop)
        return ok


def _carve_all(buf, fields):
    out, at = [], 0
    for dtype, count in fields:
        arr, at = buffers.carve(buf, at, dtype, count)
        out.append((arr, at))
    return out


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
    fields = [(np.float32, batch_size * label_dim), (np.float32, batch_size * dense_dim),
              (np.int64, int(base[-1])), (np.int32, int(base[-1]))]
    buf, at = buffers.take(buffers.layout_bytes(fields)), 0
    (label, at), (dense, at), (keys, at), (segs, at) = _carve_all(buf, fields)
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
    """A Norm data file in memory for the kernels, its header validated (records are validated
    as they are read); a RecordBlock from the general parser where the kernels are not
    available or the header's record count cannot fit the file (it raises the precise error)."""
    kw = dict(label_dim=label_dim, dense_dim=dense_dim, slot_num=slot_num, key_type=key_type,
              check=check)
    if not kernels.HAVE_KERNELS:
        return read_norm_file(path, **kw)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = buffers.take(size + kernels.COPY_SLACK * 8)  # + room for _decode's overrun
            got = f.readinto(buf[:size])
    except OSError as e:
        raise DataError(f"{path}: cannot read data file: {e.strerror}") from e
    if got != size:
        raise DataError(f"{path}: truncated: the file shrank while being read")
    buf[size:size + kernels.COPY_SLACK * 8] = 0
    n, hdr_len = _parse_header(path, buf[:size], label_dim, dense_dim, slot_num, check)
    wrap = check == "Sum"
    # a record holds at least its label, dense and nnz words: a larger count is broken
    min_record = 4 * (label_dim + dense_dim + slot_num) + (5 if wrap else 0)
    if min_record == 0 or n * min_record > size - hdr_len:
        return read_norm_file(path, **kw)  # raises the precise error
    general = functools.cache(functools.partial(read_norm_file, path, **kw))
    return VarRecords(path, buf[hdr_len:size], n, label_dim=label_dim, dense_dim=dense_dim,
                      slot_num=slot_num, key_width=4 if key_type == "I32" else 8, wrap=wrap,
                      general=general)
