"""HugeCTR's Norm format: a file list plus binary data files (header + variable-length records).

Byte layout (little endian), as in HugeCTR's data generator and reader:

* header: 8 x int64 ``error_check, number_of_records, label_dim, dense_dim, slot_num,
  reserved[3]``;
* each record: ``label_dim`` float32, ``dense_dim`` float32, then per slot an int32 ``nnz`` and
  ``nnz`` keys (uint32 for ``input_key_type`` I32, int64 for I64).

With ``check: Sum`` (``error_check`` 1) every chunk -- the header and each record -- is wrapped as
``int32 length`` (payload bytes), the payload, and one check byte: the sum of the payload's bytes
modulo 256.

:func:`read_norm_file` is the general parser and the readable reference that words every error:
record boundaries come from the compiled walk (:func:`jctr.data.record_kernels.walk_records`),
then fields are gathered for all records at once with numpy. Training reads one-hot files batch
by batch (:mod:`jctr.data.fixed`) and multi-hot ones through the compiled kernels
(:mod:`jctr.data.varlen`); both fall back to this parser for a broken file.
"""

from __future__ import annotations

import numpy as np

from jctr.data import record_kernels as kernels
from jctr.data.records import DataError, RecordBlock
from jctr.runtime.direct_io import replacing

HEADER_BYTES = 64


def _key_width(key_type: str) -> int:
    return 4 if key_type == "I32" else 8


# ---- writing --------------------------------------------------------------------------------


def write_norm_file(path: str, block: RecordBlock, *, key_type: str = "I64",
                    check: str = "None") -> None:
    """Write one Norm data file (atomically: a temporary file renamed into place)."""
    r_count, label_dim = block.label.shape
    dense_dim = block.dense.shape[1]
    slot_num = block.nnz.shape[1]
    kw = _key_width(key_type)
    nnz = block.nnz.astype(np.int64)
    slot_bytes = 4 + kw * nnz  # [R, S]
    payload = 4 * (label_dim + dense_dim) + slot_bytes.sum(axis=1)
    wrap = 5 if check == "Sum" else 0
    rec_start = np.cumsum(payload + wrap) - (payload + wrap)
    body_len = int((payload + wrap).sum())
    buf = np.zeros(body_len, np.uint8)
    ps = rec_start + (4 if wrap else 0)

    def put(positions: np.ndarray, values: np.ndarray, width: int):
        raw = np.ascontiguousarray(values).view(np.uint8).reshape(-1, width)
        buf[(positions[:, None] + np.arange(width)).ravel()] = raw.ravel()

    fl = 4 * label_dim
    if label_dim:
        put(np.repeat(ps, label_dim) + np.tile(np.arange(label_dim) * 4, r_count),
            block.label.astype("<f4").ravel(), 4)
    if dense_dim:
        put(np.repeat(ps, dense_dim) + fl + np.tile(np.arange(dense_dim) * 4, r_count),
            block.dense.astype("<f4").ravel(), 4)
    slot_off = 4 * (label_dim + dense_dim) + np.cumsum(slot_bytes, axis=1) - slot_bytes
    slot_pos = ps[:, None] + slot_off  # [R, S]
    put(slot_pos.ravel(), nnz.astype("<i4").ravel(), 4)
    counts = nnz.ravel()
    first = np.cumsum(counts) - counts
    j = np.arange(int(counts.sum())) - np.repeat(first, counts)
    key_pos = np.repeat(slot_pos.ravel() + 4, counts) + kw * j
    if kw == 4 and block.keys.size and (block.keys.min() < 0 or block.keys.max() >= 2**32):
        raise ValueError(f"{path}: input_key_type I32 holds keys in [0, 2^32); use I64")
    keys = block.keys.astype("<u4" if kw == 4 else "<i8")
    put(key_pos, keys, kw)
    header = np.array([1 if check == "Sum" else 0, r_count, label_dim, dense_dim, slot_num,
                       0, 0, 0], "<i8").view(np.uint8)
    if wrap:
        csum = np.concatenate([[0], np.cumsum(buf, dtype=np.int64)])
        put(rec_start, payload.astype("<i4"), 4)
        buf[ps + payload] = ((csum[ps + payload] - csum[ps]) % 256).astype(np.uint8)
        header = np.concatenate([np.array([HEADER_BYTES], "<i4").view(np.uint8), header,
                                 np.array([int(header.sum()) % 256], np.uint8)])
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(buf.tobytes())


