"""Native CPU kernels (``jctr.ops.cpu_ffi``): the FFI plumbing, the CPU dispatch and the
interaction kernels against the reference. The hash lookup's and insert's results against the
jnp references are checked in test_pallas_kernels.py."""

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jctr.ops import cpu_ffi, dot_interaction, find_slots
from jctr.ops.hashing import EMPTY_KEY
from jctr.ops.hashing import find_slots as reference_find_slots
from jctr.ops.interaction import dot_interaction_reference, pair_dots_xla


def _table(n_keys=40, num_slots=128, key_range=10**12):
    keys = np.random.default_rng(0).choice(key_range, n_keys, replace=False).astype(np.int64)
    table, _ = reference_find_slots(jnp.full((num_slots,), EMPTY_KEY), jnp.asarray(keys),
                                    jnp.ones(n_keys, bool), insert=True)
    return table, keys


def test_the_native_kernels_build_where_numba_is_installed():
    """numba is a declared dependency, so every handler must compile: a kernel numba refuses
    turns them all off with a warning and the XLA formulations run (tests that compare the
    two would then compare XLA with itself). Checked in a fresh process, whose import
    compiles them (or loads numba's cache)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c",
                           "import jctr.ops.cpu_ffi as c; assert c.AVAILABLE"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("n", [0, 1, 7, 50])
def test_lookup_slots_of_any_batch(n):
    table, stored = _table(key_range=2**31)  # fits int32: the kernel must take int32 keys too
    rng = np.random.default_rng(n)
    queries = np.where(rng.random(n) < 0.5, rng.choice(stored, n), rng.integers(-5, 5, n))
    valid = rng.random(n) < 0.8
    key_dtype = jnp.int32 if n % 2 else jnp.int64
    got = cpu_ffi.lookup_slots(table, jnp.asarray(queries, key_dtype), jnp.asarray(valid))
    _, want = reference_find_slots(table, jnp.asarray(queries, jnp.int64), jnp.asarray(valid),
                                   insert=False)
    assert got.shape == (n,) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_cpu_steps_call_the_native_lookup():
    table, stored = _table()
    keys, valid = jnp.asarray(stored), jnp.ones(stored.shape, bool)
    for insert in (False, True):
        text = jax.jit(lambda t, k, v, i=insert: find_slots(t, k, v, insert=i)).lower(
            table, keys, valid).as_text()
        assert "jctr_cpu_hash_lookup" in text


def test_without_numba_the_xla_formulation_runs(monkeypatch):
    table, stored = _table()
    keys = jnp.asarray(np.concatenate([stored, stored + 1]))
    valid = jnp.ones(keys.shape, bool)
    monkeypatch.setattr(cpu_ffi, "AVAILABLE", False)
    fn = jax.jit(lambda t, k, v: find_slots(t, k, v, insert=True))
    assert "jctr_cpu_hash_lookup" not in fn.lower(table, keys, valid).as_text()
    got_table, got = fn(table, keys, valid)
    want_table, want = reference_find_slots(table, keys, valid, insert=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_table), np.asarray(want_table))


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major", ctypes.c_int), ("minor", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion),
                ("traits", ctypes.c_uint32)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                ("next", ctypes.c_void_p), ("metadata", ctypes.POINTER(_Metadata))]


class _Api(ctypes.Structure):  # the leading fields of XLA_FFI_Api
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api_version", _ApiVersion)]


class _CallFrame(ctypes.Structure):  # the leading fields of XLA_FFI_CallFrame
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api", ctypes.POINTER(_Api)), ("ctx", ctypes.c_void_p),
                ("stage", ctypes.c_int), ("rest", ctypes.c_int64 * 16)]


@pytest.mark.parametrize("handler", ["_hash_lookup_handler", "_pair_dots_handler",
                                     "_pair_dots_grad_handler"])
def test_handler_answers_the_metadata_query(handler):
    """XLA may call a handler with only a metadata extension to learn its API version: the
    handler reports the caller's version, touches no buffer and returns success (NULL)."""
    api = _Api(ctypes.sizeof(_Api), None, _ApiVersion(ctypes.sizeof(_ApiVersion), None, 0, 9))
    metadata = _Metadata(ctypes.sizeof(_Metadata), _ApiVersion(), 123)
    extension = _MetadataExtension(ctypes.sizeof(_MetadataExtension), 1, None,
                                   ctypes.pointer(metadata))
    frame = _CallFrame(ctypes.sizeof(_CallFrame), ctypes.addressof(extension),
                       ctypes.pointer(api), None, 0)  # no args: reading one would crash
    handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
        getattr(cpu_ffi, handler).address)
    assert handler(ctypes.addressof(frame)) is None
    assert (metadata.api_version.major, metadata.api_version.minor) == (0, 9)
    assert metadata.traits == 0


def _pair_dots_reference(feats):
    b, f, _ = feats.shape
    gram = np.einsum("bfd,bgd->bfg", feats.astype(np.float64), feats.astype(np.float64))
    li, lj = np.tril_indices(f, k=-1)
    return gram[:, li, lj]


@pytest.mark.parametrize("b,f,dim", [(1, 2, 16), (5, 27, 16), (7, 27, 32), (4, 16, 16),
                                     (3, 17, 16), (6, 40, 48)])
