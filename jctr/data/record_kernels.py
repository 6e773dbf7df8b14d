"""Compiled host kernels of the readers (numba, ``nogil``: they run beside the training step on
the prefetch thread).

They decide *whether* bytes are valid and decode them; the numpy code that calls them stays the
one place that words an error (on ``False`` it goes to the general parser,
:func:`jctr.data.norm.read_norm_file`, the readable reference). numba is a dependency.

Byte reads index with uint64 (``_U``): unsigned indexing skips numba's negative-index
wrap-around, which lets LLVM merge neighbouring byte loads into one (unaligned) load.
"""

from __future__ import annotations

import numba
import numpy as np

from jctr.ops import kernel_cache


def _njit(fn):
    kernel_cache.install()  # the cache follows the modules the kernel inlines from
    try:  # compiled once, then loaded from numba's on-disk cache
        return numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # no writable cache location (read-only install and home): no cache
        return numba.njit(nogil=True)(fn)


def _inline(fn):
    return numba.njit(inline="always")(fn)


_U = np.uint64
# Keys copied per slot whatever its nnz (see decode_records); windows and output regions carry
# room for that many keys past their end.
COPY_SLACK = 16


@_inline
def _u64(b, p, k):
    """Byte ``p + k`` of ``b`` as int64. Unsigned indexing skips numba's negative-index
    wrap-around, which lets LLVM merge neighbouring byte loads into one load."""
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


# A kernel that walks records through a window of a file's bytes returns how many records it
# finished; a record that runs past the window's end stops it early (the caller reads the next
# window from that record), unless the window holds the end of the file: then the record is
# truncated, i.e. broken (-1), like any other defect.
_SHORT = -2  # _record_end: the record does not fit in the window


@_inline
def _record_end(window, p, wrap):
    """Where the payload of the record at ``p`` must end: check Sum: its length field, else the
    end of the window. ``_SHORT`` if the record does not fit, -1 if its length field is broken."""
    size = window.size
    if p >= size:
        return _SHORT
    if not wrap:
        return size
    if p + 4 > size:
        return _SHORT
    length = _i32(window, p)
    end = p + 4 + length
    if length < 0:
        return -1
    return _SHORT if end + 1 > size else end


@_inline
def _record_tail(window, p, q, end, wrap):
    """The start of the next record once the slots of the record at ``p`` ended at ``q``, or
    -1 if its length field or checksum disagrees."""
    if not wrap:
        return q
    if q != end:
        return -1
    acc = np.int64(0)
    for k in range(p + 4, end):
        acc += window[_U(k)]
    return end + 1 if (acc & 255) == window[end] else -1


@_njit
def walk_records(body, cap, wrap, fixed, slot_num, kw, starts):  # pragma: no cover - compiled
    """Record starts of a whole file body (up to ``cap``, into ``starts``) by hopping over each
    record without validating it: the general parser's walk, which then words what is wrong.
    check Sum: each length prefix gives the next start; else the label/dense bytes and each
    slot's ``nnz`` keys (a negative nnz hops like 0). Returns ``(count, end)``: a record that
    runs past the body leaves ``end`` at ``body.size + 1``."""
    size = body.size
    p = np.int64(0)
    count = 0
    while p < size and count < cap:
        starts[count] = p
        count += 1
        if wrap:
            if p + 4 > size:
                p = size + 1
                continue
            length = _i32(body, p)
            nxt = p + 5 + length
            p = size + 1 if (length < 0 or nxt > size) else nxt
            continue
        q = p + fixed
        for _ in range(slot_num):
            if q + 4 > size:
                q = size + 1
                break
            q += 4 + max(_i32(body, q), 0) * kw
            if q > size:
                q = size + 1
                break
        p = min(q, size + 1)
    return count, p


@_njit
def index_records(window, base, body_end, last, starts, first, stop, n, fixed, slot_num, kw,
                  wrap):  # pragma: no cover - compiled
    """Walk records ``first..stop-1`` from ``starts[first]``, validating each, and write their
    successors' starts into ``starts``. ``window`` holds the file body's bytes from offset
    ``base`` (``last``: up to its end ``body_end``); starts are body offsets. Returns the number
    of records walked (fewer: the next one runs past the window), or -1 at a broken record or if
    the file's ``n`` records do not end exactly at the end of the body."""
    p = starts[first] - base
    for r in range(stop - first):
        fail = -1 if last else r
        end = _record_end(window, p, wrap)
        if end < 0:
            return fail if end == _SHORT else -1
        cut = -1 if wrap else fail  # a Sum record's slots must end inside its own length
        q = p + (4 if wrap else 0) + fixed
        if q > end:
            return cut
        for _ in range(slot_num):
            if q + 4 > end:
                return cut
            c = _i32(window, q)
            if c < 0:
                return -1
            q += 4 + c * kw
            if q > end:
                return cut
        p = _record_tail(window, p, q, end, wrap)
        if p < 0 or (first + r == n - 1 and p + base != body_end):
            return -1
        starts[first + r + 1] = p + base
    return stop - first


