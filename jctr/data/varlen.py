"""Norm files with variable-length records (multi-hot data), indexed once and decoded per batch.

A Norm record's length depends on its slots' ``nnz`` words, so a file has to be walked record by
record before any field can be found. Here compiled kernels (numba, ``nogil``: they run beside
the training step on the prefetch thread) do that in two passes over bytes that stay in memory:

* :func:`open_varlen_records` walks and validates the whole file once (lengths, ``nnz``,
  check-Sum lengths and byte sums, the header's record count), keeping only each record's start;
* :meth:`VarRecords.slice` then hands out chunks of record starts, and :func:`decode_var_batch`
  writes every field of a batch's records straight into the batch arrays (labels, dense
  features, padded keys and segments of every sparse input) in one pass.

Anything the kernels reject goes to the general parser (:func:`jctr.data.norm.read_norm_file`)
or to :func:`jctr.data.loader.build_batch`, which name the file, record, slot and field: the
kernels only decide *whether* data is valid, the numpy code stays the one place that words the
error. Without numba (an optional speed-up), files are read by the general parser.

Example::

    records = open_varlen_records("part_0.data", label_dim=1, dense_dim=13, slot_num=26,
                                  key_type="I64", check="None")
    chunk = records.slice(0, 8192)
"""

from __future__ import annotations

import os

import numpy as np

from jctr.data.norm import DataError, RecordBlock, _parse_header, read_norm_file

try:  # the kernels are optional: without numba the general parser reads every file
    import numba
except ImportError:  # pragma: no cover - numba is a declared dependency
    numba = None

HAVE_KERNELS = numba is not None


def _njit(fn):
    return numba.njit(nogil=True, cache=True)(fn) if HAVE_KERNELS else fn


def _inline(fn):
    return numba.njit(inline="always")(fn) if HAVE_KERNELS else fn


_U = np.uint64
# Keys copied per slot whatever its nnz (see _decode); bodies and output regions carry room
# for that many keys past their end.
COPY_SLACK = 16


@_inline
def _u64(b, p, k):
    """Byte ``p + k`` of ``b`` as int64. Unsigned indexing skips numba's negative-index
    wrap-around, which lets LLVM merge neighbouring byte loads into one load (5x faster)."""
    return np.int64(b[_U(p) + _U(k)])


@_inline
def _i32(b, p):
    """Little-endian int32 at byte ``p`` (any alignment), as int64."""
    v = _u64(b, p, 0) | (_u64(b, p, 1) << 8) | (_u64(b, p, 2) << 16) | (_u64(b, p, 3) << 24)
    return v - (np.int64(1) << 32) if v >= (np.int64(1) << 31) else v


@_inline
def _key(b, p, kw):
    """A key at byte ``p``: uint32 (``kw`` 4, input_key_type I32) or int64 (``kw`` 8)."""
    v = _u64(b, p, 0) | (_u64(b, p, 1) << 8) | (_u64(b, p, 2) << 16) | (_u64(b, p, 3) << 24)
    if kw == 8:  # unrolled by hand: a loop over kw would not be
        v |= ((_u64(b, p, 4) << 32) | (_u64(b, p, 5) << 40) | (_u64(b, p, 6) << 48)
              | (_u64(b, p, 7) << 56))
    return v


@_njit
def _index(body, n, fixed, slot_num, kw, wrap, starts):  # pragma: no cover - compiled
    """Fill ``starts`` with the byte offset of each of the ``n`` records; True if every
    record is well formed and the records end exactly at the end of ``body``."""
    size = body.size
    p = np.int64(0)
    for r in range(n):
        if p >= size:
            return False
        starts[r] = p
        if wrap:
            if p + 4 > size:
                return False
            length = _i32(body, p)
            q = p + 4
            end = q + length
            if length < 0 or end + 1 > size:
                return False
        else:
            q = p
            end = size
        q += fixed
        if q > end:
            return False
        for _ in range(slot_num):
            if q + 4 > end:
                return False
            c = _i32(body, q)
            if c < 0:
                return False
            q += 4 + c * kw
            if q > end:
                return False
        if wrap:
            if q != end:
                return False
            acc = np.int64(0)
            for k in range(p + 4, end):
                acc += body[k]
            if (acc & 255) != body[end]:
                return False
            p = end + 1
        else:
            p = q
    return p == size