def test_pair_dots_and_gradient_match_the_reference(b, f, dim):
    """Feature counts below, at and above one vector (16), several vectors of width: the
    values and the gradient of a random weighting (batches of several parts:
    ``tests/test_cpu_parts.py``)."""
    rng = np.random.default_rng(b * f + dim)
    feats = rng.normal(size=(b, f, dim)).astype(np.float32)
    weights = rng.normal(size=(b, f * (f - 1) // 2)).astype(np.float32)
    assert cpu_ffi.pair_dots_supported(jnp.asarray(feats))
    got = cpu_ffi.pair_dots(jnp.asarray(feats))
    assert got.shape == (b, f * (f - 1) // 2) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), _pair_dots_reference(feats), rtol=1e-5,
                               atol=1e-5)
    grad = jax.grad(lambda x: jnp.sum(cpu_ffi.pair_dots(x) * weights))(jnp.asarray(feats))
    want = jax.grad(lambda x: jnp.sum(pair_dots_xla(x) * weights))(jnp.asarray(feats))
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_pair_dots_of_bfloat16_features_give_bfloat16_gradients():
    feats = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 16)), jnp.bfloat16)
    got = cpu_ffi.pair_dots(feats)
    np.testing.assert_allclose(np.asarray(got),
                               _pair_dots_reference(np.asarray(feats, np.float32)), rtol=1e-5)
    grad = jax.grad(lambda x: jnp.sum(cpu_ffi.pair_dots(x)))(feats)
    assert grad.dtype == jnp.bfloat16


@pytest.mark.parametrize("dim,native", [(16, True), (32, True), (8, False), (24, False)])
def test_cpu_interaction_calls_the_native_kernel_for_multiples_of_16(dim, native):
    dense, sparse = jnp.ones((4, dim), jnp.float32), jnp.ones((4, 3, dim), jnp.float32)
    fn = jax.jit(jax.grad(lambda d, s: jnp.sum(dot_interaction(d, s)), argnums=(0, 1)))
    text = fn.lower(dense, sparse).as_text()
    assert ("jctr_cpu_pair_dots" in text) == native
    assert ("jctr_cpu_pair_dots_grad" in text) == native
    rng = np.random.default_rng(dim)
    dense = jnp.asarray(rng.normal(size=(4, dim)), jnp.float32)
    sparse = jnp.asarray(rng.normal(size=(4, 3, dim)), jnp.float32)
    np.testing.assert_allclose(np.asarray(dot_interaction(dense, sparse)),
                               np.asarray(dot_interaction_reference(dense, sparse)),
                               rtol=1e-5, atol=1e-5)


def test_interaction_without_numba_runs_xla(monkeypatch):
    monkeypatch.setattr(cpu_ffi, "AVAILABLE", False)
    # shapes no other test traces: jax caches the traced branch per function and shapes
    dense, sparse = jnp.ones((5, 16), jnp.float32), jnp.ones((5, 6, 16), jnp.float32)
    assert "jctr_cpu_pair_dots" not in jax.jit(dot_interaction).lower(dense, sparse).as_text()


@pytest.mark.parametrize("free,dedupe", [(0, True), (5, True), (5, False)])
def test_find_assign_equals_a_first_occurrence_model(free, dedupe):
    """``jctr_cpu_find_assign`` (a training lookup in one native pass) against a dictionary
    model of its contract, over batches with repeats, invalid positions and more new keys
    than rows: a key keeps its slot and row; a slot's first position is its representative;
    new keys take rows in order of first occurrence, the free stack's top first, then rows
    never handed out below the capacity; the others are refused (row -1); the counters move
    as the reference formulation (:func:`jctr.ops.hashing.assign_rows`) moves them. Without
    ``dedupe`` (plain SGD: the caller drops every representative) a position whose key has a
    row by the time it is reached gets none (-1), and neither it nor a new key that takes a row
    touches its slot's scratch (a line the kernel does not fetch ahead); only new keys met
    once the rows have run out need it, to find their first position."""
    from jctr.ops import hashing

    capacity, num_slots = 60, 96
    rng = np.random.default_rng(free)
    slot_keys = jnp.full((num_slots,), EMPTY_KEY)
    slot_rows = jnp.full((num_slots,), -1, jnp.int32)
    scratch = jnp.zeros((num_slots,), jnp.int32)
    free_rows = jnp.zeros((capacity,), jnp.int32).at[:free].set(
        jnp.arange(free, dtype=jnp.int32) * 3)  # rows 0, 3, 6, ... freed earlier
    size, free_count = jnp.int32(40 if free else 0), jnp.int32(free)
    model, next_free, next_new = {}, free - 1, int(size)
    fused = jax.jit(cpu_ffi.find_assign, static_argnums=(8, 9))
    for step in range(4):
        keys = rng.integers(0, 45, 30).astype(np.int64) * 7919
        valid = rng.random(30) < 0.9
        scratch_before = np.asarray(scratch)
        (slot_keys, slots, slot_rows, scratch, rows, rep, new, granted, size2,
         free2, counts) = fused(slot_keys, slot_rows, scratch, free_rows, size, free_count,
                                jnp.asarray(keys), jnp.asarray(valid), capacity, dedupe)
        if not dedupe:
            refused = np.asarray(slots)[np.asarray(new) & ~np.asarray(granted)]
            untouched = np.ones(num_slots, bool)
            untouched[refused] = False
            assert (np.asarray(scratch)[untouched] == scratch_before[untouched]).all(), step
        slots, rows, rep = np.asarray(slots), np.asarray(rows), np.asarray(rep)
        first, held = {}, set(model)  # keys with a row before this batch
        for i, (k, v) in enumerate(zip(keys.tolist(), valid)):
            if not v:
                assert slots[i] == rows[i] == rep[i] == -1
                continue
            assert np.asarray(slot_keys)[slots[i]] == k
            first.setdefault(k, i)
            if k not in model and first[k] == i:  # a new key, in order of first occurrence
                if next_free >= 0:
                    model[k] = int(free_rows[next_free])
                    next_free -= 1
                elif next_new < capacity:
                    model[k] = next_new
                    next_new += 1
                else:
                    model[k] = -1
            assert rows[i] == model[k], (step, i)
            # without dedupe a position whose key has a row by then gets none
            has_row = k in held or (model[k] >= 0 and first[k] < i)
            assert rep[i] == (first[k] if dedupe or not has_row else -1), (step, i)
        assert np.asarray(granted).sum() == sum(
            1 for i, k in enumerate(keys.tolist()) if valid[i] and first.get(k) == i
            and np.asarray(new)[i] and model[k] >= 0)
        # the counters as the reference formulation moves them
        ref = hashing.assign_rows(jnp.full((num_slots,), -1, jnp.int32), scratch, free_rows,
                                  size, free_count, jnp.asarray(np.where(np.asarray(new), slots,
                                                                         -1)), capacity)
        assert (int(size2), int(free2)) == (int(ref[6]), int(ref[7]))
        # the batch's counts come with it: new keys, those granted a row, keys with no slot
        assert np.asarray(counts).tolist() == [int(np.asarray(new).sum()),
                                               int(np.asarray(granted).sum()),
                                               int((valid & (slots < 0)).sum())]
        model = {k: r for k, r in model.items() if r >= 0}  # refused keys try again later
        size, free_count = size2, free2