@_njit
def decode_records(window, base, body_end, last, starts, first, count, walk, n, row0, fixed,
                   label_bytes, kw, wrap, label_u32, dense_u32, keys, segs, in_slots, in_m,
                   in_base, in_max_nnz, in_one_hot, batch_size):  # pragma: no cover - compiled
    """Decode ``count`` records into batch rows ``row0..`` (``label_u32``/``dense_u32``: the
    label and dense arrays, flat, as uint32). ``window``, ``base``, ``body_end`` and ``last``
    as for :func:`index_records`; returns the same count, or -1 also for a record that breaks a
    sparse input's limits (``max_nnz``, ``max_feature_num_per_sample``, one-hot).

    With ``walk`` the records follow each other from ``starts[first]``: each is validated as it
    is decoded (one pass over its bytes) and the next one's start written to ``starts``;
    otherwise ``starts[first + r]`` locate validated records (a shuffled order) in a window
    holding the whole body. Stores index with uint64 (``_U``): no wrap-around checks in the
    inner loops."""
    n_in = in_slots.size
    label_words = label_bytes // 4
    dense_words = (fixed - label_bytes) // 4
    p = starts[first] - base
    for r in range(count):
        if not walk:
            p = starts[first + r] - base
        fail = -1 if last else r
        end = _record_end(window, p, wrap)
        if end < 0:
            return fail if end == _SHORT else -1
        cut = -1 if wrap else fail
        pp = p + (4 if wrap else 0)
        if pp + fixed > end:
            return cut
        b = row0 + r
        for k in range(label_words):
            label_u32[_U(b * label_words + k)] = _key(window, pp + 4 * k, 4)
        for k in range(dense_words):
            dense_u32[_U(b * dense_words + k)] = _key(window, pp + label_bytes + 4 * k, 4)
        q = pp + fixed
        for i in range(n_in):
            slots = in_slots[i]
            base_i = in_base[i]
            pad_seg = batch_size * slots
            m = in_m[i]
            max_nnz = in_max_nnz[i]
            if in_one_hot[i]:
                for s in range(slots):
                    if q + 4 > end:
                        return cut
                    c = _i32(window, q)
                    q += 4
                    if c < 0 or c > 1:
                        return -1
                    if q + c * kw > end:
                        return cut
                    at = _U(base_i + b * slots + s)
                    keys[at] = _key(window, q, kw) if c else 0
                    segs[at] = b * slots + s if c else pad_seg
                    q += c * kw
            else:
                out = base_i + b * m
                mx = min(max_nnz, COPY_SLACK)
                k = 0
                for s in range(slots):
                    if q + 4 > end:
                        return cut
                    c = _i32(window, q)
                    q += 4
                    if c < 0 or c > max_nnz or k + c > m:
                        return -1
                    if q + c * kw > end:
                        return cut
                    seg = b * slots + s
                    # a fixed-length copy of mx keys (the slack after the window and after each
                    # input's output region absorbs the overrun; the next slot overwrites it)
                    # beats a copy of c keys, whose varying length the CPU mispredicts
                    for j in range(mx if c <= mx else c):
                        keys[_U(out + k + j)] = _key(window, q + kw * j, kw)
                        segs[_U(out + k + j)] = seg
                    q += kw * c
                    k += c
                for t in range(k, m):
                    keys[_U(out + t)] = 0
                    segs[_U(out + t)] = pad_seg
        if walk:
            p = _record_tail(window, p, q, end, wrap)
            if p < 0 or (first + r == n - 1 and p + base != body_end):
                return -1
            starts[first + r + 1] = p + base
    return count


@_njit
def count_keys(body, starts, payload_at, fixed, slot_num, kw, nnz):  # pragma: no cover
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
def record_columns(body, starts, payload_at, fixed, label_bytes, slot_num, kw, label_u8,
                   dense_u8, keys):  # pragma: no cover - compiled
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


@_njit
def fixed_norm_valid(rows, record_bytes, payload, nnz_at, stride,
                     slot_num):  # pragma: no cover - compiled
    """Whether the flat bytes ``rows`` of fixed-size Norm records all hold one key per slot:
    every ``nnz`` word (from byte ``nnz_at``, every ``stride`` bytes) is 1, and with check Sum
    (``payload`` >= 0) every length field is ``payload`` and every byte sum matches."""
    for r in range(rows.size // record_bytes):
        at = r * record_bytes
        if payload >= 0:
            if _i32(rows, at) != payload:
                return False
            acc = np.int64(0)
            for k in range(at + 4, at + 4 + payload):
                acc += rows[_U(k)]
            if (acc & 255) != rows[_U(at + 4 + payload)]:
                return False
        for s in range(slot_num):
            if _i32(rows, at + nnz_at + s * stride) != 1:
                return False
    return True