# ---- reading --------------------------------------------------------------------------------


def key_width_hint(key_bytes: int) -> str:
    """What most often makes key counts garbage: keys of the other width than the config's."""
    mine, other = ("I64", "I32") if key_bytes == 8 else ("I32", "I64")
    return (f"; keys are read as {8 * key_bytes}-bit (solver.input_key_type {mine}): a file "
            f"written with {other} keys is misread from its first key on, so check "
            "input_key_type")


def _gather_i32(buf: np.ndarray, pos: np.ndarray) -> np.ndarray:
    return _gather(buf, pos, "<i4", 4)


def _gather(buf: np.ndarray, pos: np.ndarray, dtype: str, width: int) -> np.ndarray:
    if buf.size % 4 == 0 and pos.size and not np.any(pos & 3):
        # word-aligned fields (files without checksum): whole-word gathers
        words = buf.view("<u4")
        wp = pos >> 2
        if width == 4:
            return words[wp].view(dtype)
        # 8-byte fields at 4-byte offsets: one gather from an (unaligned) int64 view that
        # steps by words
        wide = np.ndarray((words.size - 1,), dtype, buffer=buf, strides=(4,))
        return wide[wp]
    raw = np.ascontiguousarray(buf[pos[:, None] + np.arange(width)])
    return raw.view(dtype).reshape(-1)


def _parse_header(path: str, buf: np.ndarray, label_dim: int, dense_dim: int, slot_num: int,
                  check: str) -> tuple[int, int]:
    """Validate a data file's header (``buf`` holds at least its first bytes) against the
    config: ``(number_of_records, header bytes)``."""
    wrap = check == "Sum"
    hdr_len = HEADER_BYTES + (5 if wrap else 0)
    if buf.size < hdr_len:
        raise DataError(f"{path}: truncated: {buf.size} bytes, shorter than the "
                        f"{hdr_len}-byte header")
    if wrap:
        length = int(buf[:4].view("<i4")[0])
        if length != HEADER_BYTES:
            raise DataError(f"{path}: header: check mode Sum expects a {HEADER_BYTES}-byte "
                            f"length prefix, got {length} (is the file written without check?)")
        hb = buf[4:4 + HEADER_BYTES]
        if int(hb.sum()) % 256 != int(buf[4 + HEADER_BYTES]):
            raise DataError(f"{path}: header: checksum mismatch")
    else:
        hb = buf[:HEADER_BYTES]
    error_check, n_records, h_label, h_dense, h_slots = (int(v) for v in hb.view("<i8")[:5])
    if not wrap and error_check & 0xFFFFFFFF == HEADER_BYTES:
        raise DataError(f"{path}: header: the file starts with a {HEADER_BYTES}-byte length "
                        "prefix, so it was written with check Sum; set the Data layer's check "
                        "to \"Sum\"")
    if error_check != int(wrap):
        raise DataError(f"{path}: header: error_check is {error_check} but the config's check "
                        f"is \"{check}\" (expected {int(wrap)})")
    for name, got, want in (("label_dim", h_label, label_dim), ("dense_dim", h_dense, dense_dim),
                            ("slot_num", h_slots, slot_num)):
        if got != want:
            where = "the sparse inputs' slot_num summed" if name == "slot_num" else name
            raise DataError(f"{path}: header: {name} is {got} but the config has {want} "
                            f"({where})")
    if n_records < 0:
        raise DataError(f"{path}: header: number_of_records is negative ({n_records})")
    return n_records, hdr_len


