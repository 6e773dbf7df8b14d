"""Pallas kernels: interpret mode on CPU against the jnp references, and lowering for CUDA;
the native CPU kernels (``jctr.ops.cpu_ffi``) against the same references."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jctr.ops import (
    embedding_bag_backward,
    embedding_bag_forward,
    every_platform,
    interaction,
)
from jctr.ops.bag import (
    embedding_bag_backward_reference,
    embedding_bag_forward_reference,
)
from jctr.ops.pallas_bag import bag_backward, bag_forward
from tests.conftest import native_cpu_only

# On a GPU (scripts/gpu_check.sh) the Pallas kernels run compiled by Triton; on CPU in
# interpret mode. The native CPU kernels are tested on CPU only (``native_cpu_only``).
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


def _case(rng, n, cap, dim, num_segments, kind):
    if kind == "duplicates":
        rows = rng.integers(0, 3, n)
    elif kind == "empty_bags":
        rows = rng.integers(-1, cap, n)
    else:
        rows = rng.integers(-1, cap, n)
    segs = np.sort(rng.integers(0, num_segments + 1, n))  # num_segments = padding
    if kind == "empty_bags":
        segs = np.sort(rng.choice([0, num_segments - 1, num_segments], n))
    values = rng.normal(size=(cap, dim)).astype(np.float32)
    rep = np.full(n, -1)
    first = {}
    for i, r in enumerate(rows):  # test-side reference of "one position per distinct row"
        if r >= 0:
            rep[i] = first.setdefault(r, i)
    return (jnp.asarray(values), jnp.asarray(rows, jnp.int32), jnp.asarray(segs, jnp.int32),
            jnp.asarray(rep, jnp.int32))


@pytest.mark.parametrize("dim", [1, 16, 128, 5])
@pytest.mark.parametrize("kind", ["random", "duplicates", "empty_bags"])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_bag_kernels_match_reference(dim, kind, combiner):
    rng = np.random.default_rng(dim * 7 + len(kind))
    n, cap, s = 37, 11, 9
    values, rows, segs, rep = _case(rng, n, cap, dim, s, kind)
    got = bag_forward(values, rows, segs, num_segments=s, combiner=combiner, interpret=INTERPRET)
    want = embedding_bag_forward_reference(values, rows, segs, s, combiner)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    grad = jnp.asarray(rng.normal(size=(s, dim)), jnp.float32)
    got = bag_backward(grad, segs, rep, num_segments=s, combiner=combiner, interpret=INTERPRET)
    want = embedding_bag_backward_reference(grad, segs, rep, s, combiner)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_bag_backward_is_the_gradient_of_the_forward():
    rng = np.random.default_rng(3)
    values, rows, segs, rep = _case(rng, 29, 7, 4, 6, "random")
    # d/dvalues of sum(w * bag(values)) summed per row equals the backward at the reps
    w = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    for combiner in ("sum", "mean"):
        dense = jax.grad(lambda v, c=combiner: jnp.sum(w * embedding_bag_forward_reference(
            v, rows, segs, 6, c)))(values)
        per_rep = embedding_bag_backward(w, segs, rep, 6, combiner)
        r = np.asarray(rows)
        got = np.zeros_like(np.asarray(values))
        reps = np.asarray(rep) == np.arange(29)
        np.add.at(got, r[reps], np.asarray(per_rep)[reps])
        np.testing.assert_allclose(got, np.asarray(dense), rtol=1e-5, atol=1e-6)


def _lowered_for_cuda(fn, *args) -> str:
    with every_platform():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_bag_kernels_lower_to_triton_for_cuda():
    rng = np.random.default_rng(0)
    values, rows, segs, rep = _case(rng, 64, 16, 16, 8, "random")
    text = _lowered_for_cuda(lambda v, r, s: bag_forward(v, r, s, num_segments=8), values, rows,
                             segs)
    assert "__gpu$xla.gpu.triton" in text and "jctr_bag_forward" in text
    grad = jnp.ones((8, 16), jnp.float32)
    text = _lowered_for_cuda(lambda g, s, p: bag_backward(g, s, p, num_segments=8), grad, segs,
                             rep)
    assert "__gpu$xla.gpu.triton" in text and "jctr_bag_backward" in text


def test_dispatch_keeps_kernels_to_their_platform():
    """The dispatched bag is XLA's on CUDA (measured faster than the Pallas kernels on an
    H200) and the native one-pass kernel on CPU; the hash lookup is a Triton kernel in the
    CUDA lowering and none in the CPU lowering of the same traced function (so a kernel
    leaking into the other platform's branch would show)."""
    from jctr.ops import find_slots
    from jctr.ops.hashing import EMPTY_KEY

    rng = np.random.default_rng(1)
    values, rows, segs, rep = _case(rng, 64, 16, 16, 8, "random")
    table = (jnp.full((64,), EMPTY_KEY), jnp.arange(10, dtype=jnp.int64), jnp.ones(10, bool))
    with every_platform():
        traced = jax.jit(lambda v, r, s: embedding_bag_forward(v, r, s, 8)).trace(values, rows,
                                                                                   segs)
        assert "custom_call" not in traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "jctr_cpu_bag_sum" in traced.lower(lowering_platforms=("cpu",)).as_text()
        traced = jax.jit(lambda t, k, v: find_slots(t, k, v, insert=False)[1]).trace(*table)
        assert "jctr_hash_lookup" not in traced.lower(lowering_platforms=("cpu",)).as_text()
        assert "jctr_hash_lookup" in traced.lower(lowering_platforms=("cuda",)).as_text()
    # outside every_platform a CPU-only JAX traces the CPU's kernels alone (the GPU's
    # branches could never run there): even lowered for cuda the trace holds the CPU kernel
    if jax.default_backend() == "cpu":
        traced = jax.jit(lambda t, k, v: find_slots(t, k, v, insert=False)[1]).trace(*table)
        assert "jctr_cpu_hash_lookup" in traced.lower().as_text()
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "jctr_cpu_hash_lookup" in text and "jctr_hash_lookup" not in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("slots,dim", [(26, 16), (3, 1), (5, 128), (8, 7)])
def test_interaction_kernels_match_reference(dtype, slots, dim):
    from jctr.ops.interaction import dot_interaction_reference
    from jctr.ops.pallas_interaction import make_pair_dots

    rng = np.random.default_rng(slots + dim)
    b = 5
    dense = jnp.asarray(rng.normal(size=(b, dim)), dtype)
    sparse = jnp.asarray(rng.normal(size=(b, slots, dim)), dtype)
    feats = jnp.concatenate([dense[:, None], sparse], axis=1)
    pair_dots = make_pair_dots(interpret=INTERPRET)
    want = dot_interaction_reference(dense.astype(jnp.float32), sparse.astype(jnp.float32))
    want = np.asarray(want[:, dim:-1])
    np.testing.assert_allclose(np.asarray(pair_dots(feats)), want, rtol=1e-5, atol=1e-4)
    w = jnp.asarray(rng.normal(size=want.shape), jnp.float32)
    got = jax.grad(lambda x: jnp.sum(pair_dots(x) * w))(feats)

    def ref_loss(x):
        x = x.astype(jnp.float32)
        return jnp.sum(dot_interaction_reference(x[:, 0], x[:, 1:])[:, dim:-1] * w)

    ref = jax.grad(ref_loss)(feats)
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol * 10)