@_njit
def _decode(body, starts, row0, payload_at, fixed, label_bytes, kw, label_u8, dense_u8,
            keys, segs, in_slots, in_m, in_base, in_max_nnz, in_one_hot,
            batch_size):  # pragma: no cover - compiled
    """Decode records ``starts`` into batch rows ``row0..`` (``label_u8``/``dense_u8``: the
    flat bytes of the label and dense arrays); False if a record breaks a sparse input's limits
    (``max_nnz``, ``max_feature_num_per_sample``, one-hot). Stores index with uint64 (``_U``):
    no wrap-around checks in the inner loops."""
    n_in = in_slots.size
    dense_bytes = fixed - label_bytes
    for r in range(starts.size):
        p = starts[r] + payload_at
        b = row0 + r
        for k in range(label_bytes):
            label_u8[_U(b * label_bytes + k)] = body[_U(p + k)]
        for k in range(dense_bytes):
            dense_u8[_U(b * dense_bytes + k)] = body[_U(p + label_bytes + k)]
        q = p + fixed
        for i in range(n_in):
            slots = in_slots[i]
            base = in_base[i]
            pad_seg = batch_size * slots
            if in_one_hot[i]:
                for s in range(slots):
                    c = _i32(body, q)
                    q += 4
                    at = _U(base + b * slots + s)
                    if c == 0:
                        keys[at] = 0
                        segs[at] = pad_seg
                    elif c == 1:
                        keys[at] = _key(body, q, kw)
                        segs[at] = b * slots + s
                        q += kw
                    else:
                        return False
            else:
                m = in_m[i]
                out = base + b * m
                mx = min(in_max_nnz[i], COPY_SLACK)
                k = 0
                for s in range(slots):
                    c = _i32(body, q)
                    q += 4
                    if c > in_max_nnz[i] or k + c > m:
                        return False
                    seg = b * slots + s
                    # a fixed-length copy of mx keys (the slack after the body and after each
                    # input's output region absorbs the overrun; the next slot overwrites it)
                    # beats a copy of c keys, whose varying length the CPU mispredicts
                    for j in range(mx if c <= mx else c):
                        keys[_U(out + k + j)] = _key(body, q + kw * j, kw)
                        segs[_U(out + k + j)] = seg
                    q += kw * c
                    k += c
                for t in range(k, m):
                    keys[_U(out + t)] = 0
                    segs[_U(out + t)] = pad_seg
    return True


@_njit
def _count_keys(body, starts, payload_at, fixed, slot_num, kw, nnz):  # pragma: no cover
    """Each record's per-slot key counts into ``nnz``; the total."""
    total = 0
    for r in range(starts.size):
        q = starts[r] + payload_at + fixed
        for s in range(slot_num):
            c = _i32(body, q)
            nnz[r, s] = c
            total += c
            q += 4 + c * kw
    return total


@_njit
def _columns(body, starts, payload_at, fixed, label_bytes, slot_num, kw, label_u8, dense_u8,
             keys):  # pragma: no cover - compiled
    """Labels, dense features and the flat keys of records ``starts`` (RecordBlock layout)."""
    j = 0
    for r in range(starts.size):
        p = starts[r] + payload_at
        for k in range(label_bytes):
            label_u8[r, k] = body[p + k]
        for k in range(fixed - label_bytes):
            dense_u8[r, k] = body[p + label_bytes + k]
        q = p + fixed
        for _ in range(slot_num):
            c = _i32(body, q)
            q += 4
            for _ in range(c):
                keys[j] = _key(body, q, kw)
                q += kw
                j += 1


class VarRecords:
    """A validated Norm file in memory with the start of every record; a unit of a Dataset.

    Behaves like a :class:`RecordBlock` for the loader (``len``, ``slice``, ``take``):
    :meth:`slice` returns a :class:`VarChunk` of record starts, decoded later straight into a
    batch. ``take`` permutes the starts only (seeded shuffling)."""

    def __init__(self, path: str, body: np.ndarray, starts: np.ndarray, *, label_dim: int,
                 dense_dim: int, slot_num: int, key_width: int, wrap: bool):
        self.path = path
        self.body = body
        self.starts = starts
        self.label_dim = label_dim
        self.dense_dim = dense_dim
        self.slot_num = slot_num
        self.key_width = key_width
        self.payload_at = 4 if wrap else 0
        self.wrap = wrap

    def __len__(self) -> int:
        return self.starts.size

    def slice(self, start: int, stop: int) -> VarChunk:
        return VarChunk(self, self.starts[start:stop])

    def take(self, perm: np.ndarray) -> VarRecords:
        out = VarRecords(self.path, self.body, self.starts[perm], label_dim=self.label_dim,
                         dense_dim=self.dense_dim, slot_num=self.slot_num,
                         key_width=self.key_width, wrap=self.wrap)
        return out

    def load(self) -> VarRecords:
        return self  # already in memory


