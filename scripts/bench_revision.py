"""This tree against a git revision, measured in one process: the training step of
``scripts/bench_train.py`` or a table step of ``scripts/bench_tables.py`` of both trees,
interleaved on the same batches.

Two processes run a step 5-20% apart on a shared VM (its neighbours' memory traffic moves
from minute to minute), which hides a change of a few percent; steps of both trees taken
in turns in one process meet the same drift. The revision's ``jctr`` is exported
(``git archive``) into ``/tmp/jctr-revision-<commit>`` as the package ``jctr_rev`` (its
native kernels' XLA targets renamed, so that both trees register theirs), once per commit.

Printed: each tree's step (median over the rounds for training, mean for tables, as their
benchmarks report), the ratio this tree / the revision (below 1: this tree is faster) and
the ratio of each round's pair, so that the spread shows. The harness has a spread of its
own: run the revision against itself first (``HEAD`` with a clean tree). On a shared
2-core VM such runs read 0.99-1.04 over 6-20 rounds, and once 1.25 over 4 rounds of
``evict-room`` (whose new rows are memory touched for the first time in the timed steps):
take 10 rounds or more.

    python scripts/bench_revision.py HEAD train --hot 10 --keys uniform
    python scripts/bench_revision.py HEAD~3 tables --table evict --keys uniform
    python scripts/bench_revision.py HEAD train --hot 10 --optimizer adam
    python scripts/bench_revision.py HEAD tables --table insert --load 0.85 --keys power-law
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jctr.runtime.host_memory import reexec_with_malloc_tuning  # noqa: E402

# what the revision's benchmarks import
EXPORTED = ("jctr", "scripts/bench_train.py", "scripts/bench_tables.py",
            "scripts/bench_hps.py", "scripts/make_configs.py")


def export(rev: str, base: str = "/tmp", root: str = ROOT) -> str:
    """The folder in ``base`` holding the revision of the repository at ``root`` as
    ``jctr_rev`` and ``rev_scripts`` (made once per commit)."""
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True)
    if commit.returncode:
        raise SystemExit(f"bench_revision: {rev!r} is not a commit of {root}: "
                         f"{commit.stderr.strip()}")
    sha = commit.stdout.strip()
    folder = os.path.join(base, f"jctr-revision-{sha}")
    if os.path.isdir(os.path.join(folder, "jctr_rev")):
        return folder
    tar = subprocess.run(["git", "-C", root, "archive", sha, *EXPORTED], capture_output=True)
    if tar.returncode:
        raise SystemExit(f"bench_revision: git archive {sha[:12]}: {tar.stderr.decode().strip()}")
    work = folder + f".part{os.getpid()}"  # renamed into place whole, or removed
    try:
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
            t.extractall(work, filter="data")
        os.rename(os.path.join(work, "jctr"), os.path.join(work, "jctr_rev"))
        os.rename(os.path.join(work, "scripts"), os.path.join(work, "rev_scripts"))
        for where, _, names in os.walk(work):
            for name in (n for n in names if n.endswith(".py")):
                path = os.path.join(where, name)
                with open(path) as f:
                    text = f.read()
                text = re.sub(r"\bjctr\b", "jctr_rev", text)
                text = re.sub(r"\bjctr_(cpu|host)_", r"jctrrev_\1_", text)  # XLA targets
                text = re.sub(r"\bscripts\.", "rev_scripts.", text)
                with open(path, "w") as f:
                    f.write(text)
        os.rename(work, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def train_pair(args, rev):
    """(this tree's step, the revision's, this tree's step on pooled vectors) runners."""
    import scripts.bench_train as here

    batches = here.make_batches(args.rounds * args.block + 4, args.batch, args.hot,
                                keys=args.keys)
    opt = {"optimizer": args.optimizer}
    return {"this": here.jctr_runner(batches, args.dtype, **opt),
            "revision": rev.jctr_runner(batches, args.dtype, **opt),
            "pooled": here.dense_only_runner(batches, args.dtype, **opt)}


def table_pair(args, rev):
    """Steps of both trees' tables (full or with room), each on its own state."""
    import jax
    import jax.numpy as jnp

    import scripts.bench_tables as here

    cap, n = args.capacity, args.batch_keys
    steps = args.rounds * args.block + 1
    feed = here.batches(args.keys, steps, n, 100_000_000, seed=2)
    if args.table == "insert":  # the run's new keys fill at most half the table
        arriving = np.unique(np.concatenate(feed)).size
        cap = args.capacity = max(cap, 2 * arriving)
        print(f"insert: {arriving:,} keys arrive over the run; slots {args.load:.0%} full "
              "at its end")
    runners = {}
    for name, mod, pkg in (("this", here, "jctr"), ("revision", rev, "jctr_rev")):
        schema = importlib.import_module(f"{pkg}.config.schema")
        tables = importlib.import_module(f"{pkg}.embedding.hash_table")
        init = importlib.import_module(f"{pkg}.embedding.sparse_embedding").init_embedding
        if args.table == "insert":
            spec = mod.spec_of(cap, args.dim, None)
            held = min(cap, int(args.load * tables.num_slots_for(cap))) - arriving
        else:
            room = cap + n * steps if args.table == "evict-room" else cap
            spec = mod.spec_of(room, args.dim, schema.EvictionConfig(args.policy))
            held = cap
        step = mod.make_step(spec)
        state = mod.fill(step, init(spec), spec.capacity, held, n)
        state, out = step(state, jnp.asarray(feed[0]))
        jax.block_until_ready(out)
        box = {"state": state, "i": 1}

        def run(step=step, box=box):
            keys = jnp.asarray(feed[box["i"] % len(feed)])
            box["i"] += 1
            box["state"], out = step(box["state"], keys)
            jax.block_until_ready(out)

        runners[name] = run
    return runners


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revision", help="a commit of this repository (HEAD: the last commit)")
    ap.add_argument("what", choices=("train", "tables"))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=3, help="steps of each tree in a round")
    ap.add_argument("--keys", default="uniform", choices=("uniform", "power-law"))
    ap.add_argument("--hot", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, default=8192, help="train: samples a step")
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adagrad"),
                    help="train: bench_train's optimizers (a revision before 2026-12-07 has "
                         "only sgd; adagrad: from this session's)")
    ap.add_argument("--table", default="evict", choices=("evict", "evict-room", "insert"))
    ap.add_argument("--load", type=float, default=0.85, help="insert: slots full at the end")
    ap.add_argument("--capacity", type=int, default=2_000_000)
    ap.add_argument("--batch-keys", type=int, default=106_496)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--policy", default="lru")
    args = ap.parse_args()
    folder = export(args.revision)  # before the re-exec: its errors print once
    reexec_with_malloc_tuning([os.path.abspath(__file__), *sys.argv[1:]])
    sys.path.insert(1, folder)
    import jctr._x64  # noqa: F401  (64-bit keys)

    bench = "bench_train" if args.what == "train" else "bench_tables"
    rev = importlib.import_module(f"rev_scripts.{bench}")
    runners = (train_pair if args.what == "train" else table_pair)(args, rev)
    for run in runners.values():  # compiled, and the first steps' page faults paid
        for _ in range(2 if args.what == "train" else 0):
            run()
    times = {name: [] for name in runners}
    for r in range(args.rounds):
        names = list(runners) if r % 2 == 0 else list(runners)[::-1]
        for name in names:
            for _ in range(args.block):
                t = time.perf_counter()
                runners[name]()
                times[name].append(time.perf_counter() - t)
    # training reports medians (bench_train); a table's mean holds its rebuild steps
    # (bench_tables)
    summary = statistics.median if args.what == "train" else statistics.fmean
    ms = {name: summary(ts) * 1e3 for name, ts in times.items()}
    label = (f"train {args.hot}-hot {args.keys} {args.dtype} batch {args.batch}"
             if args.what == "train" else f"tables {args.table} {args.keys} "
             f"{args.capacity:,} rows, {args.batch_keys:,} keys a step")
    print(f"{label}: this tree {ms['this']:.1f} ms, revision {args.revision} "
          f"{ms['revision']:.1f} ms a step: ratio {ms['this'] / ms['revision']:.3f}")
    if "pooled" in ms:
        print(f"  sparse part (the step minus the step on pooled vectors, {ms['pooled']:.1f} "
              f"ms): this tree {ms['this'] - ms['pooled']:.1f} ms, revision "
              f"{ms['revision'] - ms['pooled']:.1f} ms")
    b = args.block
    pairs = [summary(times["this"][i:i + b]) / summary(times["revision"][i:i + b])
             for i in range(0, len(times["this"]), b)]
    print("  rounds (this / revision): " + " ".join(f"{p:.3f}" for p in pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
