"""Native kernels in parts on helper threads (``jctr.ops.cpu_parts``): the bag, the initial
rows and the interaction give the same bits whether their parts run on the helpers, all on
the calling thread, or in a process where the helpers cannot be used; batches large enough
to have several parts (a part takes 65,536 positions or 512 samples at least)."""

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jctr.ops import cpu_ffi, cpu_parts

pytestmark = pytest.mark.skipif(not cpu_ffi.AVAILABLE, reason="native kernels not built")


def _ensure_helpers():
    """The kernels registered and at least one helper running (a process told
    ``JCTR_KERNEL_THREADS=0``, or one core, starts none)."""
    cpu_ffi._register()
    cpu_parts.start_helpers(max(1, cpu_parts.helper_count()))


@contextlib.contextmanager
def _pool(helpers=None, pid=None, busy=False):
    """The helpers' pool as kernels see it: ``helpers`` in use, another process's pool
    (``pid``: a forked child's view), or helpers that never come (``busy``: the queue full,
    so the calling thread takes every part)."""
    _ensure_helpers()
    pool = cpu_parts._POOL
    saved = pool[cpu_parts._HELPERS], pool[cpu_parts._PID]
    if helpers is not None:
        pool[cpu_parts._HELPERS] = min(helpers, saved[0])
    if pid is not None:
        pool[cpu_parts._PID] = pid
    if busy:  # the queue looks full: nothing is queued while it does
        tail = pool[cpu_parts._TAIL]
        pool[cpu_parts._TAIL] = pool[cpu_parts._HEAD] + cpu_parts._RING
    try:
        yield
    finally:
        pool[cpu_parts._HELPERS], pool[cpu_parts._PID] = saved
        if busy:
            pool[cpu_parts._TAIL] = tail


_WAYS = ({}, {"helpers": 0}, {"pid": os.getpid() + 1}, {"busy": True})


def _three_ways(fn, *args):
    """``fn(*args)`` (numpy results) with the helpers, with none, as a forked child, and with
    helpers that never come."""
    out = []
    for ways in _WAYS:
        with _pool(**ways):
            out.append([np.asarray(x) for x in jax.block_until_ready(fn(*args))])
    return out


def test_helpers_start_and_the_count_is_validated(monkeypatch):
    """The helpers run once a kernel is registered (one fewer than the cores, at least none);
    ``JCTR_KERNEL_THREADS`` sets the count (at most one fewer than a kernel's most parts),
    and a value that is not a whole number is an error naming the variable."""
    _ensure_helpers()
    assert cpu_parts._POOL[cpu_parts._PID] == os.getpid()
    assert cpu_parts._POOL[cpu_parts._HELPERS] == max(1, cpu_parts.helper_count())
    monkeypatch.setenv("JCTR_KERNEL_THREADS", "3")
    assert cpu_parts.helper_count() == 3
    monkeypatch.setenv("JCTR_KERNEL_THREADS", "0")
    assert cpu_parts.helper_count() == 0
    monkeypatch.setenv("JCTR_KERNEL_THREADS", "1000")  # no kernel has more parts
    assert cpu_parts.helper_count() == cpu_parts.MOST_HELPERS
    monkeypatch.setenv("JCTR_KERNEL_THREADS", "two")
    with pytest.raises(ValueError, match="JCTR_KERNEL_THREADS='two'.*whole number"):
        cpu_parts.helper_count()