def test_interaction_kernels_lower_to_triton_for_cuda():
    from jctr.ops import dot_interaction

    dense = jnp.ones((4, 16), jnp.float32)
    sparse = jnp.ones((4, 26, 16), jnp.float32)
    fwd = _lowered_for_cuda(dot_interaction, dense, sparse)
    assert "__gpu$xla.gpu.triton" in fwd and "jctr_interaction_fwd" in fwd
    w = jnp.ones((4, 16 + 351 + 1), jnp.float32)
    bwd = _lowered_for_cuda(jax.grad(lambda d, s: jnp.sum(dot_interaction(d, s) * w),
                                     argnums=(0, 1)), dense, sparse)
    assert "jctr_interaction_bwd" in bwd
    # the step's precision reaches the Triton dots (Pallas' own default would be TF32 whatever
    # jax.default_matmul_precision says; jctr runs float32 in full unless the config sets
    # HugeCTR's enable_tf32_compute). The numerics are checked on a GPU (gpu_check.sh).
    texts = {}
    for precision in ("float32", "tensorfloat32"):
        with jax.default_matmul_precision(precision):
            texts[precision] = _lowered_for_cuda(dot_interaction, dense, sparse)
    assert texts["float32"] != texts["tensorfloat32"]


def _lookup_impl(impl):
    from jctr.ops.pallas_hash import lookup_slots_kernel

    if impl == "pallas":
        return lambda t, k, v: lookup_slots_kernel(t, k, v, interpret=INTERPRET)
    if impl == "dispatch":  # what a step runs (jctr.ops.find_slots)
        from jctr.ops import find_slots

        return jax.jit(lambda t, k, v: find_slots(t, k, v, insert=False)[1])
    from jctr.ops import cpu_ffi

    return jax.jit(cpu_ffi.lookup_slots)  # "cpu": the native kernel itself


