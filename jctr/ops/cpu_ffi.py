"""Native CPU kernels as XLA FFI handlers, compiled with numba (no C toolchain, pip only).

A handler is a ``numba.cfunc`` taking XLA's ``XLA_FFI_CallFrame*`` and returning an
``XLA_FFI_Error*`` (NULL: success). The call frame is read through its C layout (XLA's
``xla/ffi/api/c_api.h``, a versioned ABI): every field used here sits at a fixed 8-byte slot.
When XLA asks a handler for its metadata (a call frame whose extension is the metadata
extension), the handler reports the API version of the XLA that calls it and does nothing else.

Kernels here:

* ``jctr_cpu_hash_lookup``: the slot of every key already in an open-addressing table (the probe
  loop of :func:`jctr.ops.hashing.find_slots` for keys that exist, with the home slot of a later
  key prefetched). XLA's formulation needs a full pass over the batch per probe round plus
  compaction.
* ``jctr_cpu_hash_insert``: find-or-insert of the keys a lookup did not find, one after the
  other in batch order (a key takes the first empty slot of its probe; a later occurrence of
  it finds that slot), in place in the table (its buffer aliased to the result). XLA's
  formulation claims slots by scatter rounds over compacted chunks.
* ``jctr_cpu_find_assign``: a training lookup in one pass over the batch: find-or-insert of
  each key, then its row (the representative position of each slot, a row for each new key:
  freed rows first), each key's bucket and the slots' rows at it fetched ahead. XLA's
  formulation: probe rounds, then a scatter and gathers over the slots and a cumsum. A batch
  of several parts goes in pieces of 8,192 positions: the helpers probe a piece (the table
  only read: a key holding a row gets it there) while the calling thread runs the one pass
  over the pieces before, in batch order, finding their lines in cache; it probes only the
  keys the parts did not find (from where their probe stopped) and, with dedupe, sets the
  representatives of the others: the same bits as one pass.
* ``jctr_cpu_adam_rows`` / ``jctr_cpu_one_state_rows``: Adam, or AdaGrad, MomentumSGD and
  Nesterov, on a bag's distinct rows (``update_type: Local``): the rows listed with their
  gradients summed in batch order, then stepped in parts on every thread; XLA's formulation
  writes [n, dim] zeros, scatter-adds the gradients at the representatives, then gathers,
  steps and scatters back the rows and their state in chunks.
* ``jctr_cpu_evict``: the eviction of a full table (the rows its new keys take, by the
  policy's ranking of the keys in a window of slots from each new key's home bucket on, their
  scores beside them; a bucket's ranks compared in vector registers), each new key claiming in
  turn: the choices of XLA's rounds over chunks of one key, without their scatters; then
  the tombstones of keys left without a row and every position's slot and row after it
  (a placed key's row kept as it claims: no gather from the slots).
* ``jctr_cpu_rebuild_slots``: a table's slots built again without its tombstones, in place,
  in one sweep (each key moved back to the first empty slot of its probe); XLA's
  formulation: a find-or-insert of every key into new slots, then scatters of the rows and
  scores.
* ``jctr_cpu_pair_dots`` / ``jctr_cpu_pair_dots_grad``: the DLRM dot interaction (strictly
  lower triangle of each sample's Gram matrix) and its gradient, float32, for a feature width
  that is a multiple of 16. Each Gram row, and each gradient row, is a sum of 16-lane rows
  weighted by scalars, written as explicit LLVM vector code (numba leaves such loops scalar).
  XLA's formulations need the batch as the innermost axis (two transposes) or run batched tiny
  matmuls one sample at a time.

The probes of the three hash kernels compare a bucket of eight slots (one cache line) with
the key in one vector compare (``_bucket_code``: LLVM vector code, AVX-512 or AVX2 alike),
not slot by slot: the slot loop's exit was a mispredicted branch per key.

What they gain: ``docs/performance.md``.

The bag, the initial rows, the interaction and the evaluation lookup split their work in parts
over helper threads (:mod:`jctr.ops.cpu_parts`): XLA runs a custom call on one of its threads,
and in a training step these kernels are often all the work that is ready.

Example::

    from jctr.ops import cpu_ffi
    if cpu_ffi.AVAILABLE:
        slots = cpu_ffi.lookup_slots(slot_keys, keys, valid)  # int32, -1: not in the table
        dots = cpu_ffi.pair_dots(feats)  # [b, f, 16k] float32 -> [b, f(f-1)/2]
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jctr.ops.hashing import _M1, _M2, BUCKET, EMPTY_KEY, UNIT_24, UNPASSED_REACH, seed_salt

try:  # optional: without numba the XLA formulations run (numba is a declared dependency)
    import numba
    from llvmlite import ir
    from numba import carray, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover
    numba = None

AVAILABLE = numba is not None and hasattr(jax, "ffi")

# Byte offsets in the C structs (all 64-bit fields or padded to 8 bytes).
_FRAME_EXTENSION, _FRAME_API, _FRAME_ARGS, _FRAME_RETS = 8, 16, 40, 80
_LIST_POINTERS = 32  # XLA_FFI_Args / XLA_FFI_Rets: struct_size, extension, size, types, pointers
_LIST_SIZE = 16  # the offset of ``size`` (how many arguments or results) in those lists
# XLA_FFI_Buffer: struct_size, extension, dtype, data, rank, dims
_BUFFER_DATA, _BUFFER_DIMS = 24, 40
_EXTENSION_TYPE, _METADATA_POINTER = 8, 24  # XLA_FFI_Metadata_Extension
_METADATA_TYPE = 1
_API_VERSION = 32  # XLA_FFI_Api: struct_size, extension, {struct_size, extension, major, minor}
_METADATA_VERSION, _METADATA_TRAITS = 24, 32  # XLA_FFI_Metadata: struct_size, api_version, traits

if AVAILABLE:
    @intrinsic
    def _pointer(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        return types.voidptr(types.int64), codegen

    @intrinsic
    def _address(typingctx, pointer):
        def codegen(context, builder, signature, args):
            return builder.ptrtoint(args[0], ir.IntType(64))
        return types.int64(types.voidptr), codegen

    from jctr.ops import cpu_parts
    from jctr.ops.host_index import prefetch as _prefetch
    from jctr.ops.host_index import prefetch_write as _prefetch_write

    @numba.njit(inline="always")
    def _word(address):
        return carray(_pointer(address), (1,), np.int64)[0]

    @numba.njit(inline="always")
    def _answer_metadata(frame):
        """True (after filling it in) if XLA asks for the handler's metadata."""
        extension = _word(frame + _FRAME_EXTENSION)
        if extension == 0:
            return False
        if carray(_pointer(extension + _EXTENSION_TYPE), (1,), np.int32)[0] != _METADATA_TYPE:
            return False
        metadata = _word(extension + _METADATA_POINTER)
        version = carray(_pointer(_word(frame + _FRAME_API) + _API_VERSION), (2,), np.int32)
        reported = carray(_pointer(metadata + _METADATA_VERSION), (2,), np.int32)
        reported[0] = version[0]
        reported[1] = version[1]
        carray(_pointer(metadata + _METADATA_TRAITS), (1,), np.uint32)[0] = 0
        return True

    @numba.njit(inline="always")
    def _buffer(frame, which, index):
        """(data address, dims address) of argument (``_FRAME_ARGS``) or result ``index``."""
        buffer = _word(_word(frame + which + _LIST_POINTERS) + 8 * index)
        return _word(buffer + _BUFFER_DATA), _word(buffer + _BUFFER_DIMS)

    _BUCKET = BUCKET
    _AHEAD = 24  # keys between a home slot's prefetch and its probe (covers memory latency)
    _HOMES = 32  # a power of two above _AHEAD: the homes hashed ahead, kept until the probe
    # positions between a row's prefetch and its use in the bag and the SGD row update: a
    # 10-hot batch's rows are in cache but for its large slots' (7 of Kaggle's 26), so 24
    # positions kept ~6 misses in flight; 64: the bag 0.83x, the update 0.80x their time on
    # uniform keys, 0.82x / 0.71x on power-law ones (docs/performance.md)
    _ROWS_AHEAD = 64
    _GOLDEN = np.uint64(0x9E3779B97F4A7C15)
    _CROWDED_PERCENT = 65  # rows in use per 100 slots above which the next bucket is fetched too

    @numba.njit(inline="always")
    def _mix(z):
        """The splitmix64 finaliser of :func:`jctr.ops.hashing.hash_keys` (uint64)."""
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))

    @numba.njit(inline="always")
    def _home(key, buckets, width):
        """The first slot of the key's bucket: :func:`jctr.ops.hashing.home_slots`."""
        z = _mix(np.uint64(key))
        return np.int64(((z >> np.uint64(32)) * np.uint64(buckets)) >> np.uint64(32)) * width

    @numba.njit(inline="always")
    def _adopt(out, source, nbytes):
        """A result buffer XLA did not alias to its input after all starts as the input."""
        if out != source:
            carray(_pointer(out), (nbytes,), np.uint8)[:] = carray(_pointer(source), (nbytes,),
                                                                   np.uint8)

    @numba.njit(inline="always")
    def _width(num_slots):
        return _BUCKET if num_slots % _BUCKET == 0 else 1

    _KEYS8 = ir.VectorType(ir.IntType(64), BUCKET)

    def _splat(builder, value, vector_type):
        """LLVM IR: ``value`` in every lane of ``vector_type`` (intrinsics' code generation)."""
        i32 = ir.IntType(32)
        one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value,
                                     ir.Constant(i32, 0))
        return builder.shuffle_vector(one, ir.Constant(vector_type, ir.Undefined),
                                      ir.Constant(ir.VectorType(i32, vector_type.count),
                                                  [0] * vector_type.count))

    @intrinsic
    def _bucket_code(typingctx, address, key):
        """The first of the eight slots at ``address`` (a bucket of int64 keys) that holds
        ``key`` or is empty, in one vector compare: its index (8: none), plus 16 when it
        holds the key. The slot loop's per-slot compare and branch (a mispredicted exit per
        key) become one load, two compares and a count of trailing zeros."""
        def codegen(context, builder, signature, args):
            i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
            vec = builder.load(builder.inttoptr(args[0], _KEYS8.as_pointer()), align=8)
            hit = builder.icmp_signed("==", vec, _splat(builder, args[1], _KEYS8))
            empty = builder.icmp_signed("==", vec, _splat(builder, ir.Constant(
                i64, int(EMPTY_KEY)), _KEYS8))
            either = builder.zext(builder.bitcast(builder.or_(hit, empty), i8), i32)
            hits = builder.zext(builder.bitcast(hit, i8), i32)
            # a bit above the eight makes the count 8 when no slot answers
            at = builder.call(cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(i32, [i32, ir.IntType(1)]), "llvm.cttz.i32"),
                [builder.or_(either, ir.Constant(i32, 1 << BUCKET)), ir.Constant(ir.IntType(1), 0)])
            found = builder.and_(builder.lshr(hits, at), ir.Constant(i32, 1))
            return builder.zext(builder.or_(at, builder.shl(found, ir.Constant(i32, 4))), i64)
        return types.int64(types.int64, types.int64), codegen

    @numba.njit(inline="always")
    def _probe_stop(slot_keys, keys_at, key, pos, width, num_slots):
        """The probe of ``key`` from ``pos`` (its home, or where an earlier probe of it
        stopped; a bucket's first slot where the slots are in buckets of eight, read a bucket
        at a time), passing tombstones: (its slot or -1, the empty slot that ended it or -1,
        the first slot of the bucket (a slot, when not in buckets) where it stopped, -1 when
        a full sweep found neither the key nor an empty slot)."""
        step = width if width == _BUCKET else 1
        for _ in range(num_slots // step):
            if width == _BUCKET:
                code = _bucket_code(keys_at + 8 * pos, key)
                at = code & 15
                if at < _BUCKET:
                    return (pos + at, -1, pos) if code & 16 else (-1, pos + at, pos)
            else:
                cur = slot_keys[pos]
                if cur == key:
                    return pos, -1, pos
                if cur == EMPTY_KEY:
                    return -1, pos, pos
            pos += step
            if pos == num_slots:
                pos = 0
        return -1, -1, -1

    @numba.njit(inline="always")
    def _probe_from(slot_keys, keys_at, key, pos, width, num_slots, insert):
        """The key's slot probing from ``pos`` (:func:`_probe_stop`), -1 when absent; with
        ``insert`` an absent key takes the empty slot its probe ended at."""
        s, empty, _ = _probe_stop(slot_keys, keys_at, key, pos, width, num_slots)
        if s < 0 and insert and empty >= 0:
            slot_keys[empty] = key
            return empty
        return s

    @numba.njit(inline="always")
    def _probe_slots(slot_keys, keys_at, key, buckets, width, num_slots, insert):
        """The key's slot from its home."""
        return _probe_from(slot_keys, keys_at, key, _home(key, buckets, width), width,
                           num_slots, insert)

    @numba.njit(inline="always")
    def _fetch_home(keys_at, rows_at, h, next_bucket, write=False):
        """Prefetch a key's bucket of slot keys at ``h`` (and the next one with
        ``next_bucket``) and the slots' rows there; with ``write`` owned by this core (the
        pass that inserts: lines the split's parts read on the other core)."""
        if write:
            _prefetch_write(keys_at + 8 * h)
            if next_bucket:
                _prefetch_write(keys_at + 8 * h + 64)
            _prefetch_write(rows_at + 4 * h)
            return
        _prefetch(keys_at + 8 * h)
        if next_bucket:
            _prefetch(keys_at + 8 * h + 64)
        _prefetch(rows_at + 4 * h)

    @numba.njit(inline="always")
    def _probe_all(slot_keys, slot_keys_address, keys, valid, out, insert=False):
        """The slot of each valid key (-1: absent); with ``insert`` an absent key takes the
        empty slot its probe ends at (keys one after the other, in batch order)."""
        n, num_slots = keys.shape[0], slot_keys.shape[0]
        width = _width(num_slots)
        buckets = num_slots // width
        for i in range(n):
            ahead = i + _AHEAD
            if ahead < n and valid[ahead]:
                _prefetch(slot_keys_address + 8 * _home(keys[ahead], buckets, width))
            out[i] = -1
            if valid[i]:
                out[i] = _probe_slots(slot_keys, slot_keys_address, keys[i], buckets, width,
                                      num_slots, insert)

    def _hash_insert(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        table_in, table_dims = _buffer(frame, _FRAME_ARGS, 0)
        key_data, key_dims = _buffer(frame, _FRAME_ARGS, 1)
        valid_data, _ = _buffer(frame, _FRAME_ARGS, 2)
        table, _ = _buffer(frame, _FRAME_RETS, 0)
        out_data, _ = _buffer(frame, _FRAME_RETS, 1)
        num_slots, n = _word(table_dims), _word(key_dims)
        _adopt(table, table_in, 8 * num_slots)
        slot_keys = carray(_pointer(table), (num_slots,), np.int64)
        _probe_all(slot_keys, table, carray(_pointer(key_data), (n,), np.int64),
                   carray(_pointer(valid_data), (n,), np.bool_),
                   carray(_pointer(out_data), (n,), np.int32), True)
        return _pointer(0)

    def _hash_lookup(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        table, table_dims = _buffer(frame, _FRAME_ARGS, 0)
        key_data, key_dims = _buffer(frame, _FRAME_ARGS, 1)
        valid_data, _ = _buffer(frame, _FRAME_ARGS, 2)
        out_data, _ = _buffer(frame, _FRAME_RETS, 0)
        n = _word(key_dims)
        job = cpu_parts.begin(frame, 6, _parts_of(n))
        h = cpu_parts.HEADER
        cpu_parts.store(job, h, table)
        cpu_parts.store(job, h + 1, _word(table_dims))
        cpu_parts.store(job, h + 2, key_data)
        cpu_parts.store(job, h + 3, valid_data)
        cpu_parts.store(job, h + 4, out_data)
        cpu_parts.store(job, h + 5, n)
        cpu_parts.run(job, frame, cpu_parts.symbol("jctr_task_hash_lookup"), _lookup_part)
        return _pointer(0)

    @numba.njit(inline="always")
    def _lookup_part(job, p):
        """Part ``p`` of a lookup: its range of keys (the table is only read)."""
        h = cpu_parts.HEADER
        table, num_slots, n = cpu_parts.load(job, h), cpu_parts.load(job, h + 1), \
            cpu_parts.load(job, h + 5)
        lo, hi = cpu_parts.part_range(job, p, n)
        _probe_all(carray(_pointer(table), (num_slots,), np.int64), table,
                   carray(_pointer(cpu_parts.load(job, h + 2) + 8 * lo), (hi - lo,), np.int64),
                   carray(_pointer(cpu_parts.load(job, h + 3) + lo), (hi - lo,), np.bool_),
                   carray(_pointer(cpu_parts.load(job, h + 4) + 4 * lo), (hi - lo,), np.int32))

    def _lookup_task(data):
        cpu_parts.work(_address(data), _lookup_part)

    @numba.njit(inline="always")
    def _representative(i, s, keys, valid, scratch):
        """Position ``i``'s representative for its slot ``s``: the earlier position of the
        same key the slot's scratch names (a stale entry from an earlier batch never names an
        earlier valid position of the same key, as the first such position wrote its own),
        else ``i``, which the scratch then names."""
        p = scratch[s]
        if p >= 0 and p < i and valid[p] and keys[p] == keys[i]:
            return p
        scratch[s] = i
        return i

    @numba.njit(inline="always")
    def _take_row(i, s, keys, valid, slot_rows, scratch, free_rows, size0, free0, capacity,
                  n_new, n_granted, rows, rep, new, granted, dedupe, lean):
        """Position ``i``'s row for its slot ``s``: an earlier position of the same key is
        its representative (:func:`_representative`); a first position whose slot has no
        row takes the top of the free stack, else the next row never handed out, while there
        is one. Without ``dedupe`` a slot that has a row gives it with no representative.
        With ``lean`` (no dedupe) ``rep`` and ``new`` are not written (no caller reads them:
        :func:`find_assign`). Returns the counts of new keys and of rows given so far."""
        if not lean:
            new[i] = False
        granted[i] = False
        if s < 0:
            rows[i] = -1
            if not lean:
                rep[i] = -1
            return n_new, n_granted
        if not dedupe and slot_rows[s] >= 0:
            # a key with a row needs no representative (the caller drops them): its slot's
            # scratch is not touched (one random access a key fewer)
            rows[i] = slot_rows[s]
            if not lean:
                rep[i] = -1
            return n_new, n_granted
        # without dedupe a slot with no row while rows are left has had no position of this
        # batch before (that one took a row): its scratch line, not fetched ahead, is left
        # alone (a wait for memory per new key; the wait left is the table full's)
        first = not dedupe and n_new < free0 + capacity - size0
        p = i if first else _representative(i, s, keys, valid, scratch)
        if not lean:
            rep[i] = p
        if p == i:
            if slot_rows[s] < 0:
                if not lean:
                    new[i] = True
                k = n_new
                n_new += 1
                if k < free0:
                    slot_rows[s] = free_rows[free0 - 1 - k]
                    granted[i] = True
                elif size0 + k - free0 < capacity:
                    slot_rows[s] = size0 + k - free0
                    granted[i] = True
                if granted[i]:
                    n_granted += 1
        rows[i] = slot_rows[s]
        return n_new, n_granted

    @numba.njit(inline="always")
    def _find_assign(slot_keys, slot_rows, scratch, free_rows, counters, keys, valid, slots,
                     rows, rep, new, granted, counters_out, marks, lo, hi):
        """Find-or-insert and rows of positions ``lo`` to ``hi`` in one pass, one key after
        the other, the counts going on from those in ``counters_out`` (new keys, rows
        granted, keys without a slot: a batch may come in pieces, in order): each key's
        bucket (keys, and the slots' rows and scratch at it) is fetched ahead. ``slots``,
        ``rep`` and ``new`` of length 0: the caller needs none of them (no dedupe), and they
        are not written (the 10-hot lookup's ~19 MB of stores; docs/performance.md).
        ``marks`` (int32, one a position, or of length 0: every position probes from its
        home) say what a split's parts found (:func:`_found_part`): -3 nothing to do (the
        part wrote the position), -2 a key with a row (its slot in ``slots``: with dedupe
        its representative is left to this pass), -1 a probe from the home, else from that
        slot, where the part's probe stopped (the slots before hold other keys for good:
        slots are only filled meanwhile, and only by this pass)."""
        num_slots = slot_keys.shape[0]
        width = _width(num_slots)
        buckets = num_slots // width
        size0, free0, capacity, dedupe = counters[0], counters[1], counters[2], counters[3]
        lean = slots.shape[0] == 0
        marked = marks.shape[0] > 0
        keys_at = slot_keys.ctypes.data
        rows_at = slot_rows.ctypes.data
        scratch_at = scratch.ctypes.data
        n_new, n_granted, unslotted = counters_out[2], counters_out[3], counters_out[4]
        # the bucket after a key's home is fetched too only where buckets overflow often: at
        # half load 1% of the keys sit outside their home bucket, and that line a key is
        # bandwidth the other keys' lines wait for (docs/performance.md)
        crowded = _crowded(counters, num_slots)
        # each key's start, hashed once when its lines are fetched and kept until its probe
        homes = np.empty(_HOMES, np.int64)
        for a in range(lo, min(lo + _AHEAD, hi)):
            homes[a & (_HOMES - 1)] = _start(keys, marks, a, buckets, width, marked)
        for i in range(lo, hi):
            a = i + _AHEAD
            if a < hi and valid[a]:
                m = marks[a] if marked else -1
                if m >= -1:
                    h = _start(keys, marks, a, buckets, width, marked)
                    homes[a & (_HOMES - 1)] = h
                    # lines the split's parts read on the other core: owned here at once
                    _fetch_home(keys_at, rows_at, h, (crowded and m == -1) or width != _BUCKET,
                                True)
                    if dedupe:
                        _prefetch_write(scratch_at + 4 * h)
                elif m == -2 and dedupe:
                    _prefetch_write(scratch_at + 4 * slots[a])
            m = marks[i] if marked else -1
            if m == -3:
                continue
            if m == -2:  # its representative (what _take_row gives a key with a row)
                if dedupe:
                    rep[i] = _representative(i, slots[i], keys, valid, scratch)
                continue
            s = -1
            if valid[i]:
                s = _probe_from(slot_keys, keys_at, keys[i], homes[i & (_HOMES - 1)], width,
                                num_slots, True)
                unslotted += s < 0
            if not lean:
                slots[i] = s
            n_new, n_granted = _take_row(i, s, keys, valid, slot_rows, scratch, free_rows,
                                         size0, free0, capacity, n_new, n_granted, rows, rep,
                                         new, granted, dedupe, lean)
        taken = min(n_new, free0)
        counters_out[0] = size0 + n_granted - taken
        counters_out[1] = free0 - taken
        # the lookup's counts of the batch, so that XLA does not sum masks of the batch
        counters_out[2] = n_new
        counters_out[3] = n_granted
        counters_out[4] = unslotted

    def _find_assign_rows(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        keys_in, table_dims = _buffer(frame, _FRAME_ARGS, 0)
        rows_in, _ = _buffer(frame, _FRAME_ARGS, 1)
        scratch_in, _ = _buffer(frame, _FRAME_ARGS, 2)
        free_data, free_dims = _buffer(frame, _FRAME_ARGS, 3)
        counter_data, _ = _buffer(frame, _FRAME_ARGS, 4)
        key_data, key_dims = _buffer(frame, _FRAME_ARGS, 5)
        valid_data, _ = _buffer(frame, _FRAME_ARGS, 6)
        n, num_slots = _word(key_dims), _word(table_dims)
        keys_at = _buffer(frame, _FRAME_RETS, 0)[0]
        rows_at = _buffer(frame, _FRAME_RETS, 1)[0]
        scratch_at = _buffer(frame, _FRAME_RETS, 2)[0]
        _adopt(keys_at, keys_in, 8 * num_slots)
        _adopt(rows_at, rows_in, 4 * num_slots)
        _adopt(scratch_at, scratch_in, 4 * num_slots)
        slots_data, slots_dims = _buffer(frame, _FRAME_RETS, 3)
        kept = _word(slots_dims)  # n, or 0: slots, rep and new not wanted (lean)
        counts_out = carray(_pointer(_buffer(frame, _FRAME_RETS, 8)[0]), (5,), np.int32)
        counts_out[2] = counts_out[3] = counts_out[4] = 0
        if _parts_of(n) > 1 and cpu_parts.threads(frame) > 1:
            # a key with a row changes nothing but its representative: the batch's pieces
            # are probed (the table only read) on every thread, and each piece goes through
            # the one pass on this thread once found, while the helpers probe the pieces
            # after it (_found_part, _assign_piece): the pass finds the lines of the piece's
            # probes still in cache, and probes only the keys the parts did not find
            parts = (n + _FIND_PIECE - 1) // _FIND_PIECE
            job = cpu_parts.begin(frame, _FOUND_WORDS + parts + (n + 1) // 2, parts)
            h = cpu_parts.HEADER
            for w, value in enumerate((keys_at, rows_at, scratch_at, free_data,
                                       _word(free_dims), counter_data, key_data, valid_data,
                                       _buffer(frame, _FRAME_RETS, 4)[0],
                                       _buffer(frame, _FRAME_RETS, 7)[0],
                                       _buffer(frame, _FRAME_RETS, 8)[0], n, num_slots,
                                       slots_data, _buffer(frame, _FRAME_RETS, 5)[0],
                                       _buffer(frame, _FRAME_RETS, 6)[0], kept)):
                cpu_parts.store(job, h + w, value)
            cpu_parts.run_in_order(job, frame, cpu_parts.symbol("jctr_task_find_assign"),
                                   _found_part, _assign_piece, h + _FOUND_WORDS)
            cpu_parts.release(job)
            return _pointer(0)
        _find_assign(carray(_pointer(keys_at), (num_slots,), np.int64),
                     carray(_pointer(rows_at), (num_slots,), np.int32),
                     carray(_pointer(scratch_at), (num_slots,), np.int32),
                     carray(_pointer(free_data), (_word(free_dims),), np.int32),
                     carray(_pointer(counter_data), (4,), np.int32),
                     carray(_pointer(key_data), (n,), np.int64),
                     carray(_pointer(valid_data), (n,), np.bool_),
                     carray(_pointer(slots_data), (kept,), np.int32),
                     carray(_pointer(_buffer(frame, _FRAME_RETS, 4)[0]), (n,), np.int32),
                     carray(_pointer(_buffer(frame, _FRAME_RETS, 5)[0]), (kept,), np.int32),
                     carray(_pointer(_buffer(frame, _FRAME_RETS, 6)[0]), (kept,), np.bool_),
                     carray(_pointer(_buffer(frame, _FRAME_RETS, 7)[0]), (n,), np.bool_),
                     counts_out, carray(_pointer(0), (0,), np.int32), 0, n)
        return _pointer(0)

    @numba.njit(inline="always")
    def _start(keys, marks, i, buckets, width, marked):
        """Where position ``i`` of a find-and-assign probes from (:func:`_find_assign`)."""
        if marked and marks[i] >= 0:
            return np.int64(marks[i])
        return _home(keys[i], buckets, width)

    @numba.njit(inline="always")
    def _crowded(counters, num_slots):
        """Whether a table's buckets overflow often enough (rows in use a share of the slots:
        ``counters`` size, free count) that a probe fetches the bucket after its home too."""
        return (counters[0] - counters[1]) * 100 > num_slots * _CROWDED_PERCENT

    # a split find-and-assign's job record: slot keys, slot rows, scratch, free rows and
    # their count, counters, keys, valid, rows, granted, counts, how many positions and
    # slots; the positions' slots, rep and new and their length (0: lean); then each part's
    # done flag, then each position's mark (int32: _find_assign)
    _FOUND_WORDS = 17
    # positions in a piece of a split find-and-assign: the lines its probes fetched (~3 a
    # key in a crowded table: 1.5 MB) are still in the caches when its pass runs
    _FIND_PIECE = 8192

    @numba.njit(inline="always")
    def _found_arrays(job):
        """The arrays of a split find-and-assign's record: slot keys, slot rows, scratch,
        free rows, counters, keys, valid, slots, rows, rep, new, granted, counts, marks."""
        h = cpu_parts.HEADER
        n, num_slots, kept = (cpu_parts.load(job, h + 11), cpu_parts.load(job, h + 12),
                              cpu_parts.load(job, h + 16))
        parts = cpu_parts.part_count(job)
        return (carray(_pointer(cpu_parts.load(job, h)), (num_slots,), np.int64),
                carray(_pointer(cpu_parts.load(job, h + 1)), (num_slots,), np.int32),
                carray(_pointer(cpu_parts.load(job, h + 2)), (num_slots,), np.int32),
                carray(_pointer(cpu_parts.load(job, h + 3)), (cpu_parts.load(job, h + 4),),
                       np.int32),
                carray(_pointer(cpu_parts.load(job, h + 5)), (4,), np.int32),
                carray(_pointer(cpu_parts.load(job, h + 6)), (n,), np.int64),
                carray(_pointer(cpu_parts.load(job, h + 7)), (n,), np.bool_),
                carray(_pointer(cpu_parts.load(job, h + 13)), (kept,), np.int32),
                carray(_pointer(cpu_parts.load(job, h + 8)), (n,), np.int32),
                carray(_pointer(cpu_parts.load(job, h + 14)), (kept,), np.int32),
                carray(_pointer(cpu_parts.load(job, h + 15)), (kept,), np.bool_),
                carray(_pointer(cpu_parts.load(job, h + 9)), (n,), np.bool_),
                carray(_pointer(cpu_parts.load(job, h + 10)), (5,), np.int32),
                carray(_pointer(job + 8 * (h + _FOUND_WORDS + parts)), (n,), np.int32))

    @numba.njit(inline="always")
    def _found_part(job, p):
        """Part ``p`` of a split find-and-assign, the table only read: a position whose key
        holds a row gets it and what else the one pass would give it (but for its
        representative with dedupe), an invalid position all it would get; each position's
        mark tells :func:`_find_assign` what is left (the others: where their probe
        stopped)."""
        (slot_keys, slot_rows, scratch, _, counters, keys, valid, slots, rows, rep, new,
         granted, _, marks) = _found_arrays(job)
        num_slots = slot_keys.shape[0]
        width = _width(num_slots)
        buckets = num_slots // width
        keys_at, rows_at = slot_keys.ctypes.data, slot_rows.ctypes.data
        crowded = _crowded(counters, num_slots)
        kept = slots.shape[0] > 0
        dedupe = counters[3]
        lo, hi = cpu_parts.part_range(job, p, keys.shape[0])
        homes = np.empty(_HOMES, np.int64)
        for i in range(lo, min(lo + _AHEAD, hi)):
            homes[i & (_HOMES - 1)] = _home(keys[i], buckets, width)
        for i in range(lo, hi):
            ahead = i + _AHEAD
            if ahead < hi and valid[ahead]:
                a = _home(keys[ahead], buckets, width)
                homes[ahead & (_HOMES - 1)] = a
                _fetch_home(keys_at, rows_at, a, crowded or width != _BUCKET)
            s, stop, r = -1, -1, -1
            if valid[i]:
                s, _, stop = _probe_stop(slot_keys, keys_at, keys[i],
                                         homes[i & (_HOMES - 1)], width, num_slots)
                r = slot_rows[s] if s >= 0 else -1
                if r < 0:
                    marks[i] = stop
                    continue
            marks[i] = -2 if r >= 0 else -3
            rows[i] = r
            granted[i] = False
            if kept:
                slots[i] = s
                new[i] = False
                if not dedupe or r < 0:
                    rep[i] = -1

    @numba.njit(inline="always")
    def _assign_piece(job, p):
        """Part ``p``'s positions through the one pass (:func:`_find_assign`), after the
        parts before: the same bits as the one pass over every position."""
        (slot_keys, slot_rows, scratch, free_rows, counters, keys, valid, slots, rows, rep,
         new, granted, counts, marks) = _found_arrays(job)
        lo, hi = cpu_parts.part_range(job, p, keys.shape[0])
        _find_assign(slot_keys, slot_rows, scratch, free_rows, counters, keys, valid, slots,
                     rows, rep, new, granted, counts, marks, lo, hi)

    def _find_assign_task(data):
        cpu_parts.work(_address(data), _found_part)

    _WORDS16 = ir.VectorType(ir.IntType(64), 16)

    def _signed64(value):
        value = int(value) % (1 << 64)
        return value - (1 << 64) if value >= 1 << 63 else value

    @intrinsic
    def _key_uniform_16(typingctx, dst, h, first, scales):
        """Columns ``first .. first + 15`` of a row's initial vector (``h``: the key's salted
        hash; ``scales``: the address of the scales from ``first`` on) written at ``dst``:
        :func:`jctr.ops.hashing.key_uniform` times the scales, bit for bit, as 16-lane vector
        code (numba leaves the column loop mostly scalar: ~38 ns a row of 16)."""
        def codegen(context, builder, signature, args):
            i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
            lanes32 = ir.VectorType(i32, 16)
            floats = ir.VectorType(f32, 16)

            def const(value):
                return _splat(builder, ir.Constant(i64, _signed64(value)), _WORDS16)

            golden = int(_GOLDEN)
            base = builder.mul(builder.add(args[2], ir.Constant(i64, 1)),
                               ir.Constant(i64, _signed64(golden)))
            z = builder.add(_splat(builder, builder.add(args[1], base), _WORDS16),
                            ir.Constant(_WORDS16, [_signed64(j * golden) for j in range(16)]))
            for shift, factor in ((30, int(_M1)), (27, int(_M2))):
                z = builder.mul(builder.xor(z, builder.lshr(z, const(shift))), const(factor))
            z = builder.xor(z, builder.lshr(z, const(31)))
            bits = builder.trunc(builder.lshr(z, const(40)), lanes32)  # 24 bits: exact below
            u = builder.fmul(builder.sitofp(bits, floats),
                             _splat(builder, ir.Constant(f32, float(UNIT_24)), floats))
            v = builder.fsub(builder.fmul(_splat(builder, ir.Constant(f32, 2.0), floats), u),
                             _splat(builder, ir.Constant(f32, 1.0), floats))
            scale = builder.load(builder.inttoptr(args[3], floats.as_pointer()), align=4)
            builder.store(builder.fmul(v, scale),
                          builder.inttoptr(args[0], floats.as_pointer()), align=4)
        return types.void(types.int64, types.uint64, types.int64, types.int64), codegen

    @numba.njit(inline="always")
    def _init_rows(values, row_slot, keys, rows, fresh, key_slots, scales, salt, zero_tail,
                   slot_num, extra_at, extra_width, fill_at):
        """Each fresh position's row gets its key's initial vector
        (:func:`jctr.ops.hashing.key_uniform` times ``scales``, bit for bit; with
        ``zero_tail`` every column but the first is 0) and its slot (``key_slots``, modulo
        ``slot_num`` where it is not 0: a segment gives its slot), and its row of each
        extra array (4-byte elements, ``extra_width`` a row, at ``extra_at``: an evicting
        table's optimizer rows) the fill row at ``fill_at``; one pass over the batch, the rows
        written in place (the lines of a position ``_AHEAD`` on fetched first)."""
        n, capacity, dim = keys.shape[0], values.shape[0], values.shape[1]
        values_at, slot_at = values.ctypes.data, row_slot.ctypes.data
        scales_at = scales.ctypes.data
        vector = dim % 16 == 0 and not zero_tail
        extras = extra_at.shape[0]
        # rows of whole 64-byte lines are written with non-temporal stores, never read first
        # (an evicting table's optimizer rows are random lines: 2 lines of 106,496 random
        # rows 2.7 -> 1.2 ms, docs/performance.md)
        streamed = np.zeros(extras, np.bool_)
        for e in range(extras):
            streamed[e] = extra_width[e] % 16 == 0 and extra_at[e] % 64 == 0
        for i in range(n):
            ahead = i + _AHEAD
            if ahead < n and fresh[ahead] and 0 <= rows[ahead] < capacity:
                # its vector's line and its slot id's (a full table's rows are random ones)
                ra = np.int64(rows[ahead])
                _prefetch(values_at + 4 * dim * ra)
                _prefetch(slot_at + 4 * ra)
                for e in range(extras):
                    if not streamed[e]:
                        _prefetch(extra_at[e] + 4 * extra_width[e] * ra)
            r = rows[i]
            if not fresh[i] or r < 0 or r >= capacity:
                continue
            for e in range(extras):
                width = extra_width[e]
                at = extra_at[e] + 4 * width * np.int64(r)
                if streamed[e]:
                    for c in range(0, width, 16):
                        _stream_16(at + 4 * c, fill_at[e] + 4 * c)
                    continue
                row = carray(_pointer(at), (width,), np.int32)
                fill = carray(_pointer(fill_at[e]), (width,), np.int32)
                for c in range(width):
                    row[c] = fill[c]
            h = _mix(np.uint64(keys[i]) ^ salt)
            if vector:
                for c in range(0, dim, 16):
                    _key_uniform_16(values_at + 4 * (dim * np.int64(r) + c), h, c,
                                    scales_at + 4 * c)
            else:
                for c in range(dim):
                    bits = _mix(h + np.uint64(c + 1) * _GOLDEN) >> np.uint64(40)
                    u = np.float32(bits) * UNIT_24
                    v = (np.float32(2.0) * u - np.float32(1.0)) * scales[c]
                    values[r, c] = np.float32(0.0) if zero_tail and c > 0 else v
            row_slot[r] = key_slots[i] % slot_num if slot_num else key_slots[i]
        if streamed.any():  # the streamed lines reach memory before another thread reads
            _store_fence()

    def _init_rows_frame(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        values_in, value_dims = _buffer(frame, _FRAME_ARGS, 0)
        slot_in, _ = _buffer(frame, _FRAME_ARGS, 1)
        key_data, key_dims = _buffer(frame, _FRAME_ARGS, 2)
        params = carray(_pointer(_buffer(frame, _FRAME_ARGS, 7)[0]), (3,), np.int64)
        shape = carray(_pointer(value_dims), (2,), np.int64)
        capacity, dim, n = shape[0], shape[1], _word(key_dims)
        values_at = _buffer(frame, _FRAME_RETS, 0)[0]
        slot_at = _buffer(frame, _FRAME_RETS, 1)[0]
        _adopt(values_at, values_in, 4 * capacity * dim)
        _adopt(slot_at, slot_in, 4 * capacity)
        # after the eight fixed arguments, pairs (array [capacity(, width)], its fill row)
        extras = (_word(frame + _FRAME_ARGS + _LIST_SIZE) - 8) // 2
        extra_at = np.empty(extras, np.int64)
        extra_width = np.empty(extras, np.int64)
        fill_at = np.empty(extras, np.int64)
        for e in range(extras):
            data_in = _buffer(frame, _FRAME_ARGS, 8 + 2 * e)[0]
            fill_data, fill_dims = _buffer(frame, _FRAME_ARGS, 9 + 2 * e)
            fill_at[e] = fill_data
            extra_width[e] = _word(fill_dims)
            extra_at[e] = _buffer(frame, _FRAME_RETS, 2 + e)[0]
            _adopt(extra_at[e], data_in, 4 * capacity * extra_width[e])
        # parts: ranges of positions (a fresh row is one position's: parts write apart)
        parts = _parts_of(n)
        job = cpu_parts.begin(frame, _INIT_WORDS + 3 * extras, parts)
        h = cpu_parts.HEADER
        words = (values_at, capacity, dim, slot_at, key_data, n,
                 _buffer(frame, _FRAME_ARGS, 3)[0], _buffer(frame, _FRAME_ARGS, 4)[0],
                 _buffer(frame, _FRAME_ARGS, 5)[0], _buffer(frame, _FRAME_ARGS, 6)[0],
                 params[0], params[1], params[2], extras)
        for w in range(_INIT_WORDS):
            cpu_parts.store(job, h + w, words[w])
        for e in range(extras):
            cpu_parts.store(job, h + _INIT_WORDS + 3 * e, extra_at[e])
            cpu_parts.store(job, h + _INIT_WORDS + 3 * e + 1, extra_width[e])
            cpu_parts.store(job, h + _INIT_WORDS + 3 * e + 2, fill_at[e])
        cpu_parts.run(job, frame, cpu_parts.symbol("jctr_task_init_rows"), _init_part)
        return _pointer(0)

    # the initial rows' job record: values, capacity, dim, row slots, keys, positions, rows,
    # fresh, key slots, scales, salt, zero tail, slot_num, extras, then (address, width,
    # fill) an extra array
    _INIT_WORDS = 14

    @numba.njit(inline="always")
    def _init_part(job, p):
        """Part ``p`` of the initial rows: its range of positions."""
        h = cpu_parts.HEADER
        capacity, dim, n = cpu_parts.load(job, h + 1), cpu_parts.load(job, h + 2), \
            cpu_parts.load(job, h + 5)
        extras = cpu_parts.load(job, h + 13)
        lo, hi = cpu_parts.part_range(job, p, n)
        extra_at = np.empty(extras, np.int64)
        extra_width = np.empty(extras, np.int64)
        fill_at = np.empty(extras, np.int64)
        for e in range(extras):
            extra_at[e] = cpu_parts.load(job, h + _INIT_WORDS + 3 * e)
            extra_width[e] = cpu_parts.load(job, h + _INIT_WORDS + 3 * e + 1)
            fill_at[e] = cpu_parts.load(job, h + _INIT_WORDS + 3 * e + 2)
        _init_rows(carray(_pointer(cpu_parts.load(job, h)), (capacity, dim), np.float32),
                   carray(_pointer(cpu_parts.load(job, h + 3)), (capacity,), np.int32),
                   carray(_pointer(cpu_parts.load(job, h + 4) + 8 * lo), (hi - lo,), np.int64),
                   carray(_pointer(cpu_parts.load(job, h + 6) + 4 * lo), (hi - lo,), np.int32),
                   carray(_pointer(cpu_parts.load(job, h + 7) + lo), (hi - lo,), np.bool_),
                   carray(_pointer(cpu_parts.load(job, h + 8) + 4 * lo), (hi - lo,), np.int32),
                   carray(_pointer(cpu_parts.load(job, h + 9)), (dim,), np.float32),
                   np.uint64(cpu_parts.load(job, h + 10)), cpu_parts.load(job, h + 11) != 0,
                   cpu_parts.load(job, h + 12), extra_at, extra_width, fill_at)

    def _init_task(data):
        cpu_parts.work(_address(data), _init_part)

    _ROW16 = ir.VectorType(ir.FloatType(), 16)

    @intrinsic
    def _stream_16(typingctx, dst, src):
        """Sixteen 4-byte words at ``src`` stored at the 64-byte aligned ``dst`` as one
        non-temporal store: a whole cache line written without reading it first."""
        def codegen(context, builder, signature, args):
            row = builder.load(builder.inttoptr(args[1], _ROW16.as_pointer()), align=4)
            store = builder.store(row, builder.inttoptr(args[0], _ROW16.as_pointer()),
                                  align=64)
            store.set_metadata("nontemporal", builder.module.add_metadata(
                [ir.Constant(ir.IntType(32), 1)]))
        return types.void(types.int64, types.int64), codegen

    @intrinsic
    def _store_fence(typingctx):
        """Orders the non-temporal stores before everything after (x86: they bypass the
        cache's ordering)."""
        def codegen(context, builder, signature, args):
            builder.fence("seq_cst")
        return types.void(), codegen

    @intrinsic
    def _add_16(typingctx, dst, src):
        """Sixteen float32 at address ``src`` added to those at ``dst``, as one vector (numba
        leaves the element loop scalar: three instructions instead of ~50 a row)."""
        def codegen(context, builder, signature, args):
            to = builder.inttoptr(args[0], _ROW16.as_pointer())
            row = builder.load(builder.inttoptr(args[1], _ROW16.as_pointer()), align=4)
            builder.store(builder.fadd(builder.load(to, align=4), row), to, align=4)
        return types.void(types.int64, types.int64), codegen

    @intrinsic
    def _add_scaled_16(typingctx, dst, src, factor):
        """``dst += factor * src`` on sixteen float32, as one vector: the product rounded,
        then the sum (no fused multiply-add: the bits of XLA's ``factor * src`` added)."""
        def codegen(context, builder, signature, args):
            to = builder.inttoptr(args[0], _ROW16.as_pointer())
            row = builder.load(builder.inttoptr(args[1], _ROW16.as_pointer()), align=4)
            scaled = builder.fmul(row, _splat(builder, args[2], _ROW16))
            builder.store(builder.fadd(builder.load(to, align=4), scaled), to, align=4)
        return types.void(types.int64, types.int64, types.float32), codegen

    @numba.njit(inline="always")
    def _rows_and_segments(values, rows, segments, per_segment, into_rows, factor):
        """One pass over the batch between table rows and segment rows, the table row of a
        position ``_ROWS_AHEAD`` on fetched first (positions whose row is outside ``values`` or
        whose segment is outside ``per_segment`` skipped): with ``into_rows``
        ``values[rows[i]] += factor * per_segment[segments[i]]`` in batch order (plain SGD:
        ``factor`` is -lr, so XLA makes no scaled copy of the segments' gradients), else
        ``per_segment[s]`` += the sum of its positions' rows (the bag's forward, on zeros), so
        the [n, dim] rows or gradients in between (136 MB for a 10-hot batch) are never
        written out."""
        n, capacity, dim, num_segments = rows.shape[0], values.shape[0], values.shape[1], \
            per_segment.shape[0]
        values_at, segments_at = values.ctypes.data, per_segment.ctypes.data
        for i in range(n):
            ahead = i + _ROWS_AHEAD
            if ahead < n and 0 <= rows[ahead] < capacity:
                _prefetch(values_at + 4 * dim * np.int64(rows[ahead]))
            r, s = rows[i], segments[i]
            if r < 0 or r >= capacity or s < 0 or s >= num_segments:
                continue
            if dim % 16 == 0:
                for c in range(0, dim, 16):
                    row = values_at + 4 * (dim * np.int64(r) + c)
                    segment = segments_at + 4 * (dim * np.int64(s) + c)
                    if into_rows:
                        _add_scaled_16(row, segment, factor)
                    else:
                        _add_16(segment, row)
            elif into_rows:
                for c in range(dim):
                    values[r, c] += factor * per_segment[s, c]
            else:
                for c in range(dim):
                    per_segment[s, c] += values[r, c]

    @numba.njit(inline="always")
    def _batch_operands(frame, values_at):
        """(values [rows, dim] float32 at ``values_at`` with argument 0's shape, rows,
        segments): the operands both segment kernels take first."""
        _, value_dims = _buffer(frame, _FRAME_ARGS, 0)
        row_data, row_dims = _buffer(frame, _FRAME_ARGS, 1)
        segment_data, _ = _buffer(frame, _FRAME_ARGS, 2)
        shape = carray(_pointer(value_dims), (2,), np.int64)
        n = _word(row_dims)
        return (carray(_pointer(values_at), (shape[0], shape[1]), np.float32),
                carray(_pointer(row_data), (n,), np.int32),
                carray(_pointer(segment_data), (n,), np.int32))

    # positions a part of a kernel split over the helper threads takes at least, and the most parts
    # (parts beyond the threads balance a thread that starts late or runs slow)
    _PART_POSITIONS = 1 << 14
    _MOST_PARTS = cpu_parts.MOST_PARTS

    @numba.njit(inline="always")
    def _parts_of(n):
        return max(1, min(_MOST_PARTS, n // _PART_POSITIONS))

    # the bag's job record: values, capacity, dim, rows, segments, out, segments out, then
    # parts + 1 position bounds and parts + 1 segment bounds
    _BAG_WORDS = 7

    @numba.njit(inline="always")
    def _bag_part(job, p):
        """Part ``p`` of the bag: its segments' sums zeroed, then its positions added."""
        h = cpu_parts.HEADER
        capacity, dim, num_segments = cpu_parts.load(job, h + 1), cpu_parts.load(job, h + 2), \
            cpu_parts.load(job, h + 6)
        parts = cpu_parts.part_count(job)
        bounds = h + _BAG_WORDS
        lo, hi = cpu_parts.load(job, bounds + p), cpu_parts.load(job, bounds + p + 1)
        first = cpu_parts.load(job, bounds + parts + 1 + p)
        end = cpu_parts.load(job, bounds + parts + 2 + p)
        out = carray(_pointer(cpu_parts.load(job, h + 5)), (num_segments, dim), np.float32)
        out[first:end, :] = np.float32(0.0)
        _rows_and_segments(
            carray(_pointer(cpu_parts.load(job, h)), (capacity, dim), np.float32),
            carray(_pointer(cpu_parts.load(job, h + 3) + 4 * lo), (hi - lo,), np.int32),
            carray(_pointer(cpu_parts.load(job, h + 4) + 4 * lo), (hi - lo,), np.int32),
            out, False, np.float32(1.0))

    def _bag_task(data):
        cpu_parts.work(_address(data), _bag_part)

    def _bag_sum_frame(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        values, rows, segments = _batch_operands(frame, _buffer(frame, _FRAME_ARGS, 0)[0])
        out, out_dims = _buffer(frame, _FRAME_RETS, 0)
        n, num_segments = rows.shape[0], _word(out_dims)
        # parts are runs of whole segments: segments in batch order (as a batch lays them
        # out) or one part
        unsorted = False
        for i in range(1, n):
            unsorted |= segments[i] < segments[i - 1]
        parts = 1 if unsorted else _parts_of(n)
        job = cpu_parts.begin(frame, _BAG_WORDS + 2 * (parts + 1), parts)
        h = cpu_parts.HEADER
        cpu_parts.store(job, h, values.ctypes.data)
        cpu_parts.store(job, h + 1, values.shape[0])
        cpu_parts.store(job, h + 2, values.shape[1])
        cpu_parts.store(job, h + 3, rows.ctypes.data)
        cpu_parts.store(job, h + 4, segments.ctypes.data)
        cpu_parts.store(job, h + 5, out)
        cpu_parts.store(job, h + 6, num_segments)
        bounds = h + _BAG_WORDS
        at = 0
        for p in range(parts + 1):
            if p == parts:
                at = n
            elif p > 0:
                at = max(at, p * n // parts)
                while at < n and segments[at] == segments[at - 1]:
                    at += 1
            cpu_parts.store(job, bounds + p, at)
            first = 0 if p == 0 else num_segments
            if 0 < p < parts and at < n:
                first = min(max(np.int64(segments[at]), 0), num_segments)
            cpu_parts.store(job, bounds + parts + 1 + p, first)
        cpu_parts.run(job, frame, cpu_parts.symbol("jctr_task_bag_sum"), _bag_part)
        return _pointer(0)

    def _add_by_segment_frame(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        values_at = _buffer(frame, _FRAME_RETS, 0)[0]
        values, rows, segments = _batch_operands(frame, values_at)
        _adopt(values_at, _buffer(frame, _FRAME_ARGS, 0)[0], 4 * values.size)
        update_data, update_dims = _buffer(frame, _FRAME_ARGS, 3)
        factor = carray(_pointer(_buffer(frame, _FRAME_ARGS, 4)[0]), (1,), np.float32)[0]
        _rows_and_segments(values, rows, segments,
                           carray(_pointer(update_data), (_word(update_dims), values.shape[1]),
                                  np.float32), True, factor)
        return _pointer(0)

    @intrinsic
    def _fma(typingctx, a, b, c):
        """``a * b + c`` (float32) rounded once: LLVM's fused multiply-add, as XLA's CPU code
        computes ``a * b + c * d`` where LLVM fuses it (most lanes, not all)."""
        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            fn = cgutils.get_or_insert_function(builder.module,
                                                ir.FunctionType(f32, [f32, f32, f32]),
                                                "llvm.fma.f32")
            return builder.call(fn, args)
        return types.float32(types.float32, types.float32, types.float32), codegen

    @intrinsic
    def _adam_16(typingctx, w_at, m_at, v_at, g_at, params_at):
        """Adam on sixteen float32 of a row (``w_at``, ``m_at``, ``v_at``) with their summed
        gradients (``g_at``) as vector code (numba leaves the lane loop scalar: a division
        and a square root a lane); ``params_at``: the six float32 of :func:`_step_rows`.
        The same operations and roundings as its lane loop (:func:`_step_lane`)."""
        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            ptr = _ROW16.as_pointer()
            w_p, m_p, v_p = (builder.inttoptr(a, ptr) for a in args[:3])
            g = builder.load(builder.inttoptr(args[3], ptr), align=4)
            params = builder.inttoptr(args[4], f32.as_pointer())
            b1, ob1, b2, ob2, size, eps = (
                _splat(builder, builder.load(builder.gep(params, [ir.Constant(
                    ir.IntType(64), j)])), _ROW16) for j in range(6))
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_ROW16, [_ROW16] * 3), "llvm.fma.v16f32")
            sqrt = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_ROW16, [_ROW16]), "llvm.sqrt.v16f32")
            m = builder.call(fma, [b1, builder.load(m_p, align=4), builder.fmul(ob1, g)])
            v = builder.call(fma, [b2, builder.load(v_p, align=4),
                                   builder.fmul(builder.fmul(ob2, g), g)])
            builder.store(m, m_p, align=4)
            builder.store(v, v_p, align=4)
            step = builder.fdiv(builder.fmul(size, m),
                                builder.fadd(builder.call(sqrt, [v]), eps))
            builder.store(builder.fsub(builder.load(w_p, align=4), step), w_p, align=4)
        return types.void(types.int64, types.int64, types.int64, types.int64,
                          types.int64), codegen

    # the row rules' codes: a one-state rule's place in ONE_STATE_RULES, then Adam
    _ADAGRAD, _MOMENTUM, _NESTEROV, _ADAM = 0, 1, 2, 3

    def _one_state_intrinsic(rule):
        """Vector code of one one-state rule (the rule fixed when the code is made)."""
        @intrinsic
        def one_state_16(typingctx, w_at, s_at, g_at, params_at):
            def codegen(context, builder, signature, args):
                f32 = ir.FloatType()
                ptr = _ROW16.as_pointer()
                w_p, s_p = (builder.inttoptr(a, ptr) for a in args[:2])
                g = builder.load(builder.inttoptr(args[2], ptr), align=4)
                params = builder.inttoptr(args[3], f32.as_pointer())
                lr, eps, factor = (builder.load(builder.gep(params, [ir.Constant(
                    ir.IntType(64), j)])) for j in range(3))
                lr, eps, factor, minus_lr = (_splat(builder, x, _ROW16) for x in (
                    lr, eps, factor, builder.fneg(lr)))
                fma = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(_ROW16, [_ROW16] * 3), "llvm.fma.v16f32")
                w, s = builder.load(w_p, align=4), builder.load(s_p, align=4)
                if rule == _ADAGRAD:  # w - (a > 0 ? lr * g / (sqrt(a) + eps) : 0)
                    sqrt = cgutils.get_or_insert_function(
                        builder.module, ir.FunctionType(_ROW16, [_ROW16]), "llvm.sqrt.v16f32")
                    s = builder.call(fma, [g, g, s])
                    zero = ir.Constant(_ROW16, [0.0] * 16)
                    step = builder.fdiv(builder.fmul(lr, g),
                                        builder.fadd(builder.call(sqrt, [s]), eps))
                    w = builder.fsub(w, builder.select(
                        builder.fcmp_ordered(">", s, zero), step, zero))
                else:  # momentum: m = factor * m + g; w - lr * m (Nesterov: g + factor * m)
                    s = builder.call(fma, [factor, s, g])
                    d = s if rule == _MOMENTUM else builder.call(fma, [factor, s, g])
                    w = builder.call(fma, [minus_lr, d, w])
                builder.store(s, s_p, align=4)
                builder.store(w, w_p, align=4)
            return types.void(types.int64, types.int64, types.int64, types.int64), codegen
        return one_state_16

    _adagrad_16, _momentum_16, _nesterov_16 = (
        _one_state_intrinsic(rule) for rule in (_ADAGRAD, _MOMENTUM, _NESTEROV))

    @numba.njit(inline="always")
    def _row_sums(rows, rep, segments, grads, capacity, listed, summed, index):
        """The distinct rows of a bag (``listed``, in the order of their first positions) and
        their gradients (``summed``): each the sum of its positions' segment gradients in
        batch order from 0, as XLA's scatter-add at the representatives
        (:func:`jctr.ops.bag.sum_at_representatives`) adds them; segments outside ``grads``
        add 0. ``index``: a first position's place in the list. Returns how many rows."""
        n, dim, num_segments = rows.shape[0], summed.shape[1], grads.shape[0]
        summed_at, index_at = summed.ctypes.data, index.ctypes.data
        k = 0
        zero = np.float32(0.0)
        for i in range(n):
            # a repeat's listed row, two steps ahead: its first position's place, then its row
            ahead = i + _ROWS_AHEAD
            if ahead < n and 0 <= rep[ahead] < i:
                _prefetch(index_at + 4 * np.int64(rep[ahead]))
            near = i + _ROWS_AHEAD // 2
            if near < n and 0 <= rep[near] < i:
                j = index[rep[near]]
                if j >= 0:
                    _prefetch(summed_at + 4 * dim * np.int64(j))
            r = rep[i]
            if r < 0 or r > i:
                continue
            s = segments[i]
            inside = 0 <= s < num_segments
            if r == i:
                if rows[i] < 0 or rows[i] >= capacity:
                    index[i] = -1
                    continue
                index[i] = k
                listed[k] = rows[i]
                summed[k, :] = zero  # 0 + g, as XLA's scatter-add on zeros (-0.0 -> 0.0)
                j = k
                k += 1
            else:
                j = index[r]
                if j < 0:
                    continue
            if not inside:  # a sum never is -0.0: adding 0 changes no bit
                continue
            if dim % 16 == 0:
                for c in range(0, dim, 16):
                    _add_16(summed_at + 4 * (dim * np.int64(j) + c),
                            grads.ctypes.data + 4 * (dim * np.int64(s) + c))
            else:
                for c in range(dim):
                    summed[j, c] += grads[s, c]
        return k

    @numba.njit(inline="always")
    def _step_lane(values, first, second, r, c, g, params, rule):
        """Lane ``c`` of row ``r`` stepped with its summed gradient ``g`` by the ``rule``
        (``first``, ``second``: Adam's m and v; a one-state rule's state and, unused, the
        same), as the rule's vector code steps sixteen lanes."""
        if rule == _ADAM:
            mc = _fma(params[0], first[r, c], params[1] * g)
            vc = _fma(params[2], second[r, c], params[3] * g * g)
            first[r, c] = mc
            second[r, c] = vc
            values[r, c] = values[r, c] - params[4] * mc / (np.sqrt(vc) + params[5])
        elif rule == _ADAGRAD:
            a = _fma(g, g, first[r, c])
            first[r, c] = a
            if a > 0:
                values[r, c] = values[r, c] - params[0] * g / (np.sqrt(a) + params[1])
        else:
            m = _fma(params[2], first[r, c], g)
            first[r, c] = m
            d = m if rule == _MOMENTUM else _fma(params[2], m, g)
            values[r, c] = _fma(-params[0], d, values[r, c])

    @numba.njit(inline="always")
    def _step_rows(values, first, second, listed, summed, params, rule, lo, hi):
        """The ``rule`` on the listed rows ``lo`` to ``hi`` with their summed gradients, the
        lines of a row ``_ROWS_AHEAD`` on fetched first (its vector and state: three for
        Adam, two for the others). ``params`` (float32, as XLA computes them): Adam's beta1,
        1 - beta1, beta2, 1 - beta2, the step size (HugeCTR's ``alpha_t``), epsilon, the step
        ``alpha_t * m / (sqrt(v) + epsilon)``; the others' lr, epsilon, momentum factor,
        AdaGrad HugeCTR's ``a = accum + g * g; w - lr * g / (sqrt(a) + eps)`` (no step where
        ``a`` is 0), the momenta ``m = factor * m + g``, ``w - lr * m`` (Nesterov: ``w - lr *
        (g + factor * m)``). The moments and momenta and the momenta's weight step are fused
        multiply-adds, as XLA's CPU code contracts them in the lanes where LLVM fuses them
        (not all: a rounding apart elsewhere, tests/test_cpu_ffi.py)."""
        dim = values.shape[1]
        values_at, first_at, second_at = (values.ctypes.data, first.ctypes.data,
                                          second.ctypes.data)
        params_at = params.ctypes.data
        for j in range(lo, hi):
            ahead = j + _ROWS_AHEAD
            if ahead < hi:
                line = 4 * dim * np.int64(listed[ahead])
                _prefetch(values_at + line)
                _prefetch(first_at + line)
                if rule == _ADAM:
                    _prefetch(second_at + line)
            r = listed[j]
            if dim % 16 == 0:
                for c in range(0, dim, 16):
                    at = 4 * (dim * np.int64(r) + c)
                    g_at = summed.ctypes.data + 4 * (dim * np.int64(j) + c)
                    if rule == _ADAM:
                        _adam_16(values_at + at, first_at + at, second_at + at, g_at,
                                 params_at)
                    elif rule == _ADAGRAD:
                        _adagrad_16(values_at + at, first_at + at, g_at, params_at)
                    elif rule == _MOMENTUM:
                        _momentum_16(values_at + at, first_at + at, g_at, params_at)
                    else:
                        _nesterov_16(values_at + at, first_at + at, g_at, params_at)
                continue
            for c in range(dim):
                _step_lane(values, first, second, r, c, summed[j, c], params, rule)

    # the row update's job record: values, its two state tables (a one-state rule's twice),
    # capacity, dim, listed rows, their sums, params, how many rows, the rule
    _ROWS_WORDS = 10

    @numba.njit(inline="always")
    def _rows_part(job, p):
        """Part ``p`` of a row update: its range of the listed (distinct) rows."""
        h = cpu_parts.HEADER
        capacity, dim, k = cpu_parts.load(job, h + 3), cpu_parts.load(job, h + 4), \
            cpu_parts.load(job, h + 8)
        rule = cpu_parts.load(job, h + 9)
        lo, hi = cpu_parts.part_range(job, p, k)
        _step_rows(carray(_pointer(cpu_parts.load(job, h)), (capacity, dim), np.float32),
                   carray(_pointer(cpu_parts.load(job, h + 1)), (capacity, dim), np.float32),
                   carray(_pointer(cpu_parts.load(job, h + 2)), (capacity, dim), np.float32),
                   carray(_pointer(cpu_parts.load(job, h + 5)), (k,), np.int32),
                   carray(_pointer(cpu_parts.load(job, h + 6)), (k, dim), np.float32),
                   carray(_pointer(cpu_parts.load(job, h + 7)), (6 if rule == _ADAM else 3,),
                          np.float32), rule, lo, hi)

    def _rows_task(data):
        cpu_parts.work(_address(data), _rows_part)

    @numba.njit(inline="always")
    def _rows_job(frame, states, rule):
        """A row update's handler body: arguments values, ``states`` state tables, rows,
        representatives, segments, segment gradients, params; results the tables (aliased
        to theirs) and two workspaces."""
        t = states + 1
        _, value_dims = _buffer(frame, _FRAME_ARGS, 0)
        shape = carray(_pointer(value_dims), (2,), np.int64)
        capacity, dim = shape[0], shape[1]
        for a in range(t):
            _adopt(_buffer(frame, _FRAME_RETS, a)[0], _buffer(frame, _FRAME_ARGS, a)[0],
                   4 * capacity * dim)
        row_data, row_dims = _buffer(frame, _FRAME_ARGS, t)
        n = _word(row_dims)
        grad_data, grad_dims = _buffer(frame, _FRAME_ARGS, t + 3)
        # workspaces XLA allocates (the results after the tables: counted in the step's
        # temporaries, which the memory plan reads): the listed rows' sums (the first k rows
        # used), the listed rows and each first position's place in the list
        summed = carray(_pointer(_buffer(frame, _FRAME_RETS, t)[0]), (n, dim), np.float32)
        lists = _buffer(frame, _FRAME_RETS, t + 1)[0]
        listed = carray(_pointer(lists), (n,), np.int32)
        k = _row_sums(carray(_pointer(row_data), (n,), np.int32),
                      carray(_pointer(_buffer(frame, _FRAME_ARGS, t + 1)[0]), (n,), np.int32),
                      carray(_pointer(_buffer(frame, _FRAME_ARGS, t + 2)[0]), (n,), np.int32),
                      carray(_pointer(grad_data), (_word(grad_dims), dim), np.float32),
                      capacity, listed, summed, carray(_pointer(lists + 4 * n), (n,), np.int32))
        # parts: ranges of the listed rows (distinct: parts write apart); every part done
        # before the lists are freed
        job = cpu_parts.begin(frame, _ROWS_WORDS, _parts_of(k))
        h = cpu_parts.HEADER
        words = (_buffer(frame, _FRAME_RETS, 0)[0], _buffer(frame, _FRAME_RETS, 1)[0],
                 _buffer(frame, _FRAME_RETS, states)[0],
                 capacity, dim, np.int64(listed.ctypes.data), np.int64(summed.ctypes.data),
                 _buffer(frame, _FRAME_ARGS, t + 4)[0], k, np.int64(rule))
        for w in range(_ROWS_WORDS):
            cpu_parts.store(job, h + w, words[w])
        cpu_parts.run_and_wait(job, frame, cpu_parts.symbol("jctr_task_row_rules"), _rows_part)
        cpu_parts.release(job)

    def _adam_rows_frame(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        _rows_job(frame, 2, _ADAM)
        return _pointer(0)

    def _one_state_rows_frame(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        # params: lr, epsilon, momentum factor, the rule's code (a small float32 integer)
        params = carray(_pointer(_buffer(frame, _FRAME_ARGS, 6)[0]), (4,), np.float32)
        _rows_job(frame, 1, np.int64(params[3]))
        return _pointer(0)

    _TOMBSTONE = EMPTY_KEY + 1
    _NEVER = np.iinfo(np.int64).max

    @numba.njit(inline="always")
    def _table_operands(frame):
        """A table's slot keys, slot rows and scores (the first three arguments) as the first
        three results, which XLA aliases to them (else they start as copies): carrays."""
        keys_in, slot_dims = _buffer(frame, _FRAME_ARGS, 0)
        rows_in, _ = _buffer(frame, _FRAME_ARGS, 1)
        score_in, score_dims = _buffer(frame, _FRAME_ARGS, 2)
        num_slots, tracked, columns = _word(slot_dims), _word(score_dims), _word(score_dims + 8)
        outs = (_buffer(frame, _FRAME_RETS, 0)[0], _buffer(frame, _FRAME_RETS, 1)[0],
                _buffer(frame, _FRAME_RETS, 2)[0])
        sizes = (8 * num_slots, 4 * num_slots, 4 * tracked * columns)
        ins = (keys_in, rows_in, score_in)
        for j in range(3):
            _adopt(outs[j], ins[j], sizes[j])
        return (carray(_pointer(outs[0]), (num_slots,), np.int64),
                carray(_pointer(outs[1]), (num_slots,), np.int32),
                carray(_pointer(outs[2]), (tracked, columns), np.int32))

    @numba.njit(inline="always")
    def _rank(score, r, clock, policy, epoch_steps):
        """:func:`jctr.embedding.hash_table._rank` of the key at slot ``r``."""
        last = np.int64(score[r, 0])
        if last == clock:
            return _NEVER
        if policy == 0:  # lru
            return last
        if policy == 1:  # lfu
            return (np.int64(score[r, 1]) << 32) | last
        if policy == 2:  # epoch_lru
            return ((last // epoch_steps) << 32) | last
        return ((last // epoch_steps) << 32) | np.int64(score[r, 1])  # epoch_lfu

    _EVICT_AHEAD = 8  # keys between the prefetch of their lines and their choice
    _I32x8 = ir.VectorType(ir.IntType(32), BUCKET)
    _I64x8 = ir.VectorType(ir.IntType(64), BUCKET)

    def _window_choice_codegen(policy, columns):
        """LLVM code of :func:`_window_choice` for one policy and score width."""
        def codegen(context, builder, signature, args):
            i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
            rows_at, score_at, clock, epoch_steps = args
            rows = builder.load(builder.inttoptr(rows_at, _I32x8.as_pointer()), align=4)
            if columns == 1:
                last = builder.load(builder.inttoptr(score_at, _I32x8.as_pointer()), align=4)
                second = last
            else:  # a slot's two columns side by side: the even lanes and the odd ones
                both_type = ir.VectorType(i32, 2 * BUCKET)
                both = builder.load(builder.inttoptr(score_at, both_type.as_pointer()), align=4)
                undef = ir.Constant(both_type, ir.Undefined)
                last = builder.shuffle_vector(both, undef, ir.Constant(
                    ir.VectorType(i32, BUCKET), list(range(0, 2 * BUCKET, 2))))
                second = builder.shuffle_vector(both, undef, ir.Constant(
                    ir.VectorType(i32, BUCKET), list(range(1, 2 * BUCKET, 2))))
            wide_last = builder.sext(last, _I64x8)
            shift = _splat(builder, ir.Constant(i64, 32), _I64x8)
            if policy in (2, 3):  # the epoch: floor division (a stamp is never negative)
                steps = _splat(builder, builder.trunc(epoch_steps, i32), _I32x8)
                quot = builder.sdiv(last, steps)
                neg = builder.icmp_signed("<", builder.srem(last, steps),
                                          _splat(builder, ir.Constant(i32, 0), _I32x8))
                epoch = builder.sub(quot, builder.zext(neg, _I32x8))
                high = builder.shl(builder.sext(epoch, _I64x8), shift)
            if policy == 0:  # lru
                rank = wide_last
            elif policy == 1:  # lfu: touches, then the last step
                rank = builder.or_(builder.shl(builder.sext(second, _I64x8), shift), wide_last)
            elif policy == 2:  # epoch_lru
                rank = builder.or_(high, wide_last)
            else:  # epoch_lfu
                rank = builder.or_(high, builder.sext(second, _I64x8))
            live = builder.and_(
                builder.icmp_signed(">=", rows, _splat(builder, ir.Constant(i32, 0), _I32x8)),
                builder.icmp_signed("!=", last, _splat(builder, builder.trunc(clock, i32),
                                                       _I32x8)))
            never = _splat(builder, ir.Constant(i64, int(_NEVER)), _I64x8)
            rank = builder.select(live, rank, never)
            low = builder.call(cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(i64, [_I64x8]), "llvm.vector.reduce.smin.v8i64"),
                [rank])
            lowest = builder.and_(builder.icmp_signed("==", rank, _splat(builder, low, _I64x8)),
                                  live)
            bits = builder.zext(builder.bitcast(lowest, i8), i32)
            at = builder.call(cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(i32, [i32, ir.IntType(1)]), "llvm.cttz.i32"),
                [builder.or_(bits, ir.Constant(i32, 1 << BUCKET)), ir.Constant(ir.IntType(1), 0)])
            return builder.zext(at, i64)
        return codegen

    def _window_choice_intrinsic(policy, columns):
        @intrinsic
        def choice(typingctx, rows_at, score_at, clock, epoch_steps):
            return (types.int64(types.int64, types.int64, types.int64, types.int64),
                    _window_choice_codegen(policy, columns))
        return choice

    # lru and epoch_lru keep one score column, lfu and epoch_lfu two (EvictionConfig)
    _choice_lru, _choice_lfu, _choice_epoch_lru, _choice_epoch_lfu = (
        _window_choice_intrinsic(p, 2 if p in (1, 3) else 1) for p in range(4))

    @numba.njit(inline="always")
    def _window_choice(rows_at, score_at, clock, policy, epoch_steps):
        """The policy's lowest-ranked key among a bucket's eight slots (``rows_at``,
        ``score_at``: the bucket's first row entry and score row), as :func:`_rank` ranks
        them, the first of equal ranks: its index, 8 when none has a row or every one with a
        row carries this step. One vector load of the row entries and one of the scores, the
        ranks compared in vector registers: the slot loop's two unpredictable branches a slot
        (rowless? lower?) cost as much as the key's memory accesses (docs/performance.md)."""
        if policy == 0:
            return _choice_lru(rows_at, score_at, clock, epoch_steps)
        if policy == 1:
            return _choice_lfu(rows_at, score_at, clock, epoch_steps)
        if policy == 2:
            return _choice_epoch_lru(rows_at, score_at, clock, epoch_steps)
        return _choice_epoch_lfu(rows_at, score_at, clock, epoch_steps)

    @numba.njit(inline="always")
    def _window_start(key, rnd, n_slots):
        """:func:`jctr.ops.hashing.window_start`: the home bucket of the key xored with
        ``rnd`` times the golden ratio (round 0: the key's own)."""
        salted = np.int64(np.uint64(key) ^ (np.uint64(rnd) * _GOLDEN))
        return _home(salted, n_slots // _BUCKET, _BUCKET)

    @numba.njit(inline="always")
    def _window_lines(first, new_slot, keys_at, rows_at, score_at, stride):
        """Prefetch what a new key's choice and claim read: its window's keys, row entries
        and scores (a bucket's, from ``first``: one line each for a window of eight), and its
        own slot's key (given back when it replaces a key in place, as most do)."""
        _prefetch(keys_at + 8 * first)
        _prefetch(rows_at + 4 * first)
        _prefetch(score_at + stride * first)
        _prefetch(keys_at + 8 * new_slot)

    @numba.njit(inline="always")
    def _give_back(keys_at, n_slots, g, reach):
        """Slot ``g``, whose key left it, a tombstone, then empty again with the tombstones
        just before it where no probe passes it: an empty slot ends its run of tombstones
        (those go too), or every key after it up to an empty slot within ``reach`` slots
        (:data:`jctr.ops.hashing.UNPASSED_REACH`) has its home after it
        (:func:`jctr.embedding.hash_table._give_back`); returns the tombstones made (1 less
        those cleared)."""
        slot_keys = carray(_pointer(keys_at), (n_slots,), np.int64)
        slot_keys[g] = _TOMBSTONE
        nxt = g + 1
        if nxt == n_slots:
            nxt = 0
        after = slot_keys[nxt]
        if after == EMPTY_KEY:  # the usual case, written out
            slot_keys[g] = EMPTY_KEY
            return -_empty_before(keys_at, n_slots, g)
        made = 1
        if after == _TOMBSTONE:
            made -= _clear_run(slot_keys, g)
            if slot_keys[g] == EMPTY_KEY:
                return made
        if _unpassed(keys_at, n_slots, g, reach):
            slot_keys[g] = EMPTY_KEY
            made -= 1 + _empty_before(keys_at, n_slots, g)
        return made

    @numba.njit(inline="always")
    def _unpassed(keys_at, n_slots, t, reach):
        """Whether no key's probe passes slot ``t``: every key after it up to the next empty
        slot, which must come within ``reach`` slots, has its home after ``t``."""
        slot_keys = carray(_pointer(keys_at), (n_slots,), np.int64)
        width = _width(n_slots)
        j = t
        for step in range(1, reach + 1):
            j += 1
            if j == n_slots:
                j = 0
            k = slot_keys[j]
            if k == EMPTY_KEY:
                return True
            if k == _TOMBSTONE:
                continue
            d = _home(k, n_slots // width, width) - t
            if d <= 0:
                d += n_slots
            if d > step:  # its home at or before t: its probe passes t
                return False
        return False

    @numba.njit(inline="always")
    def _clear_run(slot_keys, start):
        """The run of tombstones holding slot ``start`` emptied if an empty slot ends it
        (:func:`jctr.embedding.hash_table._clear_runs`); returns the tombstones cleared."""
        n_slots = slot_keys.shape[0]
        end = start
        for _ in range(n_slots):
            if slot_keys[end] != _TOMBSTONE:
                break
            end += 1
            if end == n_slots:
                end = 0
        if slot_keys[end] != EMPTY_KEY:
            return 0
        return _empty_before(slot_keys.ctypes.data, n_slots, end)

    @numba.njit(inline="always")
    def _empty_before(keys_at, n_slots, end):
        """The run of tombstones just before slot ``end`` (an empty slot) emptied, in the
        slot keys at ``keys_at`` (given by address: numba keeps an array argument's
        reference counts around an inlined helper, ~8% of the eviction kernel); returns the
        tombstones cleared."""
        slot_keys = carray(_pointer(keys_at), (n_slots,), np.int64)
        cleared = 0
        for _ in range(n_slots):
            end -= 1
            if end < 0:
                end = n_slots - 1
            if slot_keys[end] != _TOMBSTONE:
                break
            slot_keys[end] = EMPTY_KEY
            cleared += 1
        return cleared

    @numba.njit(inline="always")
    def _lowest_in_window(slot_rows, score, w0, width, clock, policy, epoch_steps, vector):
        """The slot of the lowest-ranked key in the window of ``width`` slots from ``w0``
        (:func:`_rank`; the first of equal ranks), -1 when none can be taken; with
        ``vector`` (a window of one bucket, the policy's score columns) in vector registers."""
        n_slots = slot_rows.shape[0]
        if vector:
            at = _window_choice(slot_rows.ctypes.data + 4 * w0,
                                score.ctypes.data + 4 * score.shape[1] * w0, clock, policy,
                                epoch_steps)
            return w0 + at if at < _BUCKET else np.int64(-1)
        best, best_rank = np.int64(-1), _NEVER
        for k in range(width):
            cand = w0 + k  # wrapping by a compare: a division costs ~40 cycles
            if cand >= n_slots:
                cand -= n_slots
            if slot_rows[cand] < 0:  # empty, a tombstone or a rowless key
                continue
            rank = _rank(score, cand, clock, policy, epoch_steps)
            if rank < best_rank:
                best, best_rank = cand, rank
        return best

    @numba.njit(inline="always")
    def _evict_all(slot_keys, slot_rows, score, keys, slots, needy, params, rows, rep,
                   placed, gone, at, rows_out, counts):
        """:func:`jctr.embedding.hash_table._evict` with chunks of one key: each needy key in
        batch order ranks its window (then, if nothing there can be taken, its next ones) and
        claims the lowest-ranked key at once, which then carries this step (no later key
        takes it). A key on the new key's probe before its own slot is replaced in place (the
        new key takes its slot, row and scores; the new key's own slot is given back);
        another moves its row (the chosen key's slot given back): :func:`_give_back`. A
        key's lines are fetched ``_EVICT_AHEAD`` keys ahead. Then what the XLA formulation
        does after its rounds (:func:`jctr.embedding.hash_table._evict`): the slots of keys
        left without a row become tombstones, each position gets the slot its key holds
        (``at``: its representative's, ``rep``) and, where ``rows`` has none, the row there
        (``rows_out``: a placed key's row is kept as it claims, so the batch's rows need no
        gather from the slots); ``counts``: tombstones made, keys placed."""
        clock, policy, epoch_steps, width = params[0], params[1], params[2], params[3]
        # a call's argument, not a constant: numba's cache of this file's kernels does not
        # see a change in jctr.ops.hashing, the XLA formulation's source of it
        unpassed_reach = params[4]
        n = slots.shape[0]
        n_slots = slot_keys.shape[0]
        columns = score.shape[1]
        score_at, keys_at = score.ctypes.data, slot_keys.ctypes.data
        rows_at = slot_rows.ctypes.data
        stride = columns * 4
        # windows of one bucket (they start at one) ranked in vector registers
        vector = width == _BUCKET and columns == (2 if policy == 1 or policy == 3 else 1)
        # each needy position's slot and row after its claim (then every position's)
        to, claimed = at, rows_out
        placed[:] = False
        gone[:] = EMPTY_KEY
        to[:] = slots
        claimed[:] = rows
        order = np.flatnonzero(needy)
        m = order.size
        homes = np.empty(m, np.int64)
        for j in range(m):
            homes[j] = _window_start(keys[order[j]], 0, n_slots)
        for j in range(min(_EVICT_AHEAD, m)):
            _window_lines(homes[j], slots[order[j]], keys_at, rows_at, score_at, stride)
        made = 0
        for j in range(m):
            ahead = j + _EVICT_AHEAD
            if ahead < m:
                _window_lines(homes[ahead], slots[order[ahead]], keys_at, rows_at, score_at,
                              stride)
            pos = order[j]
            key, own, home = keys[pos], slots[pos], homes[j]
            for rnd in range(8):  # hash_table._ROUNDS
                w0 = home if rnd == 0 else _window_start(key, rnd, n_slots)
                best = _lowest_in_window(slot_rows, score, w0, width, clock, policy,
                                         epoch_steps, vector)
                if best < 0:
                    continue
                gone[pos] = slot_keys[best]
                reach = own - home  # the probe's slots before the key's own
                if reach < 0:
                    reach += n_slots
                dist = best - home
                if dist < 0:
                    dist += n_slots
                if dist < reach:  # in place: the slot, its row and score are the new key's
                    slot_keys[best] = key
                    to[pos] = best
                    freed = own
                else:  # the chosen key's row moves to the new key's slot
                    slot_rows[own] = slot_rows[best]
                    slot_rows[best] = -1
                    freed = best
                made += _give_back(keys_at, n_slots, freed, unpassed_reach)
                score[to[pos], 0] = clock
                claimed[pos] = slot_rows[to[pos]]
                placed[pos] = True
                break
        taken = 0
        for j in range(m):  # a key left without a row gives its slot back as a tombstone
            pos = order[j]
            if placed[pos]:
                taken += 1
            elif slots[pos] >= 0:
                slot_keys[slots[pos]] = _TOMBSTONE
                made += 1
        # a position without a row: its key's slot (a repeat holds its representative's,
        # whose entries the claims wrote) and the row there. A position with a row keeps
        # both: its key took none (its representative has its slot)
        for i in range(n):
            if rows[i] >= 0:
                continue
            r = rep[i] if rep[i] >= 0 else i
            if r == i and placed[i]:
                continue
            s = at[r]
            at[i] = s
            if s >= 0:
                rows_out[i] = rows_out[r] if placed[r] else slot_rows[s]
        counts[0] = made
        counts[1] = taken

    def _evict_rows(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        slot_keys, slot_rows, score = _table_operands(frame)
        key_data, pos_dims = _buffer(frame, _FRAME_ARGS, 3)
        slot_data, _ = _buffer(frame, _FRAME_ARGS, 4)
        needy_data, _ = _buffer(frame, _FRAME_ARGS, 5)
        param_data, _ = _buffer(frame, _FRAME_ARGS, 6)
        n = _word(pos_dims)
        _evict_all(slot_keys, slot_rows, score,
                   carray(_pointer(key_data), (n,), np.int64),
                   carray(_pointer(slot_data), (n,), np.int32),
                   carray(_pointer(needy_data), (n,), np.bool_),
                   carray(_pointer(param_data), (5,), np.int64),
                   carray(_pointer(_buffer(frame, _FRAME_ARGS, 7)[0]), (n,), np.int32),
                   carray(_pointer(_buffer(frame, _FRAME_ARGS, 8)[0]), (n,), np.int32),
                   carray(_pointer(_buffer(frame, _FRAME_RETS, 3)[0]), (n,), np.bool_),
                   carray(_pointer(_buffer(frame, _FRAME_RETS, 4)[0]), (n,), np.int64),
                   carray(_pointer(_buffer(frame, _FRAME_RETS, 5)[0]), (n,), np.int32),
                   carray(_pointer(_buffer(frame, _FRAME_RETS, 6)[0]), (n,), np.int32),
                   carray(_pointer(_buffer(frame, _FRAME_RETS, 7)[0]), (2,), np.int32))
        return _pointer(0)

    @numba.njit(inline="always")
    def _clear_slot(slot_keys, slot_rows, score, s):
        """Slot ``s`` empty: no key, no row, score 0 (a table that keeps scores)."""
        slot_keys[s] = EMPTY_KEY
        slot_rows[s] = -1
        if score.shape[0]:
            for c in range(score.shape[1]):
                score[s, c] = 0

    @numba.njit(inline="always")
    def _copy_score(score, to, source, at):
        """Slot ``to``'s score columns from slot ``at`` of ``source``."""
        for c in range(score.shape[1]):
            score[to, c] = source[at, c]

    @numba.njit(inline="always")
    def _rebuild_in_place(slot_keys, slot_rows, score):
        """:func:`jctr.embedding.hash_table.rebuild_slots` in place, in one sweep over the
        slots from :func:`jctr.ops.hashing.rebuild_start` on: a tombstone or a key without a
        row leaves (its slot empty, score 0), and a key moves back to the first empty slot
        of its probe if there is one before it (its row entry and score with it). The
        sweep starts after a bucket with an empty slot, which no probe goes past, so every
        key's probe lies in the slots swept, and the slots behind the sweep are final: the
        same slots as inserting the keys anew in that order. A table without an empty slot is
        copied and the keys inserted anew from its copy."""
        n = slot_keys.shape[0]
        width = _width(n)
        buckets = n // width
        scored = score.shape[0] > 0
        keys_at = slot_keys.ctypes.data
        start = -1
        for s in range(n):
            if slot_keys[s] == EMPTY_KEY:
                start = (s - s % width + width) % n
                break
        if start < 0:  # no empty slot: nothing bounds the probes
            old_keys, old_rows, old_score = slot_keys.copy(), slot_rows.copy(), score.copy()
            for s in range(n):
                _clear_slot(slot_keys, slot_rows, score, s)
            for s in range(n):
                if old_rows[s] < 0:
                    continue
                at = _probe_slots(slot_keys, keys_at, old_keys[s], buckets, width, n, True)
                slot_rows[at] = old_rows[s]
                if scored:
                    _copy_score(score, at, old_score, s)
            return
        s = start
        for _ in range(n):
            key = slot_keys[s]
            if key != EMPTY_KEY:
                if slot_rows[s] < 0:  # a tombstone, or a key refused a row
                    _clear_slot(slot_keys, slot_rows, score, s)
                else:
                    p = _home(key, buckets, width)
                    while p != s and slot_keys[p] != EMPTY_KEY:
                        p += 1
                        if p == n:
                            p = 0
                    if p != s:
                        slot_keys[p] = key
                        slot_rows[p] = slot_rows[s]
                        if scored:
                            _copy_score(score, p, score, s)
                        _clear_slot(slot_keys, slot_rows, score, s)
            s += 1
            if s == n:
                s = 0

    def _rebuild_rows(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        slot_keys, slot_rows, score = _table_operands(frame)
        _rebuild_in_place(slot_keys, slot_rows, score)
        return _pointer(0)

    _LANES = 16  # floats per vector in the interaction kernels
    _F32 = ir.FloatType()
    _VECTOR = ir.VectorType(_F32, _LANES)

    @intrinsic
    def _weighted_row_sum(typingctx, rows, row_stride, weights, count, out):
        """``out[0:16] = sum_k weights[k] * rows[k * row_stride:][0:16]`` over ``k < count``
        (float32; addresses and the stride in bytes), one vector accumulator in registers."""
        def codegen(context, builder, signature, args):
            rows, stride, weights, count, out = args
            i64 = ir.IntType(64)
            acc = cgutils.alloca_once_value(builder, ir.Constant(_VECTOR, None))
            with cgutils.for_range(builder, count) as loop:
                k = loop.index
                w = builder.load(builder.inttoptr(
                    builder.add(weights, builder.mul(k, ir.Constant(i64, 4))),
                    _F32.as_pointer()))
                w = _splat(builder, w, _VECTOR)
                row = builder.load(builder.inttoptr(builder.add(rows, builder.mul(k, stride)),
                                                    _VECTOR.as_pointer()), align=4)
                product = builder.fmul(w, row, flags=("contract",))
                builder.store(builder.fadd(builder.load(acc), product, flags=("contract",)), acc)
            builder.store(builder.load(acc), builder.inttoptr(out, _VECTOR.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(types.int64, types.int64, types.int64, types.int64,
                          types.int64), codegen

    @numba.njit(inline="always")
    def _pair_dots_rows(feats, out, b, f, dim):
        # Gram row i = sum_d feats[s, i, d] * featsT[d, :]: 16 pairs per vector, no reduction
        # across lanes; row i's pairs with j < i are out[s, i(i-1)/2 + j]
        width = -(-f // _LANES) * _LANES
        pairs = f * (f - 1) // 2
        transposed = np.zeros(dim * width, np.float32)
        row = np.zeros(width, np.float32)
        src = carray(_pointer(feats), (b * f * dim,), np.float32)
        dst = carray(_pointer(out), (b * pairs,), np.float32)
        transposed_at, row_at = transposed.ctypes.data, row.ctypes.data
        for s in range(b):
            base = s * f * dim
            for d in range(dim):
                for j in range(f):
                    transposed[d * width + j] = src[base + j * dim + d]
            o = s * pairs
            for i in range(1, f):
                for c in range(0, i, _LANES):
                    _weighted_row_sum(transposed_at + 4 * c, 4 * width,
                                      feats + 4 * (base + i * dim), dim, row_at + 4 * c)
                for j in range(i):
                    dst[o + j] = row[j]
                o += i

    @numba.njit(inline="always")
    def _pair_dots_grad_rows(feats, grad, out, b, f, dim):
        # d feats[s, i] = sum_j S[i, j] feats[s, j], S symmetric with S[i, j] = grad[s, pair]
        pairs = f * (f - 1) // 2
        weights = np.zeros(f * f, np.float32)  # the diagonal stays 0
        g = carray(_pointer(grad), (b * pairs,), np.float32)
        weights_at = weights.ctypes.data
        for s in range(b):
            o = s * pairs
            for i in range(1, f):
                for j in range(i):
                    v = g[o + j]
                    weights[i * f + j] = v
                    weights[j * f + i] = v
                o += i
            base = feats + 4 * s * f * dim
            for i in range(f):
                for c in range(0, dim, _LANES):
                    _weighted_row_sum(base + 4 * c, 4 * dim, weights_at + 4 * i * f, f,
                                      out + 4 * ((s * f + i) * dim + c))

    @numba.njit(inline="always")
    def _features(frame):
        """(address, b, f, dim) of the features [b, f, dim] (argument 0)."""
        feats, dims = _buffer(frame, _FRAME_ARGS, 0)
        shape = carray(_pointer(dims), (3,), np.int64)
        return feats, shape[0], shape[1], shape[2]

    _PART_SAMPLES = 512  # samples a part of the interaction takes at least (~1 ms)

    @numba.njit(inline="always")
    def _pair_dots_part(job, p):
        """Part ``p`` of the interaction (forward, or backward where a gradient is given):
        its range of samples."""
        h = cpu_parts.HEADER
        feats, out, grad = cpu_parts.load(job, h), cpu_parts.load(job, h + 1), \
            cpu_parts.load(job, h + 2)
        b, f, dim = cpu_parts.load(job, h + 3), cpu_parts.load(job, h + 4), \
            cpu_parts.load(job, h + 5)
        lo, hi = cpu_parts.part_range(job, p, b)
        pairs = f * (f - 1) // 2
        if grad == 0:
            _pair_dots_rows(feats + 4 * lo * f * dim, out + 4 * lo * pairs, hi - lo, f, dim)
        else:
            _pair_dots_grad_rows(feats + 4 * lo * f * dim, grad + 4 * lo * pairs,
                                 out + 4 * lo * f * dim, hi - lo, f, dim)

    def _pair_dots_task(data):
        cpu_parts.work(_address(data), _pair_dots_part)

    @numba.njit(inline="always")
    def _pair_dots_job(frame, feats, out, grad, b, f, dim):
        parts = max(1, min(_MOST_PARTS, b // _PART_SAMPLES))
        job = cpu_parts.begin(frame, 6, parts)
        h = cpu_parts.HEADER
        cpu_parts.store(job, h, feats)
        cpu_parts.store(job, h + 1, out)
        cpu_parts.store(job, h + 2, grad)
        cpu_parts.store(job, h + 3, b)
        cpu_parts.store(job, h + 4, f)
        cpu_parts.store(job, h + 5, dim)
        cpu_parts.run(job, frame, cpu_parts.symbol("jctr_task_pair_dots"), _pair_dots_part)

    def _pair_dots(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        feats, b, f, dim = _features(frame)
        _pair_dots_job(frame, feats, _buffer(frame, _FRAME_RETS, 0)[0], 0, b, f, dim)
        return _pointer(0)

    def _pair_dots_grad(frame_pointer):
        frame = _address(frame_pointer)
        if _answer_metadata(frame):
            return _pointer(0)
        feats, b, f, dim = _features(frame)
        grad = _buffer(frame, _FRAME_ARGS, 1)[0]
        _pair_dots_job(frame, feats, _buffer(frame, _FRAME_RETS, 0)[0], grad, b, f, dim)
        return _pointer(0)

    def _cfunc(fn):
        return cpu_parts.cfunc(fn, types.voidptr(types.voidptr))

    try:
        # the tasks first: the handlers that schedule them find them by name when loaded
        for _name, _task in (("jctr_task_hash_lookup", _lookup_task),
                             ("jctr_task_find_assign", _find_assign_task),
                             ("jctr_task_bag_sum", _bag_task),
                             ("jctr_task_init_rows", _init_task),
                             ("jctr_task_row_rules", _rows_task),
                             ("jctr_task_pair_dots", _pair_dots_task)):
            cpu_parts.register_task(_name, cpu_parts.cfunc(_task, types.void(types.voidptr)))
        _hash_lookup_handler = _cfunc(_hash_lookup)
        _hash_insert_handler = _cfunc(_hash_insert)
        _find_assign_handler = _cfunc(_find_assign_rows)
        _init_rows_handler = _cfunc(_init_rows_frame)
        _bag_sum_handler = _cfunc(_bag_sum_frame)
        _add_by_segment_handler = _cfunc(_add_by_segment_frame)
        _adam_rows_handler = _cfunc(_adam_rows_frame)
        _one_state_rows_handler = _cfunc(_one_state_rows_frame)
        _evict_handler = _cfunc(_evict_rows)
        _rebuild_handler = _cfunc(_rebuild_rows)
        _pair_dots_handler = _cfunc(_pair_dots)
        _pair_dots_grad_handler = _cfunc(_pair_dots_grad)
    except Exception as error:  # a numba/LLVM that cannot build them: XLA's formulations run
        warnings.warn(f"jctr: native CPU kernels unavailable ({error}); using XLA's",
                      RuntimeWarning, stacklevel=2)
        AVAILABLE = False


def ffi_capsule(address: int):
    """A handler's address as ``jax.ffi.register_ffi_target`` takes it (a PyCapsule)."""
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    return new_capsule(address, b"xla._CUSTOM_CALL_TARGET", None)


@functools.cache
def _register() -> None:
    cpu_parts.start_helpers()
    for name, handler in (("jctr_cpu_hash_lookup", _hash_lookup_handler),
                          ("jctr_cpu_hash_insert", _hash_insert_handler),
                          ("jctr_cpu_find_assign", _find_assign_handler),
                          ("jctr_cpu_init_rows", _init_rows_handler),
                          ("jctr_cpu_bag_sum", _bag_sum_handler),
                          ("jctr_cpu_add_by_segment", _add_by_segment_handler),
                          ("jctr_cpu_adam_rows", _adam_rows_handler),
                          ("jctr_cpu_one_state_rows", _one_state_rows_handler),
                          ("jctr_cpu_evict", _evict_handler),
                          ("jctr_cpu_rebuild_slots", _rebuild_handler),
                          ("jctr_cpu_pair_dots", _pair_dots_handler),
                          ("jctr_cpu_pair_dots_grad", _pair_dots_grad_handler)):
        jax.ffi.register_ffi_target(name, ffi_capsule(handler.address), platform="cpu")


def lookup_slots(slot_keys: jax.Array, keys: jax.Array, valid: jax.Array) -> jax.Array:
    """int32 [n]: the slot holding each valid key, -1 where the key is absent or invalid.

    Same result as ``jctr.ops.hashing.find_slots(..., insert=False)``; one call, its keys
    split over the helper threads (:mod:`jctr.ops.cpu_parts`). CPU only.
    """
    _register()
    # the kernel reads int64 keys and one byte per flag, whatever the caller's dtypes
    slot_keys, keys, valid = (slot_keys.astype(jnp.int64), keys.astype(jnp.int64),
                              valid.astype(jnp.bool_))
    if keys.shape[0] == 0:
        return jnp.zeros((0,), jnp.int32)
    return jax.ffi.ffi_call("jctr_cpu_hash_lookup", jax.ShapeDtypeStruct(keys.shape, jnp.int32))(
        slot_keys, keys, valid)


def insert_slots(slot_keys: jax.Array, keys: jax.Array, valid: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """(table, int32 slots [n]): find-or-insert of every valid key, one after the other (a key
    takes the first empty slot of its probe; -1: invalid, or the table is full). The table is
    updated in place when its buffer can be donated. The same contract as
    ``jctr.ops.hashing.find_slots(..., insert=True)`` (which slot a new key gets may differ
    from the XLA formulation's, never which keys are placed). CPU only."""
    _register()
    slot_keys, keys, valid = (slot_keys.astype(jnp.int64), keys.astype(jnp.int64),
                              valid.astype(jnp.bool_))
    if keys.shape[0] == 0:
        return slot_keys, jnp.zeros((0,), jnp.int32)
    return jax.ffi.ffi_call(
        "jctr_cpu_hash_insert",
        (jax.ShapeDtypeStruct(slot_keys.shape, jnp.int64),
         jax.ShapeDtypeStruct(keys.shape, jnp.int32)),
        input_output_aliases={0: 0})(slot_keys, keys, valid)


def find_assign(slot_keys: jax.Array, slot_rows: jax.Array, scratch: jax.Array,
                free_rows: jax.Array, size: jax.Array, free_count: jax.Array, keys: jax.Array,
                valid: jax.Array, capacity: int, dedupe: bool = True, lean: bool = False):
    """Find-or-insert of every valid key and its row (:func:`jctr.ops.hashing.assign_rows`;
    a slot's first position is its representative), in one native pass: keys one after the
    other, in batch order. Without ``dedupe`` (the caller drops the representatives) a
    position whose key has a row by the time it is reached gets none (-1) and no scratch is
    touched for it. Returns (slot_keys, slots, slot_rows, scratch, rows, rep, new, granted,
    size, free_count, counts): ``counts`` int32 [3] the new keys, those granted a row and the
    valid keys that found no slot. With ``lean`` (no dedupe: a table that does not evict
    reads none of them) ``slots``, ``rep`` and ``new`` are None, and the pass writes them
    nowhere. CPU only."""
    _register()
    n = keys.shape[0]
    if lean and dedupe:
        raise ValueError("find_assign: lean leaves out the representatives dedupe gives")
    counters = jnp.stack([size, free_count, jnp.int32(capacity),
                          jnp.int32(dedupe)]).astype(jnp.int32)
    kept = 0 if lean else n
    flags = jax.ShapeDtypeStruct((kept,), jnp.bool_)
    positions = jax.ShapeDtypeStruct((kept,), jnp.int32)
    slot_keys, slot_rows, scratch, slots, rows, rep, new, granted, counts = jax.ffi.ffi_call(
        "jctr_cpu_find_assign",
        (jax.ShapeDtypeStruct(slot_keys.shape, jnp.int64),
         jax.ShapeDtypeStruct(slot_rows.shape, jnp.int32),
         jax.ShapeDtypeStruct(scratch.shape, jnp.int32), positions,
         jax.ShapeDtypeStruct((n,), jnp.int32), positions, flags,
         jax.ShapeDtypeStruct((n,), jnp.bool_), jax.ShapeDtypeStruct((5,), jnp.int32)),
        input_output_aliases={0: 0, 1: 1, 2: 2})(
            slot_keys.astype(jnp.int64), slot_rows, scratch, free_rows, counters,
            keys.astype(jnp.int64), valid.astype(jnp.bool_))
    if lean:
        slots = rep = new = None
    return (slot_keys, slots, slot_rows, scratch, rows, rep, new, granted, counts[0],
            counts[1], counts[2:])


def init_rows(values: jax.Array, row_slot: jax.Array, keys: jax.Array, rows: jax.Array,
              fresh: jax.Array, key_slots: jax.Array, scales: jax.Array, seed: int,
              zero_tail: bool, resets: tuple = (), slot_num: int = 0) -> tuple:
    """(values, row_slot, *reset arrays) with each ``fresh`` position's row (``rows``) set to
    its key's initial vector (:func:`jctr.ops.hashing.key_uniform` of ``seed`` times
    ``scales`` [dim], bit for bit; ``zero_tail``: columns after the first 0), ``row_slot`` to
    its ``key_slots`` (modulo ``slot_num`` where it is not 0: segments give their slots,
    computed for the fresh positions only), and its row of each array in ``resets`` ((array
    [capacity] or [capacity, width] of float32 or int32, fill row [width]) pairs) to the fill
    row; in one native pass, in place when the buffers can be donated. float32 values. CPU
    only."""
    _register()
    params = jnp.asarray([seed_salt(seed), int(zero_tail), slot_num], jnp.int64)
    extra_args, extra_out = [], []
    for arr, fill in resets:
        width = arr.shape[1] if arr.ndim == 2 else 1
        extra_args += [arr, jnp.broadcast_to(jnp.asarray(fill, arr.dtype).reshape(-1),
                                             (width,))]
        extra_out.append(jax.ShapeDtypeStruct(arr.shape, arr.dtype))
    aliases = {0: 0, 1: 1} | {8 + 2 * e: 2 + e for e in range(len(resets))}
    return tuple(jax.ffi.ffi_call(
        "jctr_cpu_init_rows",
        (jax.ShapeDtypeStruct(values.shape, jnp.float32),
         jax.ShapeDtypeStruct(row_slot.shape, jnp.int32), *extra_out),
        input_output_aliases=aliases)(
            values, row_slot, keys.astype(jnp.int64), rows.astype(jnp.int32),
            fresh.astype(jnp.bool_), key_slots.astype(jnp.int32),
            jnp.broadcast_to(jnp.asarray(scales, jnp.float32), (values.shape[1],)), params,
            *extra_args))


def bag_sum(values: jax.Array, rows: jax.Array, segments: jax.Array,
            num_segments: int) -> jax.Array:
    """[num_segments, dim] float32: per segment the sum of its positions' rows of ``values``
    (float32; rows < 0 and segment ids >= num_segments add nothing), in one native pass
    without the gathered [n, dim] rows. The forward of
    :func:`jctr.ops.bag.embedding_bag_forward_reference` with ``sum``. CPU only."""
    _register()
    return jax.ffi.ffi_call(
        "jctr_cpu_bag_sum", jax.ShapeDtypeStruct((num_segments, values.shape[1]), jnp.float32))(
            values, rows.astype(jnp.int32), segments.astype(jnp.int32))


def add_by_segment(values: jax.Array, rows: jax.Array, segments: jax.Array,
                   updates: jax.Array, factor: jax.Array | float = 1.0) -> jax.Array:
    """``values`` (float32) with ``factor * updates[segments[i]]`` added to row ``rows[i]``
    for every position, in batch order (rows outside ``values`` and segments outside
    ``updates`` skipped; the product rounded to float32 before the sum, as XLA's): a plain
    SGD step of a bag's rows (``factor``: -lr) without its [n, dim] per-key gradients. In
    place when ``values`` can be donated. CPU only."""
    _register()
    return jax.ffi.ffi_call(
        "jctr_cpu_add_by_segment", jax.ShapeDtypeStruct(values.shape, jnp.float32),
        input_output_aliases={0: 0})(values, rows.astype(jnp.int32),
                                     segments.astype(jnp.int32), updates.astype(jnp.float32),
                                     jnp.reshape(jnp.asarray(factor, jnp.float32), (1,)))


def adam_rows(values: jax.Array, m: jax.Array, v: jax.Array, rows: jax.Array,
              rep: jax.Array, segments: jax.Array, grads: jax.Array,
              params: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(values, m, v) after Adam on the distinct rows of a bag: row ``rows[i]`` of each
    position whose ``rep`` is itself steps with the sum, in batch order, of the segment
    gradients ``grads[segments[j]]`` of the positions ``j`` whose ``rep`` is ``i`` (segments
    outside ``grads`` add 0); ``params`` float32 [6]: beta1, 1 - beta1, beta2, 1 - beta2,
    the step size ``lr * sqrt(1 - beta2 ** t) / (1 - beta1 ** t)``, epsilon. What
    :func:`jctr.embedding.row_optimizers.apply_rows` on
    :func:`jctr.ops.bag.embedding_bag_backward_reference`'s sums gives, to a rounding of the
    moments (XLA fuses their multiply-add in some lanes only), without its [n, dim] arrays.
    In place when the tables can be donated. CPU only."""
    return _row_rule("jctr_cpu_adam_rows", (values, m, v), rows, rep, segments, grads, params)


def _row_rule(target: str, tables: tuple, rows, rep, segments, grads, params) -> tuple:
    """The row-rule kernel ``target`` on ``tables`` (values, then the state), in place."""
    _register()
    out = jax.ShapeDtypeStruct(tables[0].shape, jnp.float32)
    n = rows.shape[0]
    # the kernel's workspaces as results XLA allocates, so that the step's temporaries
    # (the memory plan) count them: the distinct rows' summed gradients, two int32 lists
    work = (jax.ShapeDtypeStruct((n, tables[0].shape[1]), jnp.float32),
            jax.ShapeDtypeStruct((2 * n,), jnp.int32))
    t = len(tables)
    return tuple(jax.ffi.ffi_call(
        target, (out,) * t + work, input_output_aliases={a: a for a in range(t)})(
            *tables, rows.astype(jnp.int32), rep.astype(jnp.int32),
            segments.astype(jnp.int32), grads.astype(jnp.float32),
            params.astype(jnp.float32)))[:t]


ONE_STATE_RULES = ("AdaGrad", "MomentumSGD", "Nesterov")  # the kernel's rule codes


def one_state_rows(values: jax.Array, state: jax.Array, rows: jax.Array, rep: jax.Array,
                   segments: jax.Array, grads: jax.Array,
                   params: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(values, state) after AdaGrad, MomentumSGD or Nesterov on the distinct rows of a bag,
    their gradients summed as :func:`adam_rows` sums them; ``params`` float32 [4]: lr,
    epsilon, momentum factor, the rule's place in :data:`ONE_STATE_RULES`. What
    :func:`jctr.embedding.row_optimizers.apply_rows` gives, to a rounding where XLA fuses a
    multiply-add and the kernel does not or the other way round, without its [n, dim]
    arrays. In place when the tables can be donated. CPU only.

    Example::

        params = jnp.array([0.05, 1e-7, 0.0, ONE_STATE_RULES.index("AdaGrad")], jnp.float32)
        values, accum = one_state_rows(values, accum, rows, rep, segments, grads, params)
    """
    return _row_rule("jctr_cpu_one_state_rows", (values, state), rows, rep, segments, grads,
                     params)


EVICTION_POLICIES = ("lru", "lfu", "epoch_lru", "epoch_lfu")  # the kernel's policy codes


def evict(slot_keys, slot_rows, score, keys, slots, needy, clock, rows, rep, *, policy: str,
          epoch_steps: int, samples: int):
    """:func:`jctr.embedding.hash_table._evict`'s choice of keys for the ``needy`` positions
    in chunks of one key (each claims in turn), in one native pass with the XLA
    formulation's choices for ``chunk=1`` (``score``: the keys' scores beside their slots,
    with this step's keys stamped), then its tombstones for keys left without a row and
    every position's slot and row after it (``rows``: the lookup's, ``rep``: each
    position's representative, -1: itself). Returns (slot_keys, slot_rows, score, placed,
    gone keys, each position's slot after it, each position's row after it, [tombstones
    made, keys placed]); the buffers are updated in place when they can be donated. CPU
    only."""
    _register()
    n = slots.shape[0]
    if policy == "score":  # ranks as lfu: its second column holds the caller's scores
        policy = "lfu"
    params = jnp.stack([clock.astype(jnp.int64), jnp.int64(EVICTION_POLICIES.index(policy)),
                        jnp.int64(epoch_steps), jnp.int64(samples),
                        jnp.int64(UNPASSED_REACH)])
    return jax.ffi.ffi_call(
        "jctr_cpu_evict",
        (jax.ShapeDtypeStruct(slot_keys.shape, jnp.int64),
         jax.ShapeDtypeStruct(slot_rows.shape, jnp.int32),
         jax.ShapeDtypeStruct(score.shape, jnp.int32),
         jax.ShapeDtypeStruct((n,), jnp.bool_), jax.ShapeDtypeStruct((n,), jnp.int64),
         jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32),
         jax.ShapeDtypeStruct((2,), jnp.int32)),
        input_output_aliases={0: 0, 1: 1, 2: 2})(
            slot_keys, slot_rows, score, keys.astype(jnp.int64), slots.astype(jnp.int32),
            needy.astype(jnp.bool_), params, rows.astype(jnp.int32), rep.astype(jnp.int32))


def rebuild_slots(slot_keys, slot_rows, score):
    """:func:`jctr.embedding.hash_table.rebuild_slots`'s (slot_keys, slot_rows, score) in one
    native sweep over the slots, in place when the buffers can be donated (the slots the
    native batch insert of the keys in :func:`jctr.ops.hashing.rebuild_start`'s order gives).
    CPU only."""
    _register()
    return jax.ffi.ffi_call(
        "jctr_cpu_rebuild_slots",
        (jax.ShapeDtypeStruct(slot_keys.shape, jnp.int64),
         jax.ShapeDtypeStruct(slot_rows.shape, jnp.int32),
         jax.ShapeDtypeStruct(score.shape, jnp.int32)),
        input_output_aliases={0: 0, 1: 1, 2: 2})(slot_keys, slot_rows, score)


def pair_dots_supported(feats: jax.Array) -> bool:
    """Whether :func:`pair_dots` takes these features: native kernels built, float32 or
    bfloat16 (the kernels compute in float32: float64 keeps the XLA formulation), a non-empty
    batch of at least two features, and a width that is a multiple of 16."""
    b, f, dim = feats.shape
    return (AVAILABLE and feats.dtype in (jnp.float32, jnp.bfloat16) and b > 0 and f >= 2
            and dim > 0 and dim % 16 == 0)


def pair_dots(feats: jax.Array) -> jax.Array:
    """[b, f, d] -> [b, f(f-1)/2] float32: ``feats[s, i] . feats[s, j]`` for every ``j < i``,
    in row order (the values of ``jctr.ops.interaction.pair_dots_xla``), differentiable. ``d``
    must be a multiple of 16 (:func:`pair_dots_supported`); products are float32 whatever the
    input dtype. Forward and backward are one kernel call each, their samples split over the
    helper threads of :mod:`jctr.ops.cpu_parts`. CPU only.

    Example::

        if cpu_ffi.pair_dots_supported(feats):
            dots = cpu_ffi.pair_dots(feats)
    """
    _register()
    return _pair_dots(feats.astype(jnp.float32))


@jax.custom_vjp
def _pair_dots(feats):
    return _pair_dots_forward(feats)[0]


def _pair_dots_forward(feats):
    b, f, _ = feats.shape
    return jax.ffi.ffi_call("jctr_cpu_pair_dots",
                            jax.ShapeDtypeStruct((b, f * (f - 1) // 2), jnp.float32))(feats), feats


def _pair_dots_backward(feats, grad):
    return (jax.ffi.ffi_call("jctr_cpu_pair_dots_grad",
                             jax.ShapeDtypeStruct(feats.shape, jnp.float32))(
        feats, grad.astype(jnp.float32)),)


_pair_dots.defvjp(_pair_dots_forward, _pair_dots_backward)