@pytest.mark.parametrize("dim", [16, 12])
def test_the_bag_in_parts_sums_each_segment_in_batch_order(dim):
    """``jctr_cpu_bag_sum`` over 300k positions in segments laid out in batch order (a bag of
    40,000 positions across part boundaries, empty segments, rows -1, segments past the last
    at the end): each segment is the sum of its rows in batch order (``np.add.at``, bit for
    bit) on the helpers, on one thread and in a child process; segments out of order take one
    part and give the same."""
    rng = np.random.default_rng(dim)
    capacity, segments = 50_000, 40_000
    counts = rng.integers(0, 12, segments)
    counts[1234] = 40_000
    counts[::97] = 0
    segs = np.repeat(np.arange(segments, dtype=np.int32), counts)
    segs = np.concatenate([segs, np.full(5000, segments + 3, np.int32)])
    n = segs.size
    assert n > 4 * 65_536
    rows = np.where(rng.random(n) < 0.05, -1, rng.integers(0, capacity, n)).astype(np.int32)
    values = rng.normal(size=(capacity, dim)).astype(np.float32)
    want = np.zeros((segments, dim), np.float32)
    ok = (rows >= 0) & (segs < segments)
    np.add.at(want, segs[ok], values[rows[ok]])
    bag = jax.jit(lambda v, r, s: (cpu_ffi.bag_sum(v, r, s, segments),))
    for got in _three_ways(bag, values, rows, segs):
        np.testing.assert_array_equal(got[0].view(np.uint32), want.view(np.uint32))
    order = rng.permutation(n)
    shuffled = np.zeros((segments, dim), np.float32)
    np.add.at(shuffled, segs[order][ok[order]], values[rows[order][ok[order]]])
    got = np.asarray(bag(values, rows[order], segs[order])[0])
    np.testing.assert_array_equal(got.view(np.uint32), shuffled.view(np.uint32))


