"""The one place that picks an implementation per platform.

``jax.lax.platform_dependent`` selects at lowering time, so one jitted function carries the
Pallas/Triton kernel for ``cuda`` (hash lookup and insert, dot interaction) and the XLA
formulation or a native kernel (:mod:`jctr.ops.cpu_ffi`: hash lookup, dot interaction) for
``cpu``; the embedding bag is XLA's on both (measured faster: ``scripts/bench_ops.py``).
``JCTR_KERNELS=reference`` forces the jnp references everywhere (debugging); ``auto`` (the
default) is the choice above.

Where JAX runs on CPU alone (``jax.default_backend() == "cpu"``) a trace carries only the CPU
branch: the others could never run there, and tracing them (the XLA formulations' loops) took
0.3-1.5 s of each compile of a training step. :func:`every_platform` traces them all, for
lowering one trace for another platform (``lowering_platforms=("cuda",)``) without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jctr.errors import UserError
from jctr.ops import bag as ref
from jctr.ops import (
    cpu_ffi,
    hashing,
    host_call,
    interaction,
    pallas_hash,
    pallas_interaction,
)
from jctr.ops import linear as dense_ops


def _native_rows(values) -> bool:
    """Whether the native CPU kernels on table rows may run: float32 [rows, dim] tables, native
    kernels built, not ``JCTR_KERNELS=reference`` (on CPU only: ``platform_dependent``)."""
    return (_mode() != "reference" and cpu_ffi.AVAILABLE and values.dtype == jnp.float32
            and values.ndim == 2)


def _mode() -> str:
    mode = os.environ.get("JCTR_KERNELS", "auto")
    if mode not in ("auto", "reference"):
        raise UserError(f"environment variable JCTR_KERNELS={mode!r}: expected \"auto\" "
                        "(platform kernels, the default) or \"reference\" (jnp references)")
    return mode


_EVERY_PLATFORM = [False]


@contextlib.contextmanager
def every_platform():
    """Traces made inside carry every platform's kernels, as ``jax.lax.platform_dependent``
    does, so that they lower for any platform; outside, on a CPU-only JAX, only the CPU's.
    JAX's caches are cleared on the way in and out (a cached trace holds one or the other).

    Example::

        with every_platform():
            text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    """
    jax.clear_caches()
    _EVERY_PLATFORM[0] = True
    try:
        yield
    finally:
        _EVERY_PLATFORM[0] = False
        jax.clear_caches()


def _by_platform(*args, cpu, default, cuda=None):
    """``jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=default)``; on a CPU-only
    JAX outside :func:`every_platform` the ``cpu`` branch alone."""
    if not _EVERY_PLATFORM[0] and jax.default_backend() == "cpu":
        return cpu(*args)
    more = {"cuda": cuda} if cuda is not None else {}
    return jax.lax.platform_dependent(*args, cpu=cpu, default=default, **more)


def host_callback(fn, results, *operands) -> list:
    """``fn(*numpy operands)`` called from a jitted step, its values the step's arrays of
    ``results``' shapes and dtypes (a side effect: called once per execution, never dropped).
    On CPU the step's buffers are read where they are (:mod:`jctr.ops.host_call`: no copy onto
    CPU device 0, which on several CPU devices can wait forever on the others' collectives);
    elsewhere ``jax.experimental.io_callback``."""
    results = list(results)

    def cpu(*xs):
        return host_call.cpu_host_call(fn, results, *xs)

    def default(*xs):
        from jax.experimental import io_callback

        return list(io_callback(lambda *a: tuple(fn(*(np.asarray(x) for x in a))),
                                tuple(results), *xs))

    return _by_platform(*operands, cpu=cpu, default=default)


# The embedding bag: XLA's gather + segment sum on GPU, one native pass on CPU (the gathered
# rows of a 10-hot batch, 136 MB a step, are never written; docs/performance.md). The
# Pallas/Triton bag kernels (jctr.ops.pallas_bag) lost to XLA on the first GPU measured (H200,
# scripts/bench_ops.py in scripts/gpu_check.sh, 212,992 keys of dim 16: forward 342 vs 1,027 M
# rows/s, backward 831 vs 2,629 M rows/s; docs/performance.md "GPU check"); they stay tested
# and measured there.


def embedding_bag_forward(values, rows, segments, num_segments: int, combiner: str = "sum",
                          *, one_hot: bool = False):
    """[num_segments, dim] pooled rows (see :mod:`jctr.ops.bag`)."""
    if not _native_rows(values):
        return _pooled_reference(values, rows, segments, num_segments, combiner, one_hot)
    return _bag_forward(values, rows, segments, num_segments, combiner, one_hot)


def _pooled_reference(values, rows, segments, num_segments, combiner, one_hot):
    if one_hot:  # one key per segment: a plain gather
        return ref.gather_rows(values, rows)
    return ref.embedding_bag_forward_reference(values, rows, segments, num_segments, combiner)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _bag_forward(values, rows, segments, num_segments: int, combiner: str, one_hot: bool):
    """On CPU the sums in one native pass (:func:`jctr.ops.cpu_ffi.bag_sum`: the gathered rows
    of a 10-hot batch are never written out; a one-hot batch's rows fetched ahead and in parts,
    where XLA's gather, fused into what reads it, waited for each row); differentiable as the
    reference. Elsewhere the reference (one-hot: a plain gather)."""
    def reference(values, rows, segments):
        return _pooled_reference(values, rows, segments, num_segments, combiner, one_hot)

    def cpu(values, rows, segments):
        out = cpu_ffi.bag_sum(values, rows, segments, num_segments)
        return ref.per_position(out, segments, num_segments) if combiner == "mean" else out

    return _by_platform(values, rows, segments, cpu=cpu, default=reference)


def _bag_forward_fwd(values, rows, segments, num_segments, combiner, one_hot):
    return _bag_forward(values, rows, segments, num_segments, combiner, one_hot), (
        values, rows, segments)


def _bag_forward_bwd(num_segments, combiner, one_hot, residuals, grad):
    values, rows, segments = residuals
    g = ref.key_gradients(grad, segments, num_segments, combiner)
    safe = jnp.where(rows >= 0, rows, values.shape[0])
    return jnp.zeros_like(values).at[safe].add(g.astype(values.dtype), mode="drop"), None, None


_bag_forward.defvjp(_bag_forward_fwd, _bag_forward_bwd)


def embedding_bag_backward(grad_out, segments, rep, num_segments: int, combiner: str = "sum",
                           *, one_hot: bool = False):
    """[n, dim] row gradients summed at each row's representative position."""
    return ref.embedding_bag_backward_reference(grad_out, segments, rep, num_segments, combiner)


def row_rule_by_segment(rule: str, tables: tuple, rows, rep, segments, grad_out, params,
                        num_segments: int, combiner: str, reference) -> tuple:
    """``tables`` (the values, then the optimizer's state: Adam's m and v, or the one state
    of ``AdaGrad``, ``MomentumSGD``, ``Nesterov``) after the ``rule`` on a bag's distinct rows
    (``rep``: each position's representative; ``params``: Adam's, see
    :func:`jctr.ops.cpu_ffi.adam_rows`, or lr, epsilon, momentum factor); ``reference(*tables)``
    is the jnp formulation (the row gradients summed at the representatives, then the rows
    gathered, stepped and scattered back in chunks). On CPU one native pass lists the
    distinct rows with their summed gradients and steps them in parts (the same rows to a
    rounding of the state, where XLA fuses a multiply-add and the kernel does not or the
    other way round; without the [n, dim] arrays of zeros, gradients and gathered rows and
    their scatters: docs/performance.md); elsewhere the reference."""
    values = tables[0]
    if not _native_rows(values) or any(t.shape != values.shape for t in tables[1:]) or (
            len(tables) != (3 if rule == "Adam" else 2)):
        return reference(*tables)

    def cpu(*tables):
        g = ref.per_position(grad_out, segments, num_segments) if combiner == "mean" else grad_out
        if rule == "Adam":
            return cpu_ffi.adam_rows(*tables, rows, rep, segments, g, params)
        code = jnp.float32(cpu_ffi.ONE_STATE_RULES.index(rule))
        return cpu_ffi.one_state_rows(*tables, rows, rep, segments, g,
                                      jnp.concatenate([params, code[None]]))

    return _by_platform(*tables, cpu=cpu, default=reference)


def sgd_by_segment(values, rows, segments, grad_out, factor, num_segments: int,
                   combiner: str = "sum"):
    """``values`` after plain SGD on a bag's rows: each key's row (``rows``; negative or
    past the last row: dropped) moves by ``factor`` (-lr) times its segment's gradient (over
    the segment's positions for ``mean``), duplicates adding up. On CPU the segment rows are
    added in one native pass (:func:`jctr.ops.cpu_ffi.add_by_segment`, which skips the
    dropped rows itself: no pass of XLA over the batch's rows first) without the [n, dim]
    per-key gradients; elsewhere XLA's scatter-add of them."""
    def reference(values, rows, segments, grad_out):
        g = ref.key_gradients(grad_out, segments, num_segments, combiner)
        at = jnp.where(rows >= 0, rows, values.shape[0])  # -1 would index the last row
        return values.at[at].add(factor * g, mode="drop")

    args = (values, rows, segments, grad_out)
    if not _native_rows(values):
        return reference(*args)

    def cpu(values, rows, segments, grad_out):
        if combiner == "mean":  # as key_gradients divides, per segment instead of per key
            grad_out = ref.per_position(grad_out, segments, num_segments)
        # the kernel scales each segment's gradient as it adds it (XLA's scaled copy of
        # them: a pass over [segments, dim], 1.5-3 ms of a 10-hot step)
        return cpu_ffi.add_by_segment(values, rows, segments, grad_out, factor)

    return _by_platform(*args, cpu=cpu, default=reference)


def _cpu_pair_dots(feats):
    # the native kernels where they apply; else bfloat16: batched row-major matmuls for
    # YNNPACK, float32: elementwise with the batch innermost
    if cpu_ffi.pair_dots_supported(feats):
        return cpu_ffi.pair_dots(feats)
    if feats.dtype == jax.numpy.bfloat16:
        return interaction.pair_dots_gram(feats)
    return interaction.pair_dots_xla(feats)


def dot_interaction(dense, sparse):
    """Concatenate ``dense`` [b, d] with the strictly-lower-triangular pairwise dot products of
    the features ``[dense, sparse[:, 0], ..., sparse[:, s-1]]`` and one zero column (products
    accumulate in float32 whatever the compute dtype).

    Example::

        dot_interaction(jnp.ones((2, 4)), jnp.ones((2, 3, 4))).shape  # (2, 4 + 6 + 1)
    """
    feats = jax.numpy.concatenate([dense[:, None, :], sparse.astype(dense.dtype)], axis=1)
    if _mode() == "reference":
        return interaction.dot_interaction_reference(dense, sparse)
    dots = _by_platform(feats, cpu=_cpu_pair_dots, cuda=pallas_interaction.make_pair_dots(False),
                        default=interaction.pair_dots_xla)
    return interaction.assemble(dense, dots)


def linear(x, kernel, bias, *, relu: bool = False):
    """``x @ kernel + bias`` (ReLU optional) in ``x``'s dtype. On CPU, bfloat16 takes the
    row-major backward of :func:`jctr.ops.linear.linear_rowmajor` (YNNPACK's bf16 kernels);
    float32 the plain formulation everywhere (XLA's own dots handle its transposes).

    Example::

        linear(jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.zeros(4), relu=True).shape  # (2, 4)
    """
    if _mode() == "reference" or x.dtype != jax.numpy.bfloat16:
        return dense_ops.linear_reference(x, kernel, bias, relu)

    def reference(x, kernel, bias):
        return dense_ops.linear_reference(x, kernel, bias, relu)

    def rowmajor(x, kernel, bias):
        return dense_ops.linear_rowmajor(x, kernel, bias, relu)

    return _by_platform(x, kernel, bias, cpu=rowmajor, default=reference)


def _find_slots_cpu(slot_keys, keys, valid, *, insert: bool):
    # keys already in the table: one native pass over the batch in two parts (XLA may run
    # them on its two threads); new keys then go in by the native insert, which skips the
    # found ones (jctr.ops.cpu_ffi)
    if not cpu_ffi.AVAILABLE:
        return hashing.find_slots(slot_keys, keys, valid, insert=insert)
    slots = cpu_ffi.lookup_slots(slot_keys, keys, valid)
    if not insert:
        return slot_keys, slots
    slot_keys, placed = cpu_ffi.insert_slots(slot_keys, keys, valid & (slots < 0))
    return slot_keys, jnp.where(slots >= 0, slots, placed)


def find_slots(slot_keys, keys, valid, *, insert: bool, scarce=None, exact: bool = False):
    """Slots of keys in an open-addressing table (see :func:`jctr.ops.hashing.find_slots`):
    the Pallas kernels on GPU (lookup, and find-or-insert with atomic claims); on CPU a native
    probe loop for the keys present and a native sequential insert (the same slots in every
    run).

    The GPU kernel's claims race: which slot a new key gets may differ from run to run (its
    row does not). Two kinds of insert take the XLA formulation's claims there instead, first
    position first, the same in every run (:func:`insert_claims`): ``scarce`` (a bool scalar)
    ones, where the free slots may not hold every new key of the batch (which keys get one
    decides which are refused); and ``exact`` ones (where keys sit decides later results: an
    evicting table's windows) when XLA's deterministic GPU ops are asked for
    (:func:`deterministic_gpu`), as a bit-exact rerun or resume on a GPU needs anyway. They
    cost about 20x the kernel (an H200, 106,496 keys: ~25 ms against ~1 ms), so a run that
    does not ask keeps the kernel."""
    if _mode() == "reference":
        return hashing.find_slots(slot_keys, keys, valid, insert=insert)
    if insert:
        ordered = claims_in_order(scarce, exact)

        def reference(slot_keys, keys, valid, ordered):
            return hashing.find_slots(slot_keys, keys, valid, insert=True)

        def cpu(slot_keys, keys, valid, ordered):
            return _find_slots_cpu(slot_keys, keys, valid, insert=True)

        return _by_platform(slot_keys, keys, valid, ordered, cpu=cpu, cuda=insert_claims,
                            default=reference)

    def lookup_reference(slot_keys, keys, valid):
        return hashing.find_slots(slot_keys, keys, valid, insert=False)[1]

    def lookup_cpu(slot_keys, keys, valid):
        return _find_slots_cpu(slot_keys, keys, valid, insert=False)[1]

    slots = _by_platform(slot_keys, keys, valid, cpu=lookup_cpu,
                         cuda=pallas_hash.lookup_slots_kernel, default=lookup_reference)
    return slot_keys, slots


def deterministic_gpu() -> bool:
    """Whether XLA's deterministic GPU ops are asked for (``XLA_FLAGS`` holds
    ``--xla_gpu_deterministic_ops=true``): scatter-adds then sum in a fixed order, and
    inserts whose slots matter later claim in order (:func:`find_slots`)."""
    on = False
    for flag in os.environ.get("XLA_FLAGS", "").split():  # (the last one given counts)
        name, eq, value = flag.partition("=")
        if name == "--xla_gpu_deterministic_ops":
            on = not eq or value.lower() in ("true", "1")
    return on


def claims_in_order(scarce, exact: bool) -> jax.Array:
    """Whether a GPU insert claims in order (bool scalar): see :func:`find_slots`."""
    if exact and deterministic_gpu():
        return jnp.ones((), bool)
    return jnp.zeros((), bool) if scarce is None else jnp.asarray(scarce, bool)


def insert_claims(slot_keys, keys, valid, ordered, *, interpret: bool = False):
    """The GPU's find-or-insert: the Pallas kernel's atomic claims (the slot each key gets may
    differ from run to run, the keys' rows do not: rows go by position,
    :func:`jctr.ops.hashing.assign_rows`), the XLA formulation's claims where they must be
    ``ordered`` (see :func:`find_slots`). Two loops run at most once each (a ``cond`` would
    copy the slots in its untaken branch)."""
    def pallas(c):
        return (False, *pallas_hash.insert_slots_kernel(c[1], keys, valid, interpret=interpret))

    def xla(c):  # one chunk: on a GPU each probe round is a few launch-bound kernels
        return (False, *hashing.find_slots(c[1], keys, valid, insert=True,
                                           chunk=keys.shape[0]))

    state = (~ordered, slot_keys, jnp.full(keys.shape, -1, jnp.int32))
    _, slot_keys, slots = jax.lax.while_loop(lambda c: c[0], pallas, state)
    _, slot_keys, slots = jax.lax.while_loop(lambda c: c[0], xla, (ordered, slot_keys, slots))
    return slot_keys, slots


def find_and_assign(slot_keys, slot_rows, scratch, free_rows, size, free_count, keys, valid,
                    capacity: int, *, dedupe: bool = True, scarce=None, exact: bool = False,
                    lean: bool = False):
    """A training lookup's slots and rows: :func:`find_slots` with ``insert`` then
    :func:`jctr.ops.hashing.assign_rows`. On CPU one native pass
    (:func:`jctr.ops.cpu_ffi.find_assign`). ``scarce``, ``exact``: see :func:`find_slots`.
    Returns (slot_keys, slots, slot_rows, scratch, rows, rep, new, granted, size,
    free_count, counts): ``counts`` int32 [3] the new keys, those granted a row and the valid
    keys that found no slot (the native pass counts them as it goes: XLA's sums of the
    batch's masks were ~7 ms of events in a 10-hot step, docs/performance.md). With ``lean``
    (no ``dedupe``) ``slots``, ``rep`` and ``new`` are None: the native pass writes them
    nowhere (in a 10-hot batch ~19 MB of stores, ~10% of the pass)."""
    def reference(slot_keys, slot_rows, scratch, free_rows, size, free_count, keys, valid):
        slot_keys, slots = find_slots(slot_keys, keys, valid, insert=True, scarce=scarce,
                                      exact=exact)
        slot_rows, scratch, rows, rep, new, granted, size, free_count = hashing.assign_rows(
            slot_rows, scratch, free_rows, size, free_count, slots, capacity, dedupe=dedupe)
        counts = jnp.stack([jnp.sum(new, dtype=jnp.int32), jnp.sum(granted, dtype=jnp.int32),
                            jnp.sum(valid & (slots < 0), dtype=jnp.int32)])
        if lean:  # as the native pass gives them (a caller reading one fails here too)
            slots = rep = new = None
        return (slot_keys, slots, slot_rows, scratch, rows, rep, new, granted, size,
                free_count, counts)

    if lean and dedupe:
        raise ValueError("find_and_assign: lean leaves out the representatives dedupe gives")
    args = (slot_keys, slot_rows, scratch, free_rows, size, free_count, keys, valid)
    if _mode() == "reference" or not cpu_ffi.AVAILABLE:
        return reference(*args)

    def cpu(*args):
        return cpu_ffi.find_assign(*args, capacity, dedupe, lean)

    return _by_platform(*args, cpu=cpu, default=reference)


def initialize_rows(values, row_slot, keys, rows, fresh, key_slots, *, scales, seed: int,
                    zero_tail: bool, reference, resets: dict | None = None, slot_num: int = 0):
    """(values, row_slot, resets) with the initial vectors and slots of the rows a training
    lookup created (``fresh`` positions), and those rows of each array in ``resets`` (name ->
    (array, fill row): an evicting table's optimizer rows) set to its fill row;
    ``reference``: the XLA formulation, called with the same six arrays and the dict of
    arrays. A row's slot is its position's ``key_slots`` modulo ``slot_num`` (where not 0;
    the reference takes it as it takes ``key_slots``). On CPU one native pass
    (:func:`jctr.ops.cpu_ffi.init_rows`, bit for bit :func:`jctr.ops.hashing.key_uniform`
    times ``scales``) for float32 tables, the resets in the same pass where their elements
    are 4 bytes."""
    resets = resets or {}
    names = sorted(resets)
    arrays = {name: resets[name][0] for name in names}
    args = (values, row_slot, keys, rows, fresh, key_slots, arrays)
    if not _native_rows(values) or any(
            arrays[name].dtype.itemsize != 4 or arrays[name].ndim > 2 for name in names):
        return reference(*args)

    def cpu(values, row_slot, keys, rows, fresh, key_slots, arrays):
        out = cpu_ffi.init_rows(values, row_slot, keys, rows, fresh, key_slots, scales, seed,
                                zero_tail, tuple((arrays[n], resets[n][1]) for n in names),
                                slot_num)
        return out[0], out[1], dict(zip(names, out[2:]))

    return _by_platform(*args, cpu=cpu, default=reference)


def rebuild_slots(reference, slot_keys, slot_rows, score):
    """A table's (slot_keys, slot_rows, score) built again from its keys with a row
    (``reference``: :func:`jctr.embedding.hash_table.rebuild_slots`' XLA formulation, called
    with the same arguments); on CPU one native sweep in place
    (:func:`jctr.ops.cpu_ffi.rebuild_slots`) that leaves every key where the CPU's batch
    insert of the keys in the reference's order does."""
    args = (slot_keys, slot_rows, score)
    if _mode() == "reference" or not cpu_ffi.AVAILABLE:
        return reference(*args)
    return _by_platform(*args, cpu=cpu_ffi.rebuild_slots, default=reference)


# the most needy keys a GPU's eviction ranks together: its rounds are a few small kernels
# each, launch-bound, so one chunk for a step's keys (in chunks of n // 8, a uniform stream's
# step of 106,496 keys took ~5x a step with room on an H200)
GPU_EVICT_CHUNK = 1 << 18


def evict_rows(reference, slot_keys, slot_rows, score, scratch, keys, slots, needy, clock,
               rows, rep, *, policy: str, epoch_steps: int, samples: int, chunk: int):
    """The rows a full table's new keys take (``reference``: the XLA formulation,
    :func:`jctr.embedding.hash_table._evict`'s, called with the same arguments and the
    ``chunk`` of needy keys it ranks together); on CPU the native kernel
    (:func:`jctr.ops.cpu_ffi.evict`), which makes the choices of chunks of one key (each key
    claims in turn: ``chunk`` must be 1); on GPU the XLA formulation with chunks of up to
    ``GPU_EVICT_CHUNK`` keys (the choices of that chunk: the same in every run). ``scratch``
    (int32 [slots], contents never matter) holds the XLA rounds' claims; the native kernel
    claims in turn and passes it through. ``rows`` (the lookup's, -1: none) and ``rep``
    (each position's representative, -1: itself) give every position its key's slot and
    row after the eviction. Returns (slot_keys, slot_rows, score, scratch, placed, gone
    keys, each position's slot after it, each position's row after it, tombstones made,
    keys placed): the slots of keys left without a row are tombstones."""
    args = (slot_keys, slot_rows, score, scratch, keys, slots, needy, clock, rows, rep)
    if _mode() == "reference" or not cpu_ffi.AVAILABLE:
        return reference(*args, chunk=chunk)
    gpu_chunk = max(chunk, min(keys.shape[0], GPU_EVICT_CHUNK))

    def cpu(slot_keys, slot_rows, score, scratch, keys, slots, needy, clock, rows, rep):
        if chunk != 1:
            raise ValueError(f"the native eviction claims a key at a time: chunk {chunk}, "
                             "expected 1")
        slot_keys, slot_rows, score, placed, gone, at, rows, counts = cpu_ffi.evict(
            slot_keys, slot_rows, score, keys, slots, needy, clock, rows, rep, policy=policy,
            epoch_steps=epoch_steps, samples=samples)
        return (slot_keys, slot_rows, score, scratch, placed, gone, at, rows, counts[0],
                counts[1])

    return _by_platform(*args, cpu=cpu, default=functools.partial(reference, chunk=gpu_chunk))