@pytest.mark.parametrize("capacity,num_slots,n,distinct", [
    (200, 320, 40, 90), (60, 320, 40, 90),
    # batches of parts (jctr_cpu_find_assign finds the held keys on every thread, then
    # the rest in batch order): rows for all, rows running out mid-batch (refused keys then
    # hold slots without a row, found by the parts and left to the pass), and slots not in
    # buckets of eight
    (60_000, 1 << 17, 40_000, 70_000), (30_000, 1 << 16, 40_000, 60_000),
    (50_000, 100_003, 40_000, 70_000)])
def test_a_lean_find_assign_gives_what_the_full_one_gives(capacity, num_slots, n, distinct,
                                                          monkeypatch):
    """``find_assign(..., lean=True)`` (a table that does not evict, without dedupe: its
    caller reads no slots, representatives or new keys' positions) writes none of them and
    gives the same table, rows, grants and counts as the pass that writes them, batch after
    batch: with rows left for every position (``capacity`` 200: nothing written) and with
    rows running out (60: the first positions of new keys found through the scratch, the
    slots kept inside the pass). Batches of more than one part (``n`` 40,000) take the lean
    kernel's split: the keys holding a row found in parts on every thread (a key with a row
    writes nothing in the one pass), then the other positions in batch order; the same
    bits, tombstones in the slots and keys in slots without a row included."""
    from jctr.embedding.hash_table import TOMBSTONE

    rng = np.random.default_rng(capacity)
    state = [jnp.full((num_slots,), EMPTY_KEY), jnp.full((num_slots,), -1, jnp.int32),
             jnp.zeros((num_slots,), jnp.int32)]
    free_rows = jnp.zeros((capacity,), jnp.int32).at[:4].set(jnp.array([7, 3, 11, 5], jnp.int32))
    size, free_count = jnp.int32(20), jnp.int32(4)
    full = jax.jit(cpu_ffi.find_assign, static_argnums=(8, 9, 10))
    rows = None
    for step in range(7):
        if step < 6:
            keys = jnp.asarray(rng.integers(0, distinct, n).astype(np.int64) * 7919)
            valid = jnp.asarray(rng.random(n) < 0.9)
        else:  # the last batch's keys that got rows: every position found (none left over)
            valid = valid & (rows >= 0)
        if step == 3 and n > 1000:  # some slots erased (their keys' rows stay unused)
            held = np.flatnonzero(np.asarray(state[0]) != EMPTY_KEY)
            state[0] = state[0].at[rng.choice(held, 500, replace=False)].set(TOMBSTONE)
        args = (*state, free_rows, size, free_count, keys, valid, capacity, False)
        a = full(*args, False)
        b = full(*[jnp.array(x) if isinstance(x, jax.Array) else x for x in args], True)
        assert b[1] is None and b[5] is None and b[6] is None
        for i in (0, 2, 3, 4, 7, 8, 9, 10):
            np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b[i]), err_msg=(step, i))
        if step == 6:
            assert np.asarray(b[10]).tolist() == [0, 0, 0]
        state, rows = [a[0], a[2], a[3]], a[4]
        size, free_count = a[8], a[9]
    if capacity == 60:  # the rows ran out (after a first batch with enough of them)
        assert (int(size), int(free_count)) == (capacity, 0)
    # the reference formulation gives the same Nones (a caller reading one fails there too)
    from jctr.ops import dispatch

    monkeypatch.setenv("JCTR_KERNELS", "reference")
    out = dispatch.find_and_assign(*state, free_rows, size, free_count, keys, valid,
                                   capacity, dedupe=False, lean=True)
    assert out[1] is None and out[5] is None and out[6] is None
    assert len(out) == 11


