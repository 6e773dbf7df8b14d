"""An experiment for issue 36's "one access": a hash table whose buckets hold their keys, rows
and scores side by side against jctr's table today (keys, rows and scores in three arrays),
measured in one run with the same minimal kernels on both layouts.

jctr's table (:mod:`jctr.embedding.hash_table`) keeps ``slot_keys`` int64, ``slot_rows`` int32
and ``slot_score`` int32 in arrays of their own: a key's bucket of eight is a cache line of
each, so a cold key costs its keys' line and its rows' line (and an evicting table's scores'
line) -- lines in three places of memory. The layout tried here puts a bucket in 128 bytes:
eight keys (one line), then eight rows and eight scores (the next line; Intel's and AMD's
spatial prefetchers fetch such a pair together).

Both sides run the same numba kernel shape (each key's home hashed once and its lines fetched
24 keys ahead, the bucket compared in one vector compare from :mod:`jctr.ops.cpu_ffi`), doing
only what both layouts need:

1. find-or-insert (a new key takes the first empty slot of its probe and the next row): of a
   10-hot DLRM batch of ``scripts/bench_train.py`` (2.1M keys, Kaggle's 26 slots capped at 1M
   rows, uniform) into a table of its capacity after ten batches, and of
   ``scripts/bench_tables.py``'s fresh keys (106,496 a step, uniform and power-law) into a
   2M-row table ending 50% and 85% full;
2. an eviction's choice (each new key's home bucket: the lowest LRU score not of this step
   gives its slot to the new key in place) in a full table of 2M rows in 4M slots.

Each call gets a copy of the same table state (made before its timing, then 768 MB written
over so that the table is not in the caches, as in a training step); the two layouts
alternate. Printed: each median and the ratio side by side / apart (below 1: the layout tried
is faster). The figures are an estimate of what the layout would change: jctr's kernels do
more (representatives, the rows' bookkeeping, eviction rounds).

    python scripts/bench_layout.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jctr._x64  # noqa: E402,F401  (64-bit keys)
from jctr.runtime.host_memory import reexec_with_malloc_tuning  # noqa: E402

EMPTY = np.int64(np.iinfo(np.int64).min)
AHEAD = 24  # keys between a home's prefetch and its probe (jctr.ops.cpu_ffi._AHEAD)
EVICT_AHEAD = 8  # (jctr.ops.cpu_ffi._EVICT_AHEAD)
FAR = np.int64(1) << 62


def kernels():
    """The four kernels (numba), compiled on first use."""
    import numba

    from jctr.ops import cpu_ffi

    bucket_code, prefetch = cpu_ffi._bucket_code, cpu_ffi._prefetch

    @numba.njit(inline="always")
    def home(key, buckets):  # the key's bucket, as jctr's table finds it
        return cpu_ffi._home(key, buckets, 1)

    @numba.njit
    def insert_apart(slot_keys, slot_rows, keys, rows, size):
        slots = slot_keys.shape[0]
        buckets, n = slots // 8, keys.shape[0]
        keys_at, rows_at = slot_keys.ctypes.data, slot_rows.ctypes.data
        homes = np.empty(32, np.int64)
        for i in range(min(AHEAD, n)):
            homes[i] = home(keys[i], buckets) * 8
        for i in range(n):
            if i + AHEAD < n:
                h = home(keys[i + AHEAD], buckets) * 8
                homes[(i + AHEAD) & 31] = h
                prefetch(keys_at + 8 * h)
                prefetch(rows_at + 4 * h)
            pos, key = homes[i & 31], keys[i]
            while True:
                code = bucket_code(keys_at + 8 * pos, key)
                if code & 15 < 8:
                    s = pos + (code & 15)
                    if not code & 16:
                        slot_keys[s] = key
                        slot_rows[s] = size
                        size += 1
                    rows[i] = slot_rows[s]
                    break
                pos += 8
                if pos == slots:
                    pos = 0
        return size

    @numba.njit
    def insert_together(table, keys, rows, size):
        # table int64 [buckets, 16]: keys in words 0-7; rows (int32 16-23) and scores (int32
        # 24-31) in words 8-15
        buckets, n = table.shape[0], keys.shape[0]
        at = table.ctypes.data
        words = table.view(np.int32).reshape(buckets, 32)
        homes = np.empty(32, np.int64)
        for i in range(min(AHEAD, n)):
            homes[i] = home(keys[i], buckets)
        for i in range(n):
            if i + AHEAD < n:
                b = home(keys[i + AHEAD], buckets)
                homes[(i + AHEAD) & 31] = b
                prefetch(at + 128 * b)
                prefetch(at + 128 * b + 64)
            b, key = homes[i & 31], keys[i]
            while True:
                code = bucket_code(at + 128 * b, key)
                if code & 15 < 8:
                    j = code & 15
                    if not code & 16:
                        table[b, j] = key
                        words[b, 16 + j] = size
                        size += 1
                    rows[i] = words[b, 16 + j]
                    break
                b += 1
                if b == buckets:
                    b = 0
        return size

    @numba.njit
    def evict_apart(slot_keys, slot_rows, score, keys, rows, clock):
        buckets, n = slot_keys.shape[0] // 8, keys.shape[0]
        keys_at, rows_at, score_at = slot_keys.ctypes.data, slot_rows.ctypes.data, \
            score.ctypes.data
        for i in range(n):
            if i + EVICT_AHEAD < n:
                h = home(keys[i + EVICT_AHEAD], buckets) * 8
                prefetch(keys_at + 8 * h)
                prefetch(rows_at + 4 * h)
                prefetch(score_at + 4 * h)
            h = home(keys[i], buckets) * 8
            best, lowest = -1, FAR
            for k in range(8):
                s = np.int64(score[h + k])
                if slot_rows[h + k] >= 0 and s != clock and s < lowest:
                    best, lowest = h + k, s
            rows[i] = -1
            if best >= 0:
                slot_keys[best] = keys[i]
                score[best] = clock
                rows[i] = slot_rows[best]

    @numba.njit
    def evict_together(table, keys, rows, clock):
        buckets, n = table.shape[0], keys.shape[0]
        at = table.ctypes.data
        words = table.view(np.int32).reshape(buckets, 32)
        for i in range(n):
            if i + EVICT_AHEAD < n:
                b = home(keys[i + EVICT_AHEAD], buckets)
                prefetch(at + 128 * b)
                prefetch(at + 128 * b + 64)
            b = home(keys[i], buckets)
            best, lowest = -1, FAR
            for k in range(8):
                s = np.int64(words[b, 24 + k])
                if words[b, 16 + k] >= 0 and s != clock and s < lowest:
                    best, lowest = k, s
            rows[i] = -1
            if best >= 0:
                table[b, best] = keys[i]
                words[b, 24 + best] = clock
                rows[i] = words[b, 16 + best]

    return insert_apart, insert_together, evict_apart, evict_together


def aligned(shape, dtype, fill=0) -> np.ndarray:
    """An array whose data starts on a 4096-byte boundary, as XLA's buffers start on 64-byte
    ones (numpy's may start 16 bytes past one: every bucket would straddle lines)."""
    dtype = np.dtype(dtype)
    raw = np.empty(int(np.prod(shape)) * dtype.itemsize + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    out = raw[start:start + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
    out[...] = fill
    return out


def copy(a: np.ndarray) -> np.ndarray:
    out = aligned(a.shape, a.dtype)
    out[...] = a
    return out


def together(slot_keys, slot_rows, score):
    """The same table laid out by bucket."""
    buckets = slot_keys.size // 8
    table = aligned((buckets, 16), np.int64)
    table[:, :8] = slot_keys.reshape(buckets, 8)
    words = table.view(np.int32).reshape(buckets, 32)
    words[:, 16:24] = slot_rows.reshape(buckets, 8)
    words[:, 24:32] = score.reshape(buckets, 8)
    return table


# written over between calls: a table is out of the caches when a training step's lookup
# starts (the step's other work has been through them), not where its copy left it
SCRUB = np.zeros((768 << 20) // 8, np.int64)


def alternate(apart, side_by_side, state_apart, state_together, feed, rounds):
    """Medians (ms) of the two calls over ``rounds`` passes over ``feed``, each call on a copy
    of its state with the caches scrubbed after the copy, the order swapped every round."""
    times = {"apart": [], "together": []}
    calls = {"apart": (apart, state_apart), "together": (side_by_side, state_together)}
    for r in range(rounds):
        for keys in feed:
            for name in (("apart", "together") if r % 2 == 0 else ("together", "apart")):
                fn, state = calls[name]
                copies = [copy(a) for a in state]
                SCRUB[::8] += 1  # a word a cache line
                t = time.perf_counter()
                fn(*copies, keys)
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def report(label, ms):
    print(f"{label}: apart {ms['apart']:.2f} ms, side by side {ms['together']:.2f} ms: "
          f"ratio {ms['together'] / ms['apart']:.2f}", flush=True)


def main() -> int:
    reexec_with_malloc_tuning([os.path.abspath(__file__), *sys.argv[1:]])
    from scripts import bench_tables, bench_train
    from scripts.bench_hps import cpu_name

    insert_apart, insert_together, evict_apart, evict_together = kernels()
    print(f"CPU: {cpu_name()}")
    rounds = 8

    def inserting(batches, slots, warm):
        """Tables after ``warm`` batches, then the medians of inserting the next ones."""
        slot_keys, slot_rows = aligned(slots, np.int64, EMPTY), aligned(slots, np.int32, -1)
        table = together(slot_keys, slot_rows, aligned(slots, np.int32))
        rows = np.empty(max(b.size for b in batches), np.int32)
        size = size2 = 0
        for keys in batches[:warm]:
            size = insert_apart(slot_keys, slot_rows, keys, rows[:keys.size], size)
            size2 = insert_together(table, keys, rows[:keys.size], size2)
        assert size == size2
        feed = batches[warm:]
        return alternate(lambda k, r, ks: insert_apart(k, r, ks, rows[:ks.size], size),
                         lambda t, ks: insert_together(t, ks, rows[:ks.size], size),
                         (slot_keys, slot_rows), (table,), feed, rounds)

    # 1. a 10-hot DLRM batch into its table (bench_train's 26 slots: 5.57M rows, 6.55M slots)
    made = bench_train.make_batches(12, 8192, 10, keys="uniform")
    batches = [bench_train.jctr_batch(*m).keys[0] for m in made]
    report("find-or-insert, 10-hot uniform DLRM batches (2,129,920 keys)",
           inserting(batches, 6_552_120, 10))
    # bench_tables' fresh keys into a 2M-row table ending 50% / 85% full
    slots = 2_352_944
    for kind in ("uniform", "power-law"):
        feed = bench_tables.batches(kind, 4, 106_496, 100_000_000, seed=1)
        arriving = np.unique(np.concatenate(feed)).size
        for load in (0.5, 0.85):
            held = int(load * slots) - arriving
            filler = -np.arange(1, held + 1, dtype=np.int64)  # keys outside the stream's
            warm = [filler[s:s + 106_496] for s in range(0, held, 106_496)]
            report(f"find-or-insert, {kind} fresh keys, 106,496 a step, slots {load:.0%} full "
                   "at the end", inserting(warm + feed, slots, len(warm)))
    # 2. eviction's choice in a full table: 2M keys in 4M slots, LRU scores of 40 steps
    rng = np.random.default_rng(0)
    cap, slots = 2_000_000, 4_000_000
    slot_keys, slot_rows = aligned(slots, np.int64, EMPTY), aligned(slots, np.int32, -1)
    score = aligned(slots, np.int32)
    at = rng.permutation(slots)[:cap]
    slot_keys[at] = rng.integers(1, 1 << 62, cap)
    slot_rows[at] = np.arange(cap, dtype=np.int32)
    score[at] = rng.integers(0, 40, cap)
    table = together(slot_keys, slot_rows, score)
    rows = np.empty(106_496, np.int32)
    for kind in ("uniform", "power-law"):
        feed = bench_tables.batches(kind, 4, 106_496, 100_000_000, seed=1)
        report(f"eviction's choice in the home bucket, {kind} keys",
               alternate(lambda k, r, s, ks: evict_apart(k, r, s, ks, rows, 41),
                         lambda t, ks: evict_together(t, ks, rows, 41),
                         (slot_keys, slot_rows, score), (table,), feed, rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
