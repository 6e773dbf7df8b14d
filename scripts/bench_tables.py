"""Embedding tables that live: lookup+insert of fresh keys against a plain gather of the same
rows, and eviction under a stream of new keys against the same table with room to spare,
measured in one run (issue 36).

Every timed step gets a batch it has not seen (made before the timing): keys drawn uniformly
or by a power law (alpha 1.2) over ``--vocab`` keys, so new keys keep arriving as in real
data. A step is the training lookup of :func:`jctr.embedding.sparse_embedding.lookup_keys`
(find, insert, initial vectors of new rows; with eviction the choice of victims, the reset of
their optimizer rows and the scores) plus the gather of the rows' vectors.

1. Lookup+insert: a table of ``--capacity`` rows whose slots are 50% and 85% full at the end
   of the timed steps (85%: every row in use; slots in buckets of eight, about 1.18 a row),
   against
   ``np.take`` of as many random rows of a values array of the same size (the memory's
   limit for the same bytes; on an accelerator the same gather jitted in its memory).
2. Eviction: the table full, policy ``lru`` (``--policy``), against the same stream
   through a table with room for every key of the run, over ``--evict-steps`` steps (long
   enough for the table's own upkeep to be in the mean). Ratio: steps/s evicting over
   steps/s with room (goal >= 0.8x).
3. With ``--spill-steps N``: the full table spilling its evicted rows (vector, Adam's
   moments, slot) to a temporary folder (``"eviction": {..., "spill": ...}``, RocksDB, then
   ``"spill_type": "row_file"``) and taking back the rows of keys that return, over the first
   ``N`` steps of the same stream, against the same table evicting in memory and with room.

Steady state: the first configuration runs once untimed before any is timed (the process's
first table paid the first touch of its memory in its first steps).

    python scripts/bench_tables.py
    python scripts/bench_tables.py --capacity 4000000 --batch 212992 --steps 20
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jctr._x64  # noqa: E402,F401  (64-bit keys)
from jctr.runtime.host_memory import reexec_with_malloc_tuning  # noqa: E402
from scripts.bench_hps import cpu_name  # noqa: E402


def batches(kind: str, steps: int, n: int, vocab: int, seed: int) -> list[np.ndarray]:
    """``steps`` fresh key batches (int64 [n])."""
    from jctr.data.tools.synthetic import power_law_ranks

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ranks = (rng.integers(0, vocab, n) if kind == "uniform"
                 else power_law_ranks(rng, n, vocab, 1.2))
        out.append((ranks.astype(np.int64) * 2654435761 + 17) % (1 << 62))  # spread keys
    return out


def make_step(spec):
    from jctr.embedding.sparse_embedding import lookup_keys

    def step(state, keys):
        valid = jnp.ones(keys.shape, bool)
        state, lk = lookup_keys(spec, state, keys, valid, jnp.zeros(keys.shape, jnp.int32),
                                train=True)
        rows = jnp.where(lk.rows >= 0, lk.rows, 0)
        return state, jnp.sum(jnp.take(state.values, rows, axis=0))

    return jax.jit(step, donate_argnums=0)


def spec_of(capacity: int, dim: int, eviction):
    from jctr.config.schema import OptimizerConfig
    from jctr.embedding.sparse_embedding import EmbeddingSpec

    return EmbeddingSpec("t", capacity=capacity, dim=dim, slot_num=1, max_features=1,
                         one_hot=True, input_index=0,
                         optimizer=OptimizerConfig("Adam", update_type="Local"),
                         eviction=eviction)


def fill(step, state, capacity: int, rows: int, batch: int):
    """Insert ``rows`` distinct keys (outside the benchmark's key range)."""
    keys = -np.arange(1, rows + 1, dtype=np.int64)
    for s in range(0, rows, batch):
        part = np.full(batch, keys[s], np.int64)
        part[:min(batch, rows - s)] = keys[s:s + batch]
        state, _ = step(state, jnp.asarray(part))
    return state


def timed(step, state, feed: list[np.ndarray]) -> tuple[float, object, float]:
    """Mean seconds per step over ``feed`` (the first step, the compile, not counted; the
    mean, not the median: a step that builds the slots again is part of the cost), the state
    after it and the slowest step."""
    state, out = step(state, jnp.asarray(feed[0]))
    jax.block_until_ready(out)
    ts = []
    for keys in feed[1:]:
        dev = jnp.asarray(keys)
        jax.block_until_ready(dev)
        t = time.perf_counter()
        state, out = step(state, dev)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t)
    if os.environ.get('BENCH_TABLES_STEPS'):
        print(' '.join(f'{t * 1e3:.0f}' for t in ts))
    return float(np.mean(ts)), state, float(np.max(ts))


def spill_run(kind: str, args, cap: int, n: int, feed, s_full: float, s_room: float) -> None:
    """The full table spilling to RocksDB, then to row files, over ``feed`` (its first step
    untimed)."""
    import dataclasses
    import tempfile

    from jctr.config.schema import EvictionConfig
    from jctr.embedding import spill
    from jctr.embedding.sparse_embedding import init_embedding

    for spill_type in ("rocks_db", "row_file"):
        with tempfile.TemporaryDirectory(prefix="bench_spill_") as folder:
            ev = dataclasses.replace(EvictionConfig(args.policy), spill=folder,
                                     spill_type=spill_type)
            spec = spec_of(cap, args.dim, ev)
            spilling = make_step(spec)
            state = fill(spilling, init_embedding(spec), cap, cap, n)
            spill.forget([spec])
            s, state, slowest = timed(spilling, state, feed)
            evicted = int(state.table.evicted)
            del state
        print(f"[{kind}] eviction spilling ({spill_type}), table of {cap:,} rows full: "
              f"{s * 1e3:.1f} ms/step, slowest {slowest * 1e3:.0f} ms over {len(feed) - 1} "
              f"steps ({evicted:,} rows spilled); in memory {s_full * 1e3:.1f} ms/step "
              f"({s_full / s:.2f}x), with room {s_room * 1e3:.1f} ms/step ({s_room / s:.2f}x)")