def test_bucket_probes_of_a_crowded_table_with_tombstones_and_wrapping():
    """The native probes compare a bucket of eight slots at once: on a table of buckets 90%
    full, with tombstones (passed over; an insert takes an empty slot) and keys whose probe
    wraps from the last bucket to the first, lookups give the reference's slots
    (jctr.ops.hashing.find_slots) and inserts place every key where the reference lookup
    then finds it."""
    from jctr.embedding.hash_table import TOMBSTONE
    from jctr.ops.hashing import home_slots

    num_slots = 64  # eight buckets
    rng = np.random.default_rng(7)
    pool = rng.choice(10**12, 4000, replace=False).astype(np.int64)
    homes = np.asarray(home_slots(jnp.asarray(pool), num_slots))
    last = pool[homes == num_slots - 8][:12]  # twelve keys for the last bucket: they wrap
    others = pool[homes != num_slots - 8][:46]
    stored = np.concatenate([last, others])
    table, slots = reference_find_slots(jnp.full((num_slots,), EMPTY_KEY), jnp.asarray(stored),
                                        jnp.ones(stored.size, bool), insert=True)
    slots = np.asarray(slots)
    assert (slots >= 0).all() and (slots[:12] < 8).any()  # some wrapped to the first bucket
    gone = rng.choice(stored.size, 9, replace=False)  # erased: tombstones in their slots
    table = table.at[slots[gone]].set(TOMBSTONE)
    queries = np.concatenate([stored, pool[-30:]])  # held, erased and never-seen keys
    valid = jnp.ones(queries.size, bool)
    got = np.asarray(cpu_ffi.lookup_slots(table, jnp.asarray(queries), valid))
    _, want = reference_find_slots(table, jnp.asarray(queries), valid, insert=False)
    np.testing.assert_array_equal(got, np.asarray(want))
    assert (got[gone] == -1).all() and (got[np.setdiff1d(np.arange(stored.size), gone)] >= 0
                                        ).all()
    new = pool[-5:]  # five new keys fill the empty slots (tombstones are not reused)
    grown, placed = cpu_ffi.insert_slots(table, jnp.asarray(new), jnp.ones(5, bool))
    placed = np.asarray(placed)
    assert (placed >= 0).all() and (np.asarray(table)[placed] == EMPTY_KEY).all()
    _, found = reference_find_slots(grown, jnp.asarray(new), jnp.ones(5, bool), insert=False)
    np.testing.assert_array_equal(np.asarray(found), placed)


def _fresh_rows_case(rng, capacity: int, n: int, dim: int):
    """A table's rows and a batch for ``init_rows``: random vectors, no slots yet, keys, rows
    (a tenth -1, the others distinct), which positions are fresh, their slot ids."""
    rows = np.where(rng.random(n) < 0.1, -1, rng.permutation(capacity)[:n]).astype(np.int32)
    return (jnp.asarray(rng.random((capacity, dim), dtype=np.float32)),
            jnp.full(capacity, -1, jnp.int32),
            jnp.asarray(rng.integers(-(1 << 62), 1 << 62, n)), jnp.asarray(rows),
            jnp.asarray(rng.random(n) < 0.6),
            jnp.asarray(rng.integers(0, 26, n).astype(np.int32)))


@pytest.mark.parametrize("seed,zero_tail,per_column,dim", [
    (0, False, False, 16), (7, True, True, 16), (123456789, False, True, 32),
    (5, False, True, 12)])
def test_init_rows_writes_key_uniform_bit_for_bit(seed, zero_tail, per_column, dim):
    """``jctr_cpu_init_rows`` (the rows a training lookup created, in one native pass) writes
    what the XLA formulation writes: ``key_uniform`` of the key times the optimizer's scales
    (one bound, or SparseAdaGradSGDRule's per-part ranges), the admission's zeroed tail, and
    each row's slot; rows of other positions (and rows -1) untouched. Widths that are
    multiples of 16 take the kernel's 16-lane code (columns 16-31 included), 12 its scalar
    loop."""
    from jctr.ops.hashing import key_uniform

    rng = np.random.default_rng(seed)
    capacity, n = 500, 300
    values, row_slot, keys, rows, fresh, key_slots = _fresh_rows_case(rng, capacity, n, dim)
    scales = (jnp.linspace(0.01, 0.5, dim, dtype=jnp.float32) if per_column
              else np.float32(0.05))
    got, got_slots = jax.jit(lambda *a: cpu_ffi.init_rows(*a, scales, seed, zero_tail))(
        values, row_slot, keys, rows, fresh, key_slots)
    want_rows = key_uniform(keys, dim, seed, 1.0) * scales
    if zero_tail:
        want_rows = want_rows.at[:, 1:].set(0.0)
    at = jnp.where(fresh & (rows >= 0), rows, capacity)
    want = values.at[at].set(want_rows, mode="drop")
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(want).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(got_slots),
                                  np.asarray(row_slot.at[at].set(key_slots, mode="drop")))