@pytest.mark.parametrize("impl", ["pallas", "dispatch",
                                  pytest.param("cpu", marks=native_cpu_only)])
@pytest.mark.parametrize("case", ["random", "all_colliding", "nearly_full", "full"])
def test_hash_lookup_kernel_matches_reference(case, impl):
    from jctr.ops.hashing import EMPTY_KEY, find_slots, home_slots

    rng = np.random.default_rng(0)
    num_slots = 64
    if case == "all_colliding":
        cand = rng.integers(-(2**62), 2**62, size=20_000, dtype=np.int64)
        homes = np.asarray(home_slots(jnp.asarray(cand), num_slots))
        stored = cand[homes == 40][:20]  # one bucket (its first slot) for all
    elif case in ("nearly_full", "full"):  # full: absent keys must stop after one sweep
        stored = rng.choice(10**9, 63 if case == "nearly_full" else 64,
                            replace=False).astype(np.int64)
    else:
        stored = rng.integers(0, 10**6, 25).astype(np.int64)
    table, _ = find_slots(jnp.full((num_slots,), EMPTY_KEY), jnp.asarray(stored),
                          jnp.ones(stored.shape, bool), insert=True)
    if case == "full":  # no free slot left anywhere
        t = np.asarray(table).copy()
        t[t == EMPTY_KEY] = 10**10 + np.arange((t == EMPTY_KEY).sum())
        table = jnp.asarray(t)
    placed = np.isin(stored, np.asarray(table))
    assert placed.sum() >= 60 if case in ("nearly_full", "full") else placed.all()
    queries = np.concatenate([stored, stored[:3], rng.integers(10**9, 2 * 10**9, 7)])
    valid = np.ones(queries.shape, bool)
    valid[-2:] = False
    q, v = jnp.asarray(queries), jnp.asarray(valid)
    got = _lookup_impl(impl)(table, q, v)
    _, want = find_slots(table, q, v, insert=False)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (np.asarray(got)[: stored.size][placed] >= 0).all()
    assert (np.asarray(got)[-2:] == -1).all()


def test_hash_lookup_lowers_to_triton_for_cuda():
    from jctr.ops import find_slots
    from jctr.ops.hashing import EMPTY_KEY

    table = jnp.full((64,), EMPTY_KEY)
    keys = jnp.arange(10, dtype=jnp.int64)
    text = _lowered_for_cuda(lambda t, k, v: find_slots(t, k, v, insert=False)[1], table, keys,
                             jnp.ones(10, bool))
    assert "jctr_hash_lookup" in text


@pytest.mark.parametrize("impl", ["pallas", "dispatch"])
@pytest.mark.parametrize("case", ["random", "duplicates", "all_colliding", "overfull",
                                  "existing"])
