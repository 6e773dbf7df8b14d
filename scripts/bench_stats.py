"""Streaming training's feature statistics (show, click, unseen days, delta score per key) in
memory against in mapped files, measured in one run: what a table larger than memory keeps
beside its rows (``sparse_store``), ~45 bytes a key.

A day is ``--passes`` passes of ``--batches`` fresh batches (``--batch`` key occurrences each,
drawn uniformly or by a power law over ``--vocab`` keys; the days drift over the vocabulary,
so new keys keep arriving), added as a pass's reader adds them
(:meth:`FeatureStats.observe`), then a delta save after each pass, the day's shrink, base save
and ageing. Each way runs in a process of its own (the two alternate ``--rounds`` times), each
timed part its median; printed: seconds of each part, the ratio files / memory, and the
process's anonymous memory at the end (``RssAnon``: what the operating system cannot page
out to a file) beside its mapped file pages (``RssFile``).

    python scripts/bench_stats.py
    python scripts/bench_stats.py --vocab 200000000 --days 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PARTS = ("observe", "delta", "shrink", "base", "changes")


def rss() -> dict[str, int]:
    """RssAnon and RssFile of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                out[name] = int(value.split()[0]) << 10
    return out


def one_way(args, mapped: bool) -> dict:
    """Every day of the stream through one FeatureStats; seconds per part, memory."""
    from jctr.data.tools.synthetic import power_law_ranks
    from jctr.online.feature_stats import FeatureStats, ShrinkRule

    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        stats = FeatureStats(files=folder if mapped else None, in_memory_bytes=0)
        times = {p: 0.0 for p in PARTS}
        for day in range(args.days):
            for _ in range(args.passes):
                for _ in range(args.batches):  # made outside the timing
                    n = args.batch
                    ranks = (rng.integers(0, args.vocab, n) if args.keys == "uniform"
                             else power_law_ranks(rng, n, args.vocab, 1.2))
                    keys = (ranks.astype(np.int64) + day * args.vocab // 4) * 2654435761 % (
                        1 << 62)
                    clicks = rng.random(n) < 0.05
                    t = time.perf_counter()
                    stats.observe(keys, show=1.0, click=clicks)
                    times["observe"] += time.perf_counter() - t
                t = time.perf_counter()
                stats.delta_keys(0.0, 0.0, 7)
                times["delta"] += time.perf_counter() - t
            t = time.perf_counter()
            stats.shrink(ShrinkRule(show_click_decay_rate=0.98, delete_threshold=0.02,
                                    delete_after_unseen_days=7))
            times["shrink"] += time.perf_counter() - t
            t = time.perf_counter()
            stats.base_keys(0.0, 7)
            stats.age()
            stats.mark_base()
            times["base"] += time.perf_counter() - t
            t = time.perf_counter()
            stats.changes()
            times["changes"] += time.perf_counter() - t
        out = {"times": times, "keys": len(stats), "mapped": stats.mapped, **rss()}
        stats.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=40_000_000)
    ap.add_argument("--days", type=int, default=3)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keys", choices=("uniform", "power-law", "both"), default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--folder", default=None, help="where the mapped files go (default: the "
                    "system's temporary folder)")
    ap.add_argument("--one", choices=("memory", "files"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a child: one way, its figures as JSON
        print(json.dumps(one_way(args, args.one == "files")))
        return 0
    from scripts.bench_hps import cpu_name

    print(f"CPU: {cpu_name()}")
    for kind in (("uniform", "power-law") if args.keys == "both" else (args.keys,)):
        runs = {"memory": [], "files": []}
        for r in range(args.rounds):
            for way in (("memory", "files") if r % 2 == 0 else ("files", "memory")):
                cmd = [sys.executable, os.path.abspath(__file__), "--one", way, "--keys", kind,
                       *[f"--{k}={getattr(args, k)}" for k in ("vocab", "days", "passes",
                                                               "batches", "batch", "seed")]]
                if args.folder:
                    cmd.append(f"--folder={args.folder}")
                res = subprocess.run(cmd, check=True, capture_output=True, text=True)
                runs[way].append(json.loads(res.stdout.strip().splitlines()[-1]))
        med = {way: {p: statistics.median(x["times"][p] for x in rs) for p in PARTS}
               for way, rs in runs.items()}
        keys = runs["memory"][0]["keys"]
        assert all(x["keys"] == keys for rs in runs.values() for x in rs)
        total = {way: sum(m.values()) for way, m in med.items()}
        print(f"[{kind}] {args.days} days x {args.passes} passes x {args.batches} batches of "
              f"{args.batch:,} occurrences, {keys:,} keys at the end:")
        for p in PARTS:
            print(f"  {p:8s} memory {med['memory'][p]:7.2f} s  files {med['files'][p]:7.2f} s"
                  f"  ratio {med['files'][p] / max(med['memory'][p], 1e-9):.2f}")
        print(f"  all      memory {total['memory']:7.2f} s  files {total['files']:7.2f} s  "
              f"ratio {total['files'] / total['memory']:.2f}")
        for way in ("memory", "files"):
            x = runs[way][-1]
            print(f"  {way}: RssAnon {x['RssAnon'] / 2**20:,.0f} MiB, RssFile "
                  f"{x['RssFile'] / 2**20:,.0f} MiB at the end (mapped: {x['mapped']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