def test_init_rows_takes_each_new_rows_slot_from_its_segment():
    """Given segments (sample * slot_num + slot) and ``slot_num``, ``init_rows`` records each
    fresh row's slot as the segment's remainder, as the XLA formulation's ``segments %
    slot_num`` of the whole batch does (the native pass computes it for the new rows only);
    the vectors are those it writes given the slots themselves."""
    rng = np.random.default_rng(11)
    capacity, n, dim, slot_num = 500, 300, 16, 26
    values, row_slot, keys, rows, fresh, _ = _fresh_rows_case(rng, capacity, n, dim)
    segments = jnp.asarray(rng.integers(0, 64 * slot_num, n).astype(np.int32))
    got = cpu_ffi.init_rows(values, row_slot, keys, rows, fresh, segments, np.float32(0.05),
                            3, False, slot_num=slot_num)
    want = cpu_ffi.init_rows(values, row_slot, keys, rows, fresh, segments % slot_num,
                             np.float32(0.05), 3, False)
    at = jnp.where(fresh & (rows >= 0), rows, capacity)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(
        row_slot.at[at].set(segments % slot_num, mode="drop")))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_init_rows_resets_the_optimizer_rows_of_fresh_rows_in_the_same_pass():
    """An evicting table's fresh rows held another key's optimizer state: ``init_rows`` sets
    those rows of each array it is given (float32 rows of 16, 32 and 2, an int32 column) to
    the array's fill row in its one pass, as the XLA scatters do; other rows untouched, the
    vectors and slots as without them. Rows of whole 64-byte lines (16 and 32 floats) are
    written with non-temporal stores, a fill row of 32 distinct words included."""
    rng = np.random.default_rng(4)
    capacity, n, dim = 400, 250, 16
    values, row_slot, keys, rows, fresh, key_slots = _fresh_rows_case(rng, capacity, n, dim)
    arrays = (jnp.asarray(rng.random((capacity, dim), dtype=np.float32)),
              jnp.asarray(rng.random((capacity, 32), dtype=np.float32)),
              jnp.asarray(rng.random((capacity, 2), dtype=np.float32)),
              jnp.asarray(rng.integers(1, 9, capacity).astype(np.int32)))
    fills = (np.zeros(dim, np.float32), np.linspace(-1, 1, 32, dtype=np.float32),
             np.array([0.1, 0.25], np.float32), np.array([0], np.int32))
    call = jax.jit(lambda v, s, k, r, f, ks, *a: cpu_ffi.init_rows(
        v, s, k, r, f, ks, np.float32(0.05), 3, False, tuple(zip(a, fills))))
    got = call(values, row_slot, keys, rows, fresh, key_slots, *arrays)
    plain = cpu_ffi.init_rows(values, row_slot, keys, rows, fresh, key_slots,
                              np.float32(0.05), 3, False)
    assert len(got) == 6
    for a, b in zip(got[:2], plain):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    at = jnp.where(fresh & (rows >= 0), rows, capacity)
    for arr, fill, out in zip(arrays, fills, got[2:]):
        want = arr.at[at].set(jnp.broadcast_to(fill.reshape(arr.shape[1:]) if arr.ndim == 2
                                               else fill[0], at.shape + arr.shape[1:]),
                              mode="drop")
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize("optimizer", [
    {"type": "SparseAdaGradSGDRule", "embedx_threshold": 2.0}, {"type": "SGD"}])
def test_a_training_lookup_on_cpu_equals_the_reference_formulation(monkeypatch, optimizer):
    """A CPU training lookup (native find-and-assign, native initial rows) leaves the table
    the jnp references leave (``JCTR_KERNELS=reference``), over batches of new and known keys
    with repeats, bit for bit: every key at the same row (new keys take rows in order of first
    occurrence in both: :func:`jctr.ops.hashing.representatives` takes the first position of a
    slot, as the native kernel does, whatever order a platform's scatter writes in) with the
    same vector, slot id and optimizer state."""
    from jctr.config.schema import OptimizerConfig
    from jctr.embedding.hash_table import export_items
    from jctr.embedding.sparse_embedding import EmbeddingSpec, init_embedding, lookup_keys

    spec = EmbeddingSpec("t", capacity=3000, dim=8, slot_num=2, max_features=2,
                         one_hot=False, input_index=0,
                         optimizer=OptimizerConfig(**optimizer))
    rng = np.random.default_rng(5)
    feed = [rng.integers(0, 2500, 1000) * 977 for _ in range(4)]

    def run():
        # a key's slot id follows from the key (which of a key's positions creates its row
        # may differ)
        step = jax.jit(lambda s, k: lookup_keys(spec, s, k, jnp.ones(k.shape, bool),
                                                (k % 2).astype(jnp.int32), train=True))
        state = init_embedding(spec)
        text = step.lower(state, jnp.asarray(feed[0])).as_text()
        for keys in feed:
            state, _ = step(state, jnp.asarray(keys))
        return state, "jctr_cpu_init_rows" in text

    native, called = run()
    assert called
    monkeypatch.setenv("JCTR_KERNELS", "reference")
    reference, called = run()
    assert not called
    # per key (which slot a new key gets may differ: the reference claims slots in rounds):
    # its row, its vector, its slot id and its optimizer state
    keys, rows = export_items(native.table)
    want_keys, want_rows = export_items(reference.table)
    assert keys.size == want_keys.size == int(reference.table.size) > 1000
    order, want_order = np.argsort(keys), np.argsort(want_keys)
    np.testing.assert_array_equal(keys[order], want_keys[want_order])
    rows, want_rows = rows[order], want_rows[want_order]
    np.testing.assert_array_equal(rows, want_rows)
    for got, want in [(native.values, reference.values), (native.row_slot, reference.row_slot),
                      *zip(native.slots.values(), reference.slots.values())]:
        got, want = np.asarray(got)[rows], np.asarray(want)[want_rows]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dim,combiner", [(16, "sum"), (32, "mean"), (8, "sum"), (12, "mean")])