def main() -> int:
    from jctr.config.schema import EvictionConfig
    from jctr.embedding.hash_table import num_slots_for
    from jctr.embedding.sparse_embedding import init_embedding

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=106_496, help="keys per step (4096 x 26)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=100_000_000)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--evict-steps", type=int, default=40,
                    help="steps of the eviction runs (a uniform stream through the default "
                         "table leaves a tombstone for ~1 in 50 evicted keys: its slots are "
                         "built again, when tombstones pass 15%% of them, after ~300 steps)")
    ap.add_argument("--spill-steps", type=int, default=0,
                    help="also time this many steps of the full table spilling to RocksDB")
    args = ap.parse_args()
    # the same host memory setting as `python -m jctr.train` (JCTR_HOST_MEMORY_TUNING=0: off);
    # np.take's baseline runs under it too
    reexec_with_malloc_tuning([os.path.abspath(__file__), *sys.argv[1:]])
    device = cpu_name() if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    print(f"{jax.default_backend().upper()}: {device}; jax {jax.__version__}; "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    cap, n = args.capacity, args.batch
    rng = np.random.default_rng(0)
    values = rng.random((cap, args.dim), dtype=np.float32)

    def np_gather():
        idx = rng.integers(0, cap, n)
        t = time.perf_counter()
        np.take(values, idx, axis=0).sum()
        return time.perf_counter() - t

    def device_gather():  # an accelerator's baseline: the same gather in its own memory
        idx = jax.block_until_ready(jnp.asarray(rng.integers(0, cap, n)))
        t = time.perf_counter()
        jax.block_until_ready(take_sum(device_values, idx))
        return time.perf_counter() - t

    on_cpu = jax.default_backend() == "cpu"
    if not on_cpu:
        device_values = jnp.asarray(values)
        take_sum = jax.jit(lambda v, i: jnp.take(v, i, axis=0).sum())
        device_gather()  # compile
    gather = float(np.median([(np_gather if on_cpu else device_gather)() for _ in range(9)]))
    base = "np.take" if on_cpu else "a device gather"
    for kind in ("uniform", "power-law"):
        feed = batches(kind, args.steps, n, args.vocab, seed=1)
        plain = make_step(spec_of(cap, args.dim, None))
        slots = num_slots_for(cap)
        arriving = np.unique(np.concatenate(feed)).size  # keys the timed steps insert
        # the process's first table paid the first touch of its memory in its first steps
        # (steps of 30, 19 and 33 ms among 6 ms ones; the same table again, 5 ms from the
        # first step: docs/performance.md), a cost a long run pays once: the first
        # configuration runs once untimed
        runs = [(0.5, False)] if kind == "uniform" else []
        for load, report in runs + [(0.5, True), (0.85, True)]:  # of the slots, at the end
            keys_at_end = min(cap, int(load * slots))
            state = fill(plain, init_embedding(spec_of(cap, args.dim, None)), cap,
                         keys_at_end - arriving, n)
            s, state, _ = timed(plain, state, feed)
            if not report:
                del state
                continue
            held = int(state.table.size)
            print(f"[{kind}] lookup+insert, slots {held / slots:.0%} full at the end "
                  f"({held:,} keys in {slots:,} slots; {slots * 16 / cap:.1f} slot bytes a "
                  f"row), {n:,} keys/step: {s * 1e3:.1f} ms; {base} of as many rows "
                  f"{gather * 1e3:.1f} ms: ratio {gather / s:.2f}")
            del state
        ev = EvictionConfig(args.policy)
        # a table that lives evicts for as long as it trains: enough steps for what piles up
        # (tombstones, and the slots built again when they crowd) to be part of the mean
        feed = batches(kind, args.evict_steps, n, args.vocab, seed=2)
        evicting = make_step(spec_of(cap, args.dim, ev))
        state = fill(evicting, init_embedding(spec_of(cap, args.dim, ev)), cap, cap, n)
        s_full, state, slowest = timed(evicting, state, feed)
        evicted = int(state.table.evicted)
        refused = int(state.table.overflow)
        tombstones = int(state.table.tombstones)
        del state
        room = cap + n * args.evict_steps
        roomy = make_step(spec_of(room, args.dim, ev))
        state = fill(roomy, init_embedding(spec_of(room, args.dim, ev)), room, cap, n)
        s_room, state, _ = timed(roomy, state, feed)
        del state
        print(f"[{kind}] eviction ({args.policy}), table of {cap:,} rows full: "
              f"{s_full * 1e3:.1f} ms/step, slowest {slowest * 1e3:.0f} ms ({evicted:,} "
              f"evicted, {refused:,} refused in {args.evict_steps - 1} steps; {tombstones:,} "
              f"tombstones at the end); with room: {s_room * 1e3:.1f} ms/step: "
              f"ratio {s_room / s_full:.2f}")
        if args.spill_steps:
            spill_run(kind, args, cap, n, feed[:args.spill_steps + 1], s_full, s_room)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