class VarChunk:
    """Consecutive records of a :class:`VarRecords` (by their starts), not yet decoded."""

    def __init__(self, records: VarRecords, starts: np.ndarray):
        self.records = records
        self.starts = starts

    def __len__(self) -> int:
        return self.starts.size

    def to_block(self) -> RecordBlock:
        v, k = self.records, len(self)
        fixed = 4 * (v.label_dim + v.dense_dim)
        label = np.empty((k, v.label_dim), np.float32)
        dense = np.empty((k, v.dense_dim), np.float32)
        nnz = np.empty((k, v.slot_num), np.int32)
        total = _count_keys(v.body, self.starts, v.payload_at, fixed, v.slot_num, v.key_width,
                            nnz)
        keys = np.empty(total, np.int64)
        _columns(v.body, self.starts, v.payload_at, fixed, 4 * v.label_dim, v.slot_num,
                 v.key_width, label.view(np.uint8), dense.view(np.uint8), keys)
        return RecordBlock(label, dense, nnz, keys)


def decode_var_batch(parts: list[VarChunk], batch_size: int, sparse) -> tuple | None:
    """(label, dense, keys per input, segments per input, mask) of a batch from consecutive
    chunks (of one file or several), in :class:`jctr.data.batch.Batch` layout; None if a record
    breaks a sparse input's limits (the caller's general path words the error)."""
    v0 = parts[0].records
    label_dim, dense_dim = v0.label_dim, v0.dense_dim
    n = sum(len(p) for p in parts)
    label = np.empty((batch_size, label_dim), np.float32)
    dense = np.empty((batch_size, dense_dim), np.float32)
    widths = [sp.slot_num if sp.one_hot else sp.max_feature_num_per_sample for sp in sparse]
    # each input's region, then COPY_SLACK entries the kernel may overwrite
    base = np.concatenate([[0], np.cumsum([w * batch_size + COPY_SLACK for w in widths])])
    keys = np.empty(int(base[-1]), np.int64)
    segs = np.empty(int(base[-1]), np.int32)
    in_slots = np.array([sp.slot_num for sp in sparse], np.int64)
    in_m = np.array(widths, np.int64)
    in_max = np.array([sp.max_nnz for sp in sparse], np.int64)
    in_one_hot = np.array([sp.one_hot for sp in sparse], np.bool_)
    row = 0
    for p in parts:
        v = p.records
        ok = _decode(v.body, p.starts, row, v.payload_at, 4 * (label_dim + dense_dim),
                     4 * label_dim, v.key_width, label.reshape(-1).view(np.uint8),
                     dense.reshape(-1).view(np.uint8),
                     keys, segs, in_slots, in_m, base[:-1].astype(np.int64), in_max, in_one_hot,
                     batch_size)
        if not ok:
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
    """A Norm data file, validated and indexed by the kernels (a RecordBlock from the general
    parser where they are not available or reject the file; the general parser raises the
    precise DataError for a broken file)."""
    kw = dict(label_dim=label_dim, dense_dim=dense_dim, slot_num=slot_num, key_type=key_type,
              check=check)
    if not HAVE_KERNELS:
        return read_norm_file(path, **kw)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = np.empty(size + COPY_SLACK * 8, np.uint8)  # + room for _decode's overrun
            got = f.readinto(buf[:size])
    except OSError as e:
        raise DataError(f"{path}: cannot read data file: {e.strerror}") from e
    if got != size:
        raise DataError(f"{path}: truncated: the file shrank while being read")
    buf[size:] = 0
    n, hdr_len = _parse_header(path, buf[:size], label_dim, dense_dim, slot_num, check)
    body = buf[hdr_len:size]
    key_width = 4 if key_type == "I32" else 8
    wrap = check == "Sum"
    # a record holds at least its label, dense and nnz words: a larger count is broken
    min_record = 4 * (label_dim + dense_dim + slot_num) + (5 if wrap else 0)
    if min_record == 0 or n * min_record > body.size:
        return read_norm_file(path, **kw)  # raises the precise error
    starts = np.empty(n, np.int64)
    if not _index(body, n, 4 * (label_dim + dense_dim), slot_num, key_width, wrap, starts):
        return read_norm_file(path, **kw)  # raises the precise error
    return VarRecords(path, body, starts, label_dim=label_dim, dense_dim=dense_dim,
                      slot_num=slot_num, key_width=key_width, wrap=wrap)