def test_hash_insert_kernel_builds_a_valid_table(case, impl):
    """Find-or-insert: every valid key ends in a slot holding it, one slot per distinct key,
    keys already stored are found where they are, a full table refuses the rest (-1).
    ``dispatch`` on CPU: the native lookup of present keys, then XLA's insert of the others."""
    from jctr.ops import find_slots as dispatched_find_slots
    from jctr.ops.hashing import EMPTY_KEY, find_slots, home_slots
    from jctr.ops.pallas_hash import insert_slots_kernel

    if impl == "pallas":
        insert = functools.partial(insert_slots_kernel, interpret=INTERPRET)
    else:
        insert = jax.jit(functools.partial(dispatched_find_slots, insert=True))

    rng = np.random.default_rng(0)
    num_slots = 64
    table = jnp.full((num_slots,), EMPTY_KEY)
    if case == "random":
        keys = rng.integers(-(2**62), 2**62, 40, dtype=np.int64)
    elif case == "duplicates":
        keys = rng.integers(0, 12, 60).astype(np.int64)
    elif case == "all_colliding":
        cand = rng.integers(-(2**62), 2**62, size=20_000, dtype=np.int64)
        keys = cand[np.asarray(home_slots(jnp.asarray(cand), num_slots)) == 56][:30]
        keys = np.concatenate([keys, keys[:5]])
    elif case == "overfull":  # 80 distinct keys for 64 slots
        keys = rng.choice(10**9, 80, replace=False).astype(np.int64)
    else:
        stored = rng.choice(10**9, 30, replace=False).astype(np.int64)
        table, _ = find_slots(table, jnp.asarray(stored), jnp.ones(30, bool), insert=True)
        keys = np.concatenate([stored[::2], rng.choice(10**9, 10).astype(np.int64) + 10**9])
    valid = np.ones(keys.shape, bool)
    valid[-1] = False
    before = np.asarray(table)
    new_table, slots = insert(table, jnp.asarray(keys), jnp.asarray(valid))
    new_table, slots = np.asarray(new_table), np.asarray(slots)
    assert slots[~valid].tolist() == [-1]
    placed = slots >= 0
    np.testing.assert_array_equal(new_table[slots[placed]], keys[placed])
    # one slot per distinct key, and the table holds exactly the old keys plus the placed ones
    pairs = {(int(k), int(s)) for k, s in zip(keys[placed], slots[placed])}
    assert len(pairs) == len({k for k, _ in pairs}) == len({s for _, s in pairs})
    old = set(before[before != EMPTY_KEY].tolist())
    assert set(new_table[new_table != EMPTY_KEY].tolist()) == old | {k for k, _ in pairs}
    for k, s in zip(keys[placed], slots[placed]):  # stored keys stay where they were
        if k in old:
            assert before[s] == k
    want_table, want = find_slots(table, jnp.asarray(keys), jnp.asarray(valid), insert=True)
    assert (np.asarray(want) >= 0).sum() == placed.sum()  # as many keys fit as with XLA
    if case == "overfull":
        assert (new_table != EMPTY_KEY).all() and (~placed[valid]).sum() == 79 - 64  # 79 valid keys


@pytest.mark.parametrize("ordered", [False, True])
def test_the_gpu_insert_claims_in_order_where_asked(ordered):
    """The GPU's find-or-insert (:func:`jctr.ops.dispatch.insert_claims`, the Pallas kernel
    in interpret mode here): the kernel's claims (a valid table) unless they must be
    ``ordered``; then the XLA formulation's claims, slot for slot. Here a step brings more new
    keys than free slots (an evicting table of 60 rows whose batch has hundreds of keys):
    which keys find a slot decides which are refused, and the kernel's atomic claims race (an
    H200, 2026-11-27: two runs of
    ``test_a_full_table_trains_on_by_evicting_and_resumes_exactly``'s training differed from
    the first loss, 45 against 175 evictions)."""
    from jctr.ops.dispatch import insert_claims
    from jctr.ops.hashing import EMPTY_KEY, find_slots

    rng = np.random.default_rng(3)
    table = jnp.full((64,), EMPTY_KEY)
    stored = rng.choice(10**9, 30, replace=False).astype(np.int64)
    table, _ = find_slots(table, jnp.asarray(stored), jnp.ones(30, bool), insert=True)
    n_new = 60 if ordered else 20  # 34 free slots
    keys = np.concatenate([stored[:10], rng.choice(10**9, n_new).astype(np.int64) + 10**9])
    valid = jnp.ones(keys.shape, bool)
    claims = functools.partial(insert_claims, interpret=INTERPRET)
    got_table, got = jax.jit(claims)(table, jnp.asarray(keys), valid, jnp.asarray(ordered))
    want_table, want = find_slots(table, jnp.asarray(keys), valid, insert=True,
                                  chunk=keys.shape[0])  # (one chunk on a GPU)
    got, got_table = np.asarray(got), np.asarray(got_table)
    np.testing.assert_array_equal(got_table[got[got >= 0]], keys[got >= 0])
    assert ((got >= 0).sum() == (np.asarray(want) >= 0).sum()
            == (len(set(keys.tolist())) if not ordered else 10 + 34))
    if ordered:
        np.testing.assert_array_equal(got, np.asarray(want))
        np.testing.assert_array_equal(got_table, np.asarray(want_table))