def read_norm_file(path: str, *, label_dim: int, dense_dim: int, slot_num: int,
                   key_type: str = "I32", check: str = "None") -> RecordBlock:
    """Read and validate one Norm data file against the config's dimensions."""
    try:
        buf = np.fromfile(path, dtype=np.uint8)
    except OSError as e:
        raise DataError(f"{path}: cannot read data file: {e.strerror}") from e
    wrap = check == "Sum"
    n_records, hdr_len = _parse_header(path, buf, label_dim, dense_dim, slot_num, check)
    body = buf[hdr_len:]
    kw = _key_width(key_type)
    fixed = 4 * (label_dim + dense_dim)
    starts = _record_starts(path, body, n_records, fixed, slot_num, kw, wrap)
    payload_start = starts + (4 if wrap else 0)
    if wrap:
        payload_len = _gather_i32(body, starts).astype(np.int64)
        limit = payload_start + payload_len
    else:
        limit = np.append(starts[1:], body.size)
    short = np.nonzero(payload_start + fixed > limit)[0]
    if short.size:
        raise DataError(f"{path}: record {int(short[0])}: shorter than its label and dense "
                        "fields")
    # fields of all records at once; the slot walk loops over slots, not samples
    label = _gather(body, (payload_start[:, None] + 4 * np.arange(label_dim)).ravel(), "<f4", 4)
    dense = _gather(body, (payload_start[:, None] + 4 * (label_dim + np.arange(dense_dim))).ravel(),
                    "<f4", 4)
    nnz = np.empty((starts.size, slot_num), np.int32)
    pos = payload_start + fixed
    slot_pos = np.empty((starts.size, slot_num), np.int64)
    for s in range(slot_num):
        over = np.nonzero(pos + 4 > limit)[0]
        if over.size:
            raise DataError(f"{path}: record {int(over[0])}: slot {s}: the record ends before "
                            "its nnz field")
        slot_pos[:, s] = pos
        nnz[:, s] = _gather_i32(body, pos)
        end = pos + 4 + kw * nnz[:, s].astype(np.int64)
        bad = np.nonzero((nnz[:, s] < 0) | (end > limit))[0]
        if bad.size:
            r = int(bad[0])
            raise DataError(f"{path}: record {r}: slot {s}: nnz {int(nnz[r, s])} runs past the "
                            "end of the record" + key_width_hint(kw))
        pos = end
    short = np.nonzero(pos != limit)[0]
    if short.size and not wrap:
        r = int(short[0])
        raise DataError(f"{path}: record {r}: its slots end at byte {int(pos[r])} but the next "
                        f"record starts at {int(limit[r])}")
    counts = nnz.ravel().astype(np.int64)
    first = np.cumsum(counts) - counts
    # key j of a slot sits at slot_pos + 4 + kw * j; one repeat gives every key's base
    key_pos = np.repeat(slot_pos.ravel() + 4 - kw * first, counts)
    key_pos += kw * np.arange(key_pos.size, dtype=np.int64)
    if kw == 4:
        keys = _gather(body, key_pos, "<u4", 4).astype(np.int64)
    else:
        keys = _gather(body, key_pos, "<i8", 8)
    if wrap and starts.size:
        walked = pos - payload_start
        bad = np.nonzero(walked != payload_len)[0]
        if bad.size:
            r = int(bad[0])
            raise DataError(f"{path}: record {r}: length field says {payload_len[r]} bytes but "
                            f"its slots span {walked[r]}")
        ends = payload_start + payload_len
        # byte sums of [start, end) and of the gaps between payloads; uint8 wraps mod 256
        bounds = np.stack([payload_start, ends], axis=1).ravel()
        sums = np.add.reduceat(body, bounds[:-1] if ends[-1] == body.size else bounds,
                               dtype=np.uint8)[::2]
        sums[payload_len == 0] = 0  # reduceat gives body[start] for an empty range
        bad = np.nonzero(sums != body[ends])[0]
        if bad.size:
            raise DataError(f"{path}: record {int(bad[0])}: checksum mismatch (check: Sum)")
    n = nnz.shape[0]  # (-1 cannot size a reshape to width 0: data without dense features)
    return RecordBlock(label.reshape(n, label_dim), dense.reshape(n, dense_dim), nnz, keys)