def test_native_bag_forward_equals_the_reference_and_its_gradient(dim, combiner):
    """The CPU embedding bag (``jctr_cpu_bag_sum``: one pass, rows summed per segment without
    the gathered [n, dim] rows; 16-float vectors where the width allows) against
    ``embedding_bag_forward_reference``: rows -1 and segment ids past the last add nothing,
    empty segments are zeros, ``mean`` divides by the positions of the segment; the gradient
    through it (autodiff of a notebook model) is the reference's."""
    from jctr.ops import embedding_bag_forward
    from jctr.ops.bag import embedding_bag_forward_reference

    rng = np.random.default_rng(dim)
    capacity, n, segments = 300, 2000, 250
    values = jnp.asarray(rng.normal(size=(capacity, dim)).astype(np.float32))
    rows = jnp.asarray(np.where(rng.random(n) < 0.1, -1, rng.integers(0, capacity, n))
                       .astype(np.int32))
    segs = jnp.asarray(np.sort(rng.integers(0, segments + 10, n)).astype(np.int32))
    native = jax.jit(lambda v, r, s: embedding_bag_forward(v, r, s, segments, combiner))
    assert "jctr_cpu_bag_sum" in native.lower(values, rows, segs).as_text()
    want = embedding_bag_forward_reference(values, rows, segs, segments, combiner)
    np.testing.assert_allclose(np.asarray(native(values, rows, segs)), np.asarray(want),
                               rtol=1e-5, atol=1e-5)

    def loss(fn):
        return lambda v: jnp.sum(jnp.sin(fn(v, rows, segs, segments, combiner)))

    np.testing.assert_allclose(
        np.asarray(jax.jit(jax.grad(loss(embedding_bag_forward)))(values)),
        np.asarray(jax.grad(loss(embedding_bag_forward_reference))(values)),
        rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim,combiner", [(16, "sum"), (16, "mean"), (12, "sum")])
def test_one_hot_pooling_takes_the_native_bag_and_gives_the_gathered_rows(dim, combiner):
    """A one-hot input's pooling (one key a slot: position ``i`` is segment ``i``, an empty
    slot's position the padding segment, as every reader lays it out) runs the native bag on
    CPU (its rows fetched ahead and in parts: XLA's gather, fused into the interaction's
    concatenation, waited for each row) and gives the gathered rows bit for bit, zeros for
    rows -1 and empty slots, under either combiner; its gradient is the gather's."""
    from jctr.ops import embedding_bag_forward
    from jctr.ops.bag import gather_rows

    rng = np.random.default_rng(dim)
    capacity, n = 500, 40_000  # several parts
    values = jnp.asarray(rng.normal(size=(capacity, dim)).astype(np.float32))
    empty = rng.random(n) < 0.05
    rows = jnp.asarray(np.where(empty | (rng.random(n) < 0.05), -1,
                                rng.integers(0, capacity, n)).astype(np.int32))
    segs = jnp.asarray(np.where(empty, n, np.arange(n)).astype(np.int32))
    pooled = jax.jit(lambda v, r, s: embedding_bag_forward(v, r, s, n, combiner,
                                                           one_hot=True))
    assert "jctr_cpu_bag_sum" in pooled.lower(values, rows, segs).as_text()
    np.testing.assert_array_equal(np.asarray(pooled(values, rows, segs)),
                                  np.asarray(gather_rows(values, rows)))

    def loss(fn):
        return lambda v: jnp.sum(jnp.sin(fn(v)))

    np.testing.assert_array_equal(
        np.asarray(jax.jit(jax.grad(loss(lambda v: pooled(v, rows, segs))))(values)),
        np.asarray(jax.grad(loss(lambda v: gather_rows(v, rows)))(values)))


@pytest.mark.parametrize("dim,combiner", [(16, "sum"), (16, "mean"), (12, "sum")])
def test_native_sgd_by_segment_equals_the_scatter_add_of_key_gradients(dim, combiner,
                                                                        monkeypatch):
    """Plain SGD on a bag's rows (``jctr_cpu_add_by_segment``: each key's row gets its
    segment's gradient times -lr, duplicates adding up in batch order, rows -1 or past the
    last and segments past the last skipped) is bit for bit XLA's scatter-add of the per-key
    gradients (``key_gradients``, ``mean`` dividing by the segment's positions), without
    them; the jnp reference (``JCTR_KERNELS=reference``) drops rows -1 too (the lookup's
    unknown keys reach both as -1)."""
    from jctr.ops import sgd_by_segment
    from jctr.ops.bag import key_gradients

    rng = np.random.default_rng(dim)
    capacity, n, segments = 400, 3000, 300
    values = jnp.asarray(rng.normal(size=(capacity, dim)).astype(np.float32))
    drop = rng.random(n)
    rows = jnp.asarray(np.where(drop < 0.1, capacity, np.where(drop < 0.2, -1, rng.integers(
        0, capacity, n))).astype(np.int32))  # duplicates, and dropped positions (-1 or past)
    segs = jnp.asarray(np.sort(rng.integers(0, segments + 5, n)).astype(np.int32))
    grad = jnp.asarray(rng.normal(size=(segments, dim)).astype(np.float32))
    lr = jnp.float32(0.1)
    native = jax.jit(lambda v, r, s, g: sgd_by_segment(v, r, s, g, -lr, segments, combiner))
    assert "jctr_cpu_add_by_segment" in native.lower(values, rows, segs, grad).as_text()
    want = values.at[jnp.where(rows >= 0, rows, capacity)].add(
        -lr * key_gradients(grad, segs, segments, combiner), mode="drop")
    np.testing.assert_array_equal(np.asarray(native(values, rows, segs, grad)).view(np.uint32),
                                  np.asarray(want).view(np.uint32))
    monkeypatch.setenv("JCTR_KERNELS", "reference")
    np.testing.assert_array_equal(
        np.asarray(sgd_by_segment(values, rows, segs, grad, -lr, segments, combiner)),
        np.asarray(want))


@functools.cache
def _vector_and_loop_choices():
    """A compiled function giving, for each bucket of eight slots, the vector choice and the
    slot loop's (8: none) side by side (compiled once for the tests below)."""
    import numba

    @numba.njit
    def both(rows, score, clock, policy, epoch_steps):
        got = np.empty((rows.shape[0] // 8, 2), np.int64)
        for b in range(rows.shape[0] // 8):
            w0 = 8 * b
            got[b, 0] = cpu_ffi._window_choice(rows.ctypes.data + 4 * w0,
                                               score.ctypes.data + 4 * score.shape[1] * w0,
                                               clock, policy, epoch_steps)
            best, best_rank = 8, np.iinfo(np.int64).max
            for k in range(8):
                if rows[w0 + k] < 0:
                    continue
                rank = cpu_ffi._rank(score, w0 + k, clock, policy, epoch_steps)
                if rank < best_rank:
                    best, best_rank = k, rank
            got[b, 1] = best
        return got

    return both


@pytest.mark.parametrize("policy,epoch_steps", [
    ("lru", 1), ("lfu", 1), ("epoch_lru", 1), ("epoch_lru", 3), ("epoch_lru", 1 << 28),
    ("epoch_lfu", 3), ("epoch_lfu", 1 << 28)])
def test_a_buckets_ranks_in_vector_registers_choose_as_the_slot_loop(policy, epoch_steps):
    """The eviction's choice among a bucket's eight slots in vector code
    (``cpu_ffi._window_choice``: ranks formed in lanes, a vector minimum, the first of equal
    ranks by a count of trailing zeros) takes the slot the slot loop over ``cpu_ffi._rank``
    takes, or none, over 20,000 buckets drawn to reach the edges: rowless slots and stamps
    equal to the clock (never chosen), buckets with nothing to take, many equal ranks, stamps
    and touch counts up to 2**31 - 1 (the clock's and the counts' ceilings), epochs of one
    step, three and 2**28."""
    code = cpu_ffi.EVICTION_POLICIES.index(policy)
    columns = 2 if policy.endswith("lfu") else 1
    rng = np.random.default_rng(code * 7 + epoch_steps % 5)
    buckets = 20_000
    top = np.iinfo(np.int32).max
    clock = np.int64(top - 1) if epoch_steps != 1 << 28 else np.int64(1000)
    rows = np.where(rng.random(buckets * 8) < 0.3, -1,
                    rng.integers(0, 10**6, buckets * 8)).astype(np.int32)
    score = np.empty((buckets * 8, columns), np.int32)
    few = rng.random(buckets) < 0.5  # half the buckets from a handful of values: ties
    narrow = np.repeat(few, 8)
    score[:, 0] = np.where(narrow, rng.integers(clock - 3, clock + 1, buckets * 8),
                           rng.integers(0, clock + 1, buckets * 8))
    if columns == 2:
        score[:, 1] = np.where(narrow, rng.integers(0, 3, buckets * 8),
                               rng.integers(0, top, buckets * 8, endpoint=True))
    score[rng.random(buckets * 8) < 0.2, 0] = clock  # this step's: never chosen
    got = _vector_and_loop_choices()(rows, score, clock, np.int64(code),
                                     np.int64(epoch_steps))
    np.testing.assert_array_equal(got[:, 0], got[:, 1])
    assert (got[:, 0] == 8).sum() > 50 and (got[:, 0] < 8).sum() > buckets // 2


def _bag_of_repeats(seed, n=5000, capacity=1000, num_segments=900, dim=16):
    """A batch's rows (some -1), segments in batch order (some past the last: padding),
    each position's representative (its row's first position, -1 without a row) and
    segment gradients (some -0.0), as a training lookup hands them to the row update."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, capacity, n).astype(np.int32)
    rows[rng.random(n) < 0.1] = -1
    segments = np.sort(rng.integers(0, num_segments + 3, n)).astype(np.int32)
    rep = np.full(n, -1, np.int32)
    first: dict[int, int] = {}
    for i, r in enumerate(rows):
        if r >= 0:
            rep[i] = first.setdefault(int(r), i)
    grads = rng.normal(size=(num_segments, dim)).astype(np.float32)
    grads[:5] = -0.0
    state = (rng.normal(size=(capacity, dim)).astype(np.float32),
             (0.1 * rng.normal(size=(capacity, dim))).astype(np.float32),
             (0.01 * rng.random((capacity, dim))).astype(np.float32))
    return rows, segments, rep, grads, state


def _rule_native_and_reference(opt, seed: int, combiner: str, dim: int):
    """(native tables, reference tables, tables before, the batch's rows) of one step of the
    optimizer ``opt`` (``Local``) on a bag: the values, then its state (Adam's m and v; an
    AdaGrad accumulator that is 0 on some rows)."""
    from jctr.embedding import row_optimizers as row_opt
    from jctr.ops import row_rule_by_segment
    from jctr.ops.bag import embedding_bag_backward_reference

    rows, segments, rep, grads, state = _bag_of_repeats(seed, dim=dim)
    names = row_opt.slot_names(opt)
    if opt.type != "Adam":  # one state: v's (non-negative) for AdaGrad's accumulator
        state = (state[0], state[2] if opt.type == "AdaGrad" else state[1])
        state[1][::7] = 0.0  # new rows' (AdaGrad's first step: the gradient's sign times lr)
    n, capacity, num_segments = rows.size, state[0].shape[0], grads.shape[0]
    lr, count = jnp.float32(0.01), jnp.int32(3 + 5 * seed)

    def reference(values, *states):
        g = embedding_bag_backward_reference(jnp.asarray(grads), jnp.asarray(segments),
                                             jnp.asarray(rep), num_segments, combiner)
        at = jnp.where(jnp.asarray(rep) == jnp.arange(n), jnp.asarray(rows), capacity)
        w, slots = row_opt.apply_rows(opt, values, dict(zip(names, states)), at, g, lr, count)
        return (w, *(slots[name] for name in names))

    def native(*tables):
        return row_rule_by_segment(opt.type, tables, jnp.asarray(rows), jnp.asarray(rep),
                                   jnp.asarray(segments), jnp.asarray(grads),
                                   row_opt.rule_params(opt, lr, count), num_segments,
                                   combiner, reference)

    return ([np.asarray(x) for x in jax.jit(native)(*state)],
            [np.asarray(x) for x in jax.jit(reference)(*state)], state, rows)


def _assert_rows_match(got, want, state, rows, names):
    """Native tables equal the reference's to a rounding (where one fuses a multiply-add and
    the other does not, and what that moves in a row); rows no position touches keep every
    bit, touched ones move."""
    touched = np.zeros(state[0].shape[0], bool)
    touched[rows[rows >= 0]] = True
    for name, a, b, before in zip(names, got, want, state):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(before).max())
        assert np.array_equal(a[~touched], before[~touched]), name
        assert not np.array_equal(a[touched], before[touched]), name


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_the_native_adam_step_of_a_bag_gives_the_reference_rows(combiner):
    """``jctr_cpu_adam_rows`` (:func:`jctr.ops.row_rule_by_segment` on CPU) against the jnp
    formulation it replaces: gradients summed at the representatives
    (``embedding_bag_backward_reference``), then ``row_optimizers.apply_rows``'s gathered
    Adam step (the HugeCTR rule, ``adam_update`` in HugeCTR's
    ``HugeCTR/src/optimizers/adam_optimizer.cu``, with bias-corrected moments). The row sums
    are exact (batch order from 0, as XLA's scatter-add); XLA's CPU code contracts the
    moments' ``b * m + (1 - b) * g`` into a fused multiply-add in most lanes but not all (an
    LLVM choice per lane), so the moments may differ in their last bit there, and the rows
    by as little; rows no position touches keep every bit."""
    from jctr.config.schema import OptimizerConfig

    for seed, dim in ((0, 16), (1, 32), (2, 24)):  # 24: the lane loop, not vector code
        got, want, state, rows = _rule_native_and_reference(
            OptimizerConfig("Adam", update_type="Local"), seed, combiner, dim)
        _assert_rows_match(got, want, state, rows, "wmv")


@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize("rule", ["AdaGrad", "MomentumSGD", "Nesterov"])
def test_the_native_one_state_step_of_a_bag_gives_the_reference_rows(rule, combiner):
    """``jctr_cpu_one_state_rows`` (:func:`jctr.ops.row_rule_by_segment` on CPU) against the
    jnp formulation it replaces, for the three rules with one state a row: AdaGrad as
    HugeCTR's ``opt_adagrad_kernel`` (HugeCTR/src/optimizers/sparse_optimizer.cu: ``accum +=
    g * g``, ``w -= lr * g / (sqrt(accum) + eps)``),
    MomentumSGD and Nesterov as ``row_optimizers._row_rule`` (``m = factor * m + g``, ``w -=
    lr * m``, Nesterov ``w -= lr * (g + factor * m)``: with a constant lr HugeCTR's
    ``opt_momentum_sgd_kernel`` / ``opt_nesterov_kernel``, whose state is ``-lr`` times this
    one). Sums exact; the state and the rows to a rounding where XLA fuses a multiply-add
    in a lane and the kernel does or not."""
    from jctr.config.schema import OptimizerConfig

    opt = OptimizerConfig(rule, update_type="Local", momentum_factor=0.9, epsilon=1e-7)
    for seed, dim in ((0, 16), (1, 32), (2, 24)):  # 24: the lane loop, not vector code
        got, want, state, rows = _rule_native_and_reference(opt, seed, combiner, dim)
        _assert_rows_match(got, want, state, rows, ("w", "state"))


@pytest.mark.parametrize("rule", ["Adam", "AdaGrad", "MomentumSGD", "Nesterov"])
def test_a_training_step_takes_the_native_row_update(rule):
    """A bag's Adam, AdaGrad, MomentumSGD or Nesterov step (``update_type: Local``) on CPU
    runs ``jctr_cpu_adam_rows`` / ``jctr_cpu_one_state_rows`` in place of XLA's scatters and
    gathers, its workspaces counted in the step's temporaries, and a training step of it
    gives the rows of the jnp path (JCTR_KERNELS=reference) to within a rounding of the
    state."""
    import os

    from jctr.config.schema import OptimizerConfig
    from jctr.embedding.row_optimizers import slot_names
    from jctr.embedding.sparse_embedding import (
        EmbeddingSpec,
        apply_gradients,
        init_embedding,
        lookup_rows,
    )

    opt = OptimizerConfig(rule, update_type="Local", momentum_factor=0.9)
    spec = EmbeddingSpec("t", capacity=4096, dim=16, slot_num=3, max_features=6,
                         one_hot=False, input_index=0, optimizer=opt)
    rng = np.random.default_rng(1)
    keys = jnp.asarray(rng.integers(0, 300, 4 * 6), jnp.int64)
    segments = jnp.asarray(np.repeat(np.arange(12), 2), jnp.int32)
    grad = jnp.asarray(rng.normal(size=(4, 3, 16)), jnp.float32)

    def step(state):
        state, lk = lookup_rows(spec, state, keys, segments, 4, train=True)
        return apply_gradients(spec, state, lk, segments, grad, jnp.float32(0.01),
                               jnp.int32(1))

    lowered = jax.jit(step).lower(init_embedding(spec))
    kernel = "jctr_cpu_adam_rows" if rule == "Adam" else "jctr_cpu_one_state_rows"
    assert kernel in lowered.as_text()
    # the kernel's workspaces are XLA's buffers: the step's temporaries (the memory plan)
    # hold the summed rows [positions, dim] and two int32 lists
    assert lowered.compile().memory_analysis().temp_size_in_bytes >= 24 * (16 + 2) * 4
    got = jax.jit(step)(init_embedding(spec))
    os.environ["JCTR_KERNELS"] = "reference"
    try:
        # a new function: jit's cache holds `step` traced with the kernel (the variable is
        # read when a step is traced)
        reference = jax.jit(lambda state: step(state))
        assert kernel not in reference.lower(init_embedding(spec)).as_text()
        want = reference(init_embedding(spec))
    finally:
        del os.environ["JCTR_KERNELS"]
    names = slot_names(opt)
    for a, b in ((got.values, want.values),
                 *((got.slots[name], want.slots[name]) for name in names)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max())
    assert np.asarray(got.slots[names[0]]).any()