def test_an_evicting_table_claims_in_order_in_a_deterministic_run(monkeypatch):
    """An evicting table's inserts (training lookups, inserts, slot rebuilds) are ``exact``:
    where its keys sit decides which keys a new key's window ranks, and with the GPU kernel's
    racing claims two runs of the same steps (a resumed one and the uninterrupted one)
    evicted different keys (an H200, 2026-11-28: 56 of 500 choices differed on the first step
    after a restore, whose slots were built again). On a GPU they then claim in order (the
    XLA formulation's claims) where XLA's deterministic ops are asked for, as a bit-exact
    resume needs anyway; elsewhere they keep the kernel (~20x faster there). A plain table
    with room keeps the kernel's claims always."""
    from jctr.config.schema import EvictionConfig
    from jctr.embedding import create_table, lookup
    from jctr.embedding import hash_table as ht
    from jctr.ops import dispatch
    from jctr.ops.hashing import find_slots as hashing_find_slots

    asked = []

    def spy(*args, insert, scarce=None, exact=False):
        if insert:
            asked.append(exact)
        return hashing_find_slots(*args, insert=insert)

    monkeypatch.setattr(dispatch, "find_slots", spy)
    monkeypatch.setattr(ht, "find_slots", spy)
    monkeypatch.setenv("JCTR_KERNELS", "reference")
    keys = jnp.arange(1, 41, dtype=jnp.int64)
    valid = jnp.ones(keys.shape, bool)

    def inserts(f):
        asked.clear()
        f()
        return list(asked)

    ev = EvictionConfig("lru")
    plain, _ = lookup(create_table(100), keys, valid, 100, insert=True)
    full, _ = lookup(create_table(40, ev), keys, valid, 40, insert=True, eviction=ev)
    assert inserts(lambda: lookup(plain, keys + 100, valid, 100, insert=True)) == [False]
    assert inserts(lambda: ht.rebuild_slots(plain)) == [False]
    for f in (lambda: lookup(full, keys + 100, valid, 40, insert=True, eviction=ev),  # evicts
              lambda: lookup(full, keys + 100, valid, 40, insert=True),  # no eviction
              lambda: ht.rebuild_slots(full)):
        got = inserts(f)
        assert got and all(got), got

    # the claims' order on a GPU: scarce slots always, exact inserts in a deterministic run
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert not dispatch.deterministic_gpu()
    assert [bool(dispatch.claims_in_order(s, e)) for s, e in
            [(None, False), (False, True), (True, False)]] == [False, False, True]
    for flag in ("--xla_gpu_deterministic_ops=true", "--xla_gpu_deterministic_ops",
                 "--xla_gpu_deterministic_ops=false --xla_gpu_deterministic_ops=1"):
        monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {flag}")
        assert dispatch.deterministic_gpu()
        assert [bool(dispatch.claims_in_order(s, e)) for s, e in
                [(None, False), (False, True), (True, False)]] == [False, True, True]
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    assert not dispatch.deterministic_gpu()


