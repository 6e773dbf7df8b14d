"""Fixed-size records, read and decoded one batch at a time.

Raw files and Norm files whose records all hold one key per slot (one-hot data) are matrices of
``[records, record_bytes]``: every field sits at the same byte offset of every record. For those
the reader does not parse a whole file into columns and then copy the columns into batches;
it reads a batch's byte range into memory, validates it there and writes the fields straight into
the batch arrays while the bytes are still in cache (``scripts/bench_data.py`` measures the
difference against a plain read of the same bytes).

A Norm file only *looks* fixed-size from its first record; each batch's records are checked
(every slot's ``nnz`` is 1, length fields, checksums) before they are decoded, and the first
record that differs hands the file to the general parser (``fallback``), which reads variable
records and raises the precise error for broken ones. Records are always validated from the
start of the file up to the last one decoded, so resuming in the middle of a file never trusts
unchecked offsets.

Example::

    layout = FixedLayout(record_bytes=160, label_at=0, label_dim=1, dense_at=4, dense_dim=13,
                         key_at=56, key_stride=4, key_width=4, slot_num=26)
    records = FixedRecords("data.bin", 0, 1000, layout)
    chunk = records.slice(0, 512)   # validated bytes of records 0..511
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jctr.data import buffers
from jctr.data import record_kernels as kernels
from jctr.data.norm import _parse_header, read_norm_file
from jctr.data.records import DataError, RecordBlock


@dataclass(frozen=True, eq=False)
class FixedLayout:
    """Byte offsets (inside a record) and types of every field of a fixed-size record."""

    record_bytes: int
    label_at: int
    label_dim: int
    dense_at: int
    dense_dim: int
    key_at: int  # the first slot's key
    key_stride: int  # bytes from one slot's key to the next
    key_width: int  # 4 (unsigned int32 keys, or Raw's int32) or 8 (int64)
    slot_num: int
    int_label_dense: bool = False  # Raw without float_label_dense: int32, dense -> log(x + 1)
    nnz_at: int | None = None  # Norm: each slot's nnz word, which must be 1 (stride key_stride)
    wrap_payload: int | None = None  # Norm check Sum: [int32 length][payload][sum byte]
    slot_offsets: np.ndarray | None = None  # Raw: int64 [slot_num], added to the keys
    slot_sizes: np.ndarray | None = None  # Raw: keys of slot s lie in [0, slot_sizes[s])


def _field(rows: np.ndarray, at: int, count: int, dtype: str, stride: int) -> np.ndarray:
    """A strided view of ``count`` fields of ``dtype`` starting at byte ``at`` of every row of
    the uint8 matrix ``rows`` (unaligned views are fine for numpy)."""
    if rows.shape[0] == 0:  # no buffer to point into
        return np.empty((0, count), dtype)
    return np.ndarray((rows.shape[0], count), dtype, buffer=rows, offset=at,
                      strides=(rows.strides[0], stride))


_TILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layout -> {name: array}


def _tiled(layout: FixedLayout, name: str, per_record: np.ndarray, records: int) -> np.ndarray:
    """``per_record`` repeated for ``records`` records, cached per layout and grown on need:
    one long numpy loop over a chunk instead of short inner loops per record."""
    cache = _TILED.setdefault(layout, {})
    tiled = cache.get(name)
    if tiled is None or tiled.size < records * per_record.size:
        tiled = cache[name] = np.tile(per_record, max(records, 8192))
    return tiled[:records * per_record.size]


class FixedChunk:
    """Validated bytes of consecutive records (uint8 ``[k, record_bytes]``)."""

    def __init__(self, rows: np.ndarray, layout: FixedLayout):
        self.rows = rows
        self.layout = layout

    def __len__(self) -> int:
        return self.rows.shape[0]

    def keys(self) -> np.ndarray:
        lay = self.layout
        dtype = "<u4" if lay.key_width == 4 and lay.slot_offsets is None else (
            "<i4" if lay.key_width == 4 else "<i8")
        return _field(self.rows, lay.key_at, lay.slot_num, dtype, lay.key_stride)

    def decode_into(self, label: np.ndarray, dense: np.ndarray, keys: np.ndarray) -> None:
        """Write labels, dense features and the ``[k, slot_num]`` int64 keys."""
        lay, rows = self.layout, self.rows
        if lay.int_label_dense:
            np.copyto(label, _field(rows, lay.label_at, lay.label_dim, "<i4", 4),
                      casting="unsafe")
            x = np.maximum(_field(rows, lay.dense_at, lay.dense_dim, "<i4", 4), 0)
            np.log1p(x, out=dense, dtype=np.float32, casting="unsafe")
        else:
            np.copyto(label, _field(rows, lay.label_at, lay.label_dim, "<f4", 4))
            np.copyto(dense, _field(rows, lay.dense_at, lay.dense_dim, "<f4", 4))
        if lay.slot_offsets is not None and keys.flags.c_contiguous:
            # a contiguous int32 copy, then one long add: cheaper than a strided add
            k = np.ascontiguousarray(self.keys()).reshape(-1)
            np.add(k, _tiled(lay, "offsets", lay.slot_offsets, len(self)), out=keys.reshape(-1))
        elif lay.slot_offsets is not None:
            np.add(self.keys(), lay.slot_offsets, out=keys, casting="unsafe")
        else:
            np.copyto(keys, self.keys(), casting="unsafe")

    def to_block(self) -> RecordBlock:
        lay, k = self.layout, len(self)
        label = np.empty((k, lay.label_dim), np.float32)
        dense = np.empty((k, lay.dense_dim), np.float32)
        keys = np.empty((k, lay.slot_num), np.int64)
        self.decode_into(label, dense, keys)
        return RecordBlock(label, dense, np.ones((k, lay.slot_num), np.int32), keys.ravel())


class FixedRecords:
    """``n`` fixed-size records of ``path`` from byte ``data_at``; a unit of a Dataset.

    Behaves like a :class:`RecordBlock` for the loader (``len``, ``slice``, ``take``) but reads
    lazily: :meth:`slice` returns a :class:`FixedChunk` (or, after ``fallback`` took over, a
    RecordBlock). ``first_record`` numbers records in error messages.
    """

    def __init__(self, path: str, data_at: int, n: int, layout: FixedLayout, *,
                 first_record: int = 0, fallback: Callable[[], RecordBlock] | None = None):
        self.path = path
        self.data_at = data_at
        self.n = n
        self.layout = layout
        self.first_record = first_record
        self.fallback = fallback
        self._rows: np.ndarray | None = None  # all records in memory (cached or shuffled)
        self._checked = 0  # records [0, _checked) of the file are validated
        self._general: RecordBlock | None = None

    def __len__(self) -> int:
        return self.n

    def load_bytes(self) -> int:
        """The memory :meth:`load` takes (nothing once loaded)."""
        return 0 if self._rows is not None else self.n * self.layout.record_bytes

    # -- reading
    def _read(self, start: int, stop: int) -> np.ndarray:
        rec = self.layout.record_bytes
        rows = np.empty((stop - start, rec), np.uint8)
        got = buffers.read_at(self.path, self.data_at + start * rec, rows)
        if got != rows.nbytes:
            raise DataError(f"{self.path}: record {self.first_record + start + got // rec}: "
                            "truncated (the file shrank while being read)")
        return rows

    def _rows_of(self, start: int, stop: int) -> np.ndarray:
        return self._rows[start:stop] if self._rows is not None else self._read(start, stop)

    def _validate(self, rows: np.ndarray, first: int) -> bool:
        """True if every record has the layout; False hands the file to the fallback; errors
        that need no general parse (Raw keys out of range) raise here."""
        lay = self.layout
        if lay.nnz_at is not None:  # Norm: one compiled pass (nnz 1 everywhere, checksums)
            return kernels.fixed_norm_valid(
                np.ascontiguousarray(rows).reshape(-1), lay.record_bytes,
                -1 if lay.wrap_payload is None else lay.wrap_payload, lay.nnz_at,
                lay.key_stride, lay.slot_num)
        if lay.slot_sizes is not None and self._keys_out_of_range(rows):
            keys = _field(rows, lay.key_at, lay.slot_num, "<u4", lay.key_stride)
            r, s = np.argwhere(keys >= lay.slot_sizes)[0]
            raise DataError(
                f"{self.path}: record {self.first_record + first + int(r)}: slot {int(s)} "
                f"key {int(keys[r, s].view('<i4'))} is outside slot_size_array[{int(s)}] "
                f"= {int(lay.slot_sizes[s])}")
        return True

    def _keys_out_of_range(self, rows: np.ndarray) -> bool:
        """Any key outside its slot's range (negative int32 keys are huge as uint32)? One
        comparison over the whole chunk against the bounds tiled per record, instead of numpy's
        short inner loops over each record's keys."""
        lay = self.layout
        if lay.record_bytes % 4 or not rows.flags.c_contiguous:
            keys = _field(rows, lay.key_at, lay.slot_num, "<u4", lay.key_stride)
            return bool((keys >= lay.slot_sizes).any())
        words = rows.reshape(-1).view("<u4")
        per_record = np.full(lay.record_bytes // 4, 0xFFFFFFFF, np.uint32)
        first, step = lay.key_at // 4, lay.key_stride // 4
        per_record[first:first + lay.slot_num * step:step] = lay.slot_sizes
        return bool((words >= _tiled(lay, "bounds", per_record, len(rows))).any())

    def _general_block(self) -> RecordBlock:
        if self._general is None:
            if self.fallback is None:
                raise DataError(f"{self.path}: records do not have a fixed layout")
            self._general = self.fallback()
        return self._general

    def _ensure_checked(self, stop: int) -> bool:
        """Validate records up to ``stop`` (from wherever validation stopped)."""
        while self._checked < stop and self._general is None:
            end = min(stop, self._checked + 65536)
            if not self._validate(self._rows_of(self._checked, end), self._checked):
                self._general_block()
                return False
            self._checked = end
        return self._general is None

    # -- the RecordBlock interface the loader uses
    def slice(self, start: int, stop: int) -> FixedChunk | RecordBlock:
        if self._general is not None:
            return self._general.slice(start, stop)
        if self._rows is not None:  # in memory, validated when loaded
            return FixedChunk(self._rows[start:stop], self.layout)
        if self._checked >= stop:
            return FixedChunk(self._read(start, stop), self.layout)
        # a Norm file's offsets hold only if every earlier record is one-hot too; a Raw file's
        # hold by its size
        variable = self.fallback is not None
        if variable and self._checked < start and not self._ensure_checked(start):
            return self._general.slice(start, stop)
        rows = self._read(start, stop)
        if not self._validate(rows, start):
            return self._general_block().slice(start, stop)
        if start <= self._checked:  # the validated prefix grows only without gaps
            self._checked = max(self._checked, stop)
        return FixedChunk(rows, self.layout)

    def load(self) -> FixedRecords | RecordBlock:
        """All records in memory, validated (evaluation caches, shuffling)."""
        if self._rows is None and self._general is None:
            rows = self._read(0, self.n)
            if self._validate(rows, 0):
                self._rows, self._checked = rows, self.n
            else:
                return self._general_block()
        return self._general if self._general is not None else self

    def take(self, perm: np.ndarray) -> FixedRecords | RecordBlock:
        """The records in the order ``perm`` (in memory)."""
        loaded = self.load()
        if isinstance(loaded, RecordBlock):
            return loaded.take(perm)
        out = FixedRecords(self.path, self.data_at, len(perm), self.layout,
                           first_record=self.first_record, fallback=None)
        out._rows, out._checked = np.take(self._rows, perm, axis=0), len(perm)
        return out


def open_norm_records(path: str, *, label_dim: int, dense_dim: int, slot_num: int,
                      key_type: str = "I32", check: str = "None") -> FixedRecords | None:
    """A Norm data file as :class:`FixedRecords` if its size and first record say one key per
    slot (validated batch by batch, with :func:`read_norm_file` as the fallback); None if the
    file is not laid out that way (read it with :func:`read_norm_file`)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(HEAD_BYTES), np.uint8)
    except OSError as e:
        raise DataError(f"{path}: cannot read data file: {e.strerror}") from e
    n, hdr_len = _parse_header(path, head, label_dim, dense_dim, slot_num, check)
    kw = 4 if key_type == "I32" else 8
    wrap = check == "Sum"
    payload = 4 * (label_dim + dense_dim) + slot_num * (4 + kw)
    rec = payload + (5 if wrap else 0)
    if n == 0 or size != hdr_len + n * rec or head.size < hdr_len + rec:
        return None
    at = 4 if wrap else 0
    nnz_at = at + 4 * (label_dim + dense_dim)
    layout = FixedLayout(record_bytes=rec, label_at=at, label_dim=label_dim,
                         dense_at=at + 4 * label_dim, dense_dim=dense_dim, key_at=nnz_at + 4,
                         key_stride=4 + kw, key_width=kw, slot_num=slot_num, nnz_at=nnz_at,
                         wrap_payload=payload if wrap else None)

    def general() -> RecordBlock:
        return read_norm_file(path, label_dim=label_dim, dense_dim=dense_dim,
                              slot_num=slot_num, key_type=key_type, check=check)

    records = FixedRecords(path, hdr_len, n, layout, fallback=general)
    if not records._validate(head[hdr_len:hdr_len + rec].reshape(1, rec), 0):
        return None
    return records


HEAD_BYTES = 1 << 16  # enough for the header and a first one-hot record of ~5000 slots


_SEGMENTS: dict[int, np.ndarray] = {}


def _constant_segments(n: int) -> np.ndarray:
    """``arange(n)`` shared by every full one-hot batch (read-only)."""
    seg = _SEGMENTS.get(n)
    if seg is None:
        seg = np.arange(n, dtype=np.int32)
        seg.flags.writeable = False
        _SEGMENTS[n] = seg
    return seg


def decode_batch(parts: list[FixedChunk], batch_size: int, slot_nums: tuple[int, ...]):
    """(label, dense, keys per input, segments per input, mask) of a one-hot batch from
    consecutive chunks; one sparse input per entry of ``slot_nums`` (its slots in order)."""
    lay = parts[0].layout
    n = sum(len(p) for p in parts)
    alloc = np.empty if n == batch_size else np.zeros  # padding rows must be zeros
    label = alloc((batch_size, lay.label_dim), np.float32)
    dense = alloc((batch_size, lay.dense_dim), np.float32)
    single = len(slot_nums) == 1
    keys = alloc((batch_size, lay.slot_num), np.int64)
    r = 0
    for p in parts:
        p.decode_into(label[r:r + len(p)], dense[r:r + len(p)], keys[r:r + len(p)])
        r += len(p)
    mask = np.zeros(batch_size, bool)
    mask[:n] = True
    keys_out, segs_out = [], []
    s0 = 0
    for s in slot_nums:
        k = keys.ravel() if single else np.ascontiguousarray(keys[:, s0:s0 + s]).ravel()
        s0 += s
        if n == batch_size:
            seg = _constant_segments(batch_size * s)
        else:
            seg = np.full(batch_size * s, batch_size * s, np.int32)
            seg[:n * s] = np.arange(n * s, dtype=np.int32)
        keys_out.append(k)
        segs_out.append(seg)
    return label, dense, tuple(keys_out), tuple(segs_out), mask