def test_the_initial_rows_in_parts_equal_one_pass():
    """``jctr_cpu_init_rows`` over 200k positions with an optimizer row to reset: the same
    vectors, slots and reset rows on the helpers, on one thread and in a child process, and
    the XLA formulation's vectors."""
    from jctr.ops.hashing import key_uniform

    rng = np.random.default_rng(3)
    capacity, n, dim = 300_000, 200_000, 16
    rows = np.where(rng.random(n) < 0.1, -1, rng.permutation(capacity)[:n]).astype(np.int32)
    keys = rng.integers(-(1 << 62), 1 << 62, n)
    fresh = rng.random(n) < 0.6
    key_slots = rng.integers(0, 26, n).astype(np.int32)
    values = rng.random((capacity, dim), dtype=np.float32)
    moments = rng.random((capacity, dim), dtype=np.float32)

    def init(values, moments):
        return cpu_ffi.init_rows(values, jnp.full(capacity, -1, jnp.int32), keys, rows, fresh,
                                 key_slots, np.float32(0.05), 11, False,
                                 resets=((moments, np.zeros(dim, np.float32)),))

    ways = _three_ways(jax.jit(init), values, moments)
    for got in ways[1:]:
        for a, b in zip(ways[0], got):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    at = np.where(fresh & (rows >= 0))[0]
    want = np.asarray(key_uniform(jnp.asarray(keys[at]), dim, 11, 1.0) * np.float32(0.05))
    np.testing.assert_array_equal(ways[0][0][rows[at]].view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(ways[0][1][rows[at]], key_slots[at])
    assert not ways[0][2][rows[at]].any()


def test_the_interaction_in_parts_equals_one_pass_and_the_reference():
    """``jctr_cpu_pair_dots`` and its gradient over 3,000 samples (several parts of samples):
    the same bits on the helpers, on one thread and in a child process; the reference's values."""
    from jctr.ops.interaction import pair_dots_xla

    rng = np.random.default_rng(5)
    feats = jnp.asarray(rng.normal(size=(3000, 27, 16)).astype(np.float32))
    grad = jnp.asarray(rng.normal(size=(3000, 27 * 26 // 2)).astype(np.float32))

    def both(feats, grad):
        dots, pull = jax.vjp(cpu_ffi.pair_dots, feats)
        return dots, pull(grad)[0]

    ways = _three_ways(jax.jit(both), feats, grad)
    for got in ways[1:]:
        for a, b in zip(ways[0], got):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    np.testing.assert_allclose(ways[0][0], np.asarray(pair_dots_xla(feats)), rtol=1e-5,
                               atol=1e-4)


def test_the_lookup_in_parts_equals_the_reference():
    """``jctr_cpu_hash_lookup`` over 100k keys (half in the table, some invalid): the same
    slots on the helpers, on one thread, in a child process and with helpers that never come,
    and the XLA formulation's."""
    from jctr.embedding.hash_table import num_slots_for
    from jctr.ops.hashing import find_slots

    rng = np.random.default_rng(9)
    held = rng.choice(1 << 40, 60_000, replace=False).astype(np.int64)
    table, _ = find_slots(jnp.full((num_slots_for(60_000),), -1 << 63, jnp.int64),
                          jnp.asarray(held), jnp.ones(held.size, bool), insert=True)
    keys = np.where(rng.random(100_000) < 0.5, rng.choice(held, 100_000),
                    rng.integers(1 << 41, 1 << 42, 100_000))
    valid = rng.random(100_000) < 0.95
    ways = _three_ways(jax.jit(lambda t, k, v: (cpu_ffi.lookup_slots(t, k, v),)), table, keys,
                       valid)
    want = np.asarray(find_slots(table, jnp.asarray(keys), jnp.asarray(valid), insert=False)[1])
    for got in ways:
        np.testing.assert_array_equal(got[0], want)


def test_threads_starting_the_helpers_at_once_start_one_pool():
    """Eight Python threads asking for the helpers at once (a server's threads tracing their
    first steps) start one pool of the count asked for, not one each (a fresh process)."""
    import subprocess
    import sys

    code = """
import os, threading
import numba
from jctr.ops import cpu_ffi, cpu_parts
# the helpers' function compiled first (loading it may start threads of its own)
cpu_parts._helper_function = cpu_parts.cfunc(cpu_parts._helper,
                                             numba.types.voidptr(numba.types.voidptr))
before = len(os.listdir('/proc/self/task'))
threads = [threading.Thread(target=cpu_parts.start_helpers, args=(2,)) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
import time
for _ in range(50):  # a joined thread may still be leaving the kernel's task list
    added = len(os.listdir('/proc/self/task')) - before
    if added <= 2:
        break
    time.sleep(0.1)
print(int(cpu_parts._POOL[cpu_parts._HELPERS]), added)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JCTR_KERNEL_THREADS": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "2"]


@pytest.mark.parametrize("dedupe,lean", [(True, False), (False, True), (False, False)])
def test_a_training_lookup_in_pieces_equals_one_pass(dedupe, lean):
    """``jctr_cpu_find_assign`` over batches of 60,000 positions (pieces of 8,192 probed on
    the helpers while the calling thread runs the pass over the pieces before: a part may
    see keys and rows an earlier piece inserted) gives the bits of the one pass (no helpers,
    or a forked child's view): the slots, rows, representatives, new keys, grants, counts and
    the table's arrays. Batch after batch into a table of 40,000 rows in 65,536 slots (the
    slots filling up: probes passing full buckets, then sweeping the table), repeats within
    a batch, invalid positions, tombstones, the rows running out (refused keys keep slots
    without a row): with
    dedupe (Adam: each slot's first position its representative), lean (plain SGD) and as an
    evicting table without dedupe (slots and new keys written, no representatives)."""
    from jctr.embedding.hash_table import TOMBSTONE
    from jctr.ops.hashing import EMPTY_KEY

    rng = np.random.default_rng(int(dedupe) + 2 * int(lean))
    capacity, num_slots, n = 40_000, 1 << 16, 60_000
    state = [np.full(num_slots, EMPTY_KEY, np.int64), np.full(num_slots, -1, np.int32),
             np.zeros(num_slots, np.int32)]
    free_rows = np.zeros(capacity, np.int32)
    free_rows[:3] = [9, 4, 17]
    size, free_count = np.int32(30), np.int32(3)
    fn = jax.jit(lambda *a: [x for x in cpu_ffi.find_assign(*a, capacity, dedupe, lean)
                             if x is not None])
    for step in range(5):  # slots 38%, 70%, 98%, then full (probes sweep the table)
        # a power law's repeats over a pool that outgrows the rows
        keys = ((rng.zipf(1.1, n) % 400_000) * 7919).astype(np.int64)
        valid = rng.random(n) < 0.95
        if step == 2:  # some slots erased (their keys' rows stay unused)
            held = np.flatnonzero(state[0] != EMPTY_KEY)
            state[0][rng.choice(held, 300, replace=False)] = TOMBSTONE
        ways = _three_ways(fn, *state, free_rows, size, free_count, keys, valid)
        for got in ways[1:]:
            for i, (a, b) in enumerate(zip(ways[0], got)):
                np.testing.assert_array_equal(a, b, err_msg=(step, i))
        out = ways[0]
        state = [out[0].copy(), out[1 if lean else 2], out[2 if lean else 3]]
        size, free_count = out[-3], out[-2]
    assert int(size) == capacity and int(free_count) == 0  # the rows ran out
    assert int(out[-1][2]) > 0  # and the slots: keys found none