def test_hash_insert_lowers_to_triton_for_cuda():
    from jctr.ops import find_slots
    from jctr.ops.hashing import EMPTY_KEY

    table = jnp.full((64,), EMPTY_KEY)
    keys = jnp.arange(10, dtype=jnp.int64)
    text = _lowered_for_cuda(lambda t, k, v: find_slots(t, k, v, insert=True), table, keys,
                             jnp.ones(10, bool))
    assert "__gpu$xla.gpu.triton" in text and "jctr_hash_insert" in text
    # a training lookup that may run short of slots carries both claims, one run per step
    text = _lowered_for_cuda(lambda t, k, v, s: find_slots(t, k, v, insert=True, scarce=s),
                             table, keys, jnp.ones(10, bool), jnp.asarray(True))
    assert "jctr_hash_insert" in text and text.count("stablehlo.while") >= 2


def test_step_compiler_options_on_cpu(monkeypatch):
    from jctr.runtime.xla_options import step_compiler_options

    probe = step_compiler_options.__wrapped__
    monkeypatch.delenv("JCTR_XLA_DEFAULTS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    if ON_GPU:  # the options are XLA-CPU's: a GPU step compiles with none
        assert probe() == {} == probe("bfloat16")
        return
    opts = probe()
    assert opts == {"xla_cpu_experimental_ynn_fusion_type": ""} == probe("float16")
    assert probe("bfloat16") == {}  # bf16 matmuls need YNNPACK
    # the options compile and give the same result as the default compile
    f = jax.jit(lambda a, b: jnp.maximum(a @ b, 0.0).sum(), compiler_options=opts)
    a, b = jnp.ones((64, 32)), jnp.full((32, 16), 0.5)
    assert float(f(a, b)) == float(jax.jit(lambda a, b: jnp.maximum(a @ b, 0.0).sum())(a, b))
    monkeypatch.setenv("JCTR_XLA_DEFAULTS", "0")
    assert probe() == {}
    monkeypatch.delenv("JCTR_XLA_DEFAULTS")
    monkeypatch.setenv("XLA_FLAGS",
                       "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT")
    assert probe() == {}  # the user's own setting wins


def test_malloc_tuning_env_for_glibc():
    import platform
    import subprocess
    import sys

    from jctr.runtime.host_memory import TUNABLES, describe_malloc_tuning, malloc_tuning_env

    assert describe_malloc_tuning().startswith("[jctr] host memory: ")
    if platform.libc_ver()[0] != "glibc":
        assert malloc_tuning_env({}) is None
        return
    everything = ":".join(f"{name}={value}" for name, value in TUNABLES)
    assert everything.startswith("glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:")
    assert malloc_tuning_env({})["GLIBC_TUNABLES"] == everything
    # the user's own settings stay, ours are added after them, never twice
    env = malloc_tuning_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "b"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + ":".join(
        f"{n}={v}" for n, v in TUNABLES if n != "glibc.malloc.arena_max")
    assert env["A"] == "b"
    assert malloc_tuning_env({"GLIBC_TUNABLES": everything}) is None
    user = everything.replace("hugetlb=1", "hugetlb=0")
    assert malloc_tuning_env({"GLIBC_TUNABLES": user}) is None  # the user's choice
    assert malloc_tuning_env({"JCTR_HOST_MEMORY_TUNING": "0"}) is None
    # the CLI re-executes itself once with the tunables (and not again)
    code = ("import os, sys; from jctr.runtime.host_memory import reexec_with_malloc_tuning; "
            "reexec_with_malloc_tuning(['-c', sys.argv[1] if len(sys.argv) > 1 else '']); "
            "print(os.environ.get('GLIBC_TUNABLES'))")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES",
                                                            "JCTR_HOST_MEMORY_TUNING")}
    out = subprocess.run([sys.executable, "-c", code, code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip().splitlines() == [everything]


def test_kernel_choice_from_environment(monkeypatch):
    from jctr.errors import UserError
    from jctr.ops import dispatch

    dense, sparse = jnp.ones((2, 4)), jnp.ones((2, 3, 4))
    monkeypatch.setenv("JCTR_KERNELS", "reference")
    np.testing.assert_allclose(dispatch.dot_interaction(dense, sparse),
                               interaction.dot_interaction_reference(dense, sparse))
    monkeypatch.setenv("JCTR_KERNELS", "pallas")
    with pytest.raises(UserError, match="JCTR_KERNELS='pallas': expected \"auto\""):
        dispatch.dot_interaction(dense, sparse)
