"""What a run and a server that live for months pay again and again, against what they paid
before, in one run:

1. A streaming pass's checkpoint writes its statistics (``feature_stats.npz``): every key's
   (before) against the rows changed since the day's batch model
   (:meth:`jctr.online.feature_stats.FeatureStats.changes`, what a pass writes now), for a
   table of ``--keys`` keys of which ``--daily`` were pushed today (fresh random keys, a
   delta model taken meanwhile). The file is written as the runner writes it (``np.savez``
   through :class:`jctr.runtime.direct_io.DirectWriter`).
2. ``serve`` names the export a database holds by the SHA-256 of its model files: a start
   that hashes every file (before; a first start) against one that takes the digests its
   last load recorded (:func:`jctr.serving.table_manifest.remember`), for a model of
   ``--rows`` rows of 16 floats (random, written once; the files then left 2 s, past the
   racy window).

Prints seconds (median of ``--rounds``) and before / now.

    python scripts/bench_long_run.py
    python scripts/bench_long_run.py --keys 30000000 --daily 3000000 --rows 40000000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from scripts.bench_hps import cpu_name  # noqa: E402


def _median_s(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def statistics_part(args, folder: str) -> None:
    from jctr.online.feature_stats import FeatureStats
    from jctr.runtime.direct_io import DirectWriter

    rng = np.random.default_rng(0)
    stats = FeatureStats(expected_keys=args.keys)
    keys = rng.integers(1, 1 << 62, args.keys, dtype=np.int64)
    for s in range(0, keys.size, 1 << 22):  # the days before: every key pushed
        stats.observe(keys[s:s + (1 << 22)], 1.0, 0.0)
    stats.base_keys(0.0, 16)  # the day's end: the base model, the keys age, the batch model
    stats.age()
    stats.mark_base()
    today = rng.choice(keys, args.daily, replace=False)
    stats.observe(today, 1.0, (rng.random(today.size) < 0.1).astype(np.float64))
    stats.delta_keys(0.0, 0.0, 16)

    def save(arrays_of):
        def run():
            with DirectWriter(os.path.join(folder, "feature_stats.npz")) as f:
                np.savez(f, **{f"0/{k}": v for k, v in arrays_of().items()})
        return run

    whole = _median_s(save(stats.state_dict), args.rounds)
    size_whole = os.path.getsize(os.path.join(folder, "feature_stats.npz"))
    changes = _median_s(save(stats.changes), args.rounds)
    size_changes = os.path.getsize(os.path.join(folder, "feature_stats.npz"))
    print(f"[statistics] {args.keys:,} keys, {args.daily:,} pushed today: a pass's file "
          f"every key {whole:.2f} s, {size_whole / 1e6:,.0f} MB; the changes since the "
          f"day's batch model {changes:.2f} s, {size_changes / 1e6:,.0f} MB: "
          f"{whole / changes:.1f}x the time, {size_whole / size_changes:.1f}x the bytes")


def manifest_part(args, folder: str) -> None:
    from jctr.serving import table_manifest

    rng = np.random.default_rng(1)
    sparse = os.path.join(folder, "sparse.model")
    os.makedirs(sparse)
    dense = os.path.join(folder, "dense.model")
    rng.random(1 << 18, dtype=np.float32).tofile(dense)
    step = 1 << 22
    with open(os.path.join(sparse, "key"), "wb") as k, \
            open(os.path.join(sparse, "emb_vector"), "wb") as v:
        for s in range(0, args.rows, step):
            n = min(step, args.rows - s)
            np.arange(s, s + n, dtype=np.int64).tofile(k)
            rng.random(n * 16, dtype=np.float32).tofile(v)
    time.sleep(table_manifest.RACY_NS / 1e9 + 0.1)  # past the racy window
    gb = (os.path.getsize(os.path.join(sparse, "emb_vector")) + 8 * args.rows) / 1e9

    def manifest():
        return table_manifest.table_manifest(dense, sparse, rows=args.rows, dim=16)

    def cold():
        table_manifest._digests.clear()  # a new process
        return manifest()

    hashed = _median_s(cold, args.rounds)
    stored = cold()  # what the last load or start recorded

    def recorded():
        table_manifest._digests.clear()
        table_manifest.remember(stored)
        assert manifest()["identity"] == stored["identity"]

    taken = _median_s(recorded, args.rounds)
    print(f"[serve start] a model of {args.rows:,} rows ({gb:.2f} GB): every file hashed "
          f"{hashed:.2f} s; the recorded digests taken {taken * 1e3:.1f} ms: "
          f"{hashed / max(taken, 1e-9):,.0f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=10_000_000)
    ap.add_argument("--daily", type=int, default=1_000_000)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}")
    with tempfile.TemporaryDirectory(prefix="bench_long_run_") as folder:
        statistics_part(args, folder)
    with tempfile.TemporaryDirectory(prefix="bench_long_run_") as folder:
        manifest_part(args, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