def _diagnose_nnz(path: str, words: np.ndarray, starts: np.ndarray, fixed_words: int,
                  slot_num: int, key_words: int) -> None:
    """A walk that ran off the file (or miscounted records) usually met a corrupt ``nnz``:
    name the first record and slot whose count is negative or runs past the end, instead of
    reporting the symptom ("truncated")."""
    q = starts.astype(np.int64) + fixed_words
    size = words.size
    bad_at = np.full(starts.size, slot_num, np.int64)
    for slot in range(slot_num):
        inside = q < size
        nnz = np.where(inside, words[np.minimum(q, size - 1)], 0).astype(np.int64)
        bad = inside & ((nnz < 0) | (q + 1 + nnz * key_words > size)) & (bad_at == slot_num)
        bad_at[bad] = slot
        q = q + 1 + np.maximum(nnz, 0) * key_words
    hit = np.nonzero(bad_at < slot_num)[0]
    if not hit.size:
        return
    r = int(hit[0])
    slot = int(bad_at[r])
    at = int(starts[r]) + fixed_words
    for _ in range(slot):  # the slot's position inside its record
        at += 1 + max(int(words[at]), 0) * key_words
    nnz = int(words[at])
    if nnz < 0:
        raise DataError(f"{path}: record {r}: slot {slot}: nnz is {nnz} (a key count cannot be "
                        "negative)" + key_width_hint(4 * key_words))
    raise DataError(f"{path}: record {r}: slot {slot}: nnz {nnz} runs past the end of the file "
                    "(the file is truncated or the count is corrupt)"
                    + key_width_hint(4 * key_words))


def _record_starts(path, body, n_records, fixed, slot_num, kw, wrap) -> np.ndarray:
    size = body.size
    if n_records == 0:
        if size:
            raise DataError(f"{path}: header says 0 records but {size} bytes follow it")
        return np.zeros(0, np.int64)
    if wrap:
        # every record announces its payload length: next = p + 4 + length + 1
        if size <= 3:
            raise DataError(f"{path}: record 0: truncated (file ends inside the record)")
        cap = min(n_records + 1, size // 5 + 1)
        starts, end_of_last = _walk(body, cap, True, 0, 0, 0)
    else:
        if size % 4:
            raise DataError(f"{path}: truncated: the body is {size} bytes, not a whole number of "
                            "4-byte fields")
        words = body.view("<i4")
        record_words = fixed // 4 + slot_num
        cap = min(n_records + 1, words.size // record_words + 1 if record_words
                  else words.size + 1)
        starts, end_of_last = _walk(body, cap, False, fixed, slot_num, kw)
        if end_of_last > size or starts.size != n_records:
            _diagnose_nnz(path, words, starts // 4, fixed // 4, slot_num, kw // 4)
    if end_of_last > size:
        raise DataError(f"{path}: record {starts.size - 1}: truncated (file ends inside the "
                        f"record at byte {int(starts[-1])})")
    if starts.size > n_records:
        raise DataError(f"{path}: header says {n_records} records but the file holds more")
    if starts.size < n_records:
        raise DataError(f"{path}: header says {n_records} records but the file holds "
                        f"{starts.size} (truncated?)")
    return starts


def _walk(body: np.ndarray, cap: int, wrap: bool, fixed: int, slot_num: int,
          kw: int) -> tuple[np.ndarray, int]:
    starts = np.empty(max(cap, 0), np.int64)
    count, end = kernels.walk_records(body, cap, wrap, fixed, slot_num, kw, starts)
    return starts[:count], int(end)
