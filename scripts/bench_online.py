"""Streaming training (``python -m jctr.online``) against the core trainer on the same data, the
daily shrink and a delta save on a large table, and how much of a pass's reading the prefetch
hides, measured in one run.

1. Throughput: one day of time-sliced Norm files (DLRM of the Criteo shape: 13 dense, 26 one-hot
   slots, dim 16, bottom 512-256-64-16, top 512-256-1, batch 4,096) with fresh keys throughout
   (each slot draws from 200,000 keys, uniformly or power-law alpha 1.2), trained once by the
   core :class:`Trainer` over all the files as one source (one epoch) and once by the streaming
   runner pass by pass (feature statistics, prefetch, a validation score after each pass, the
   shrink and the base model at the day's end). Ratio: the streaming passes' training
   samples/s over the core trainer's (steady state: compile excluded on both), and the
   end-to-end ratio (the core trainer's wall time over the streaming run's: samples per
   second of each, the streaming run's statistics, validations and day end included).
2. Overlap: per pass after the first, the time the prefetch spent reading it and the time the
   runner then still waited for it; hidden = 1 - waited / read.
3. Shrink and delta save on a table of ``--keys`` keys (10M by default; dim 16,
   SparseAdaGradSGDRule): statistics for every key, a shrink deleting 10% of them (erased
   from the table: :func:`jctr.sharding.rows.drop_keys`) and a delta model of 10% of the
   keys. Baseline: a full
   checkpoint of the same state (``Trainer.save_checkpoint(directory)``).

    python scripts/bench_online.py
    python scripts/bench_online.py --samples-per-file 32768 --keys 2000000
    python scripts/bench_online.py --skip-table --repeat 3   # part 1 in 3 alternating rounds
    python scripts/bench_online.py --skip-table --sparse-store   # and the day through each store
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jctr._x64  # noqa: E402,F401  (64-bit keys)
from jctr.runtime.host_memory import reexec_with_malloc_tuning  # noqa: E402
from scripts.bench_hps import cpu_name  # noqa: E402
from scripts.bench_train import jctr_config  # noqa: E402

SLOT_VOCAB = 200_000
DAY = "20190720"


def model_config(tmp: str, batch: int) -> dict:
    cfg = jctr_config(batch, 1)
    data = cfg["layers"][0]
    data["source"] = os.path.join(tmp, "eval", "_file_list.txt")
    data["eval_source"] = data["source"]
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = 26 * SLOT_VOCAB
    del cfg["solver"]["max_iter"]
    cfg["solver"].update(num_epochs=1, display=10**6, eval_interval=10**9, eval_batches=1,
                         batchsize_eval=batch, snapshot=0)
    return cfg


def throughput(args, alpha: float, tmp: str) -> dict:
    from jctr.config import parse_config
    from jctr.config.online import parse_online_config
    from jctr.data.records import write_file_list
    from jctr.data.tools.synthetic import write_dataset
    from jctr.online.runner import OnlineRun
    from jctr.online.synthetic_stream import write_stream
    from jctr.train.trainer import Trainer

    raw = model_config(tmp, args.batch)
    write_dataset(os.path.join(tmp, "eval"), args.batch, num_files=1, stream=999, alpha=alpha,
                  slot_nnz=[1] * 26, vocab=[SLOT_VOCAB] * 26, dense_dim=13)
    cfg = parse_config(raw)
    interval = 1440 // args.passes
    folders = write_stream(cfg, os.path.join(tmp, "stream"), [DAY], split_interval=interval,
                           files_per_slice=args.files, samples_per_file=args.samples_per_file,
                           alpha=alpha, vocab=[SLOT_VOCAB] * 26)
    files = [os.path.join(f, name) for f in folders for name in sorted(os.listdir(f))
             if name.endswith(".data")]
    samples = len(files) * args.samples_per_file

    whole = os.path.join(tmp, "all.txt")
    write_file_list(whole, files)
    raw_core = json.loads(json.dumps(raw))
    raw_core["layers"][0]["source"] = whole
    model = os.path.join(tmp, "model.json")
    with open(model, "w") as f:
        json.dump(raw, f)
    rounds = []
    for i in range(args.repeat):  # core and streaming alternate: the machine's drift hits both
        # the core trainer: every file as one source, one epoch
        t0 = time.perf_counter()
        core = Trainer(parse_config(raw_core), log=lambda s: None, generate_data=False)
        core_rate = core.fit().steady_samples_per_s
        core_wall = time.perf_counter() - t0
        del core

        save = os.path.join(tmp, f"save{i}")
        online = parse_online_config({
            "model": model, "train_data_dir": os.path.join(tmp, "stream"),
            "split_interval": interval, "split_per_pass": 1, "start_day": DAY, "end_day": DAY,
            "save_model_path": save, "data_donefile": "DONE",
            "checkpoint_per_pass": 10**6}, os.path.join(tmp, "online.json"))
        t0 = time.perf_counter()
        run = OnlineRun(online, log=lambda s: None)
        run.run()
        online_wall = time.perf_counter() - t0
        del run
        records = [json.loads(x) for x in open(os.path.join(save, "passes.jsonl"))]
        shutil.rmtree(save, ignore_errors=True)
        per_pass = samples / len(records)
        online_rate = samples / sum(per_pass / r["samples_per_s"] for r in records)
        later = [r for r in records if r["read_ahead_s"] is not None]
        read = sum(r["read_ahead_s"] for r in later)
        waited = sum(r["read_wait_s"] for r in later)
        rounds.append({"samples": samples, "core_rate": core_rate, "online_rate": online_rate,
                       "core_wall": core_wall, "online_wall": online_wall, "read_s": read,
                       "wait_s": waited, "passes": len(records)})
    if args.sparse_store:  # the same day with every row in a database, against memory
        # rounds alternate the kinds: a process's first runs also pay for growing its heap
        # and for the page cache's first fill, which later days of a long run do not
        walls = {kind: [] for kind in ("memory", *args.store_type)}
        for r in range(args.store_rounds):
            for kind in walls:
                doc = {"model": model, "train_data_dir": os.path.join(tmp, "stream"),
                       "split_interval": interval, "split_per_pass": 1, "start_day": DAY,
                       "end_day": DAY, "save_model_path": os.path.join(tmp, f"store-{kind}-{r}"),
                       "data_donefile": "DONE", "checkpoint_per_pass": 1}
                if kind != "memory":
                    doc["sparse_store"] = {"type": kind,
                                           "path": os.path.join(tmp, f"rows-{kind}-{r}")}
                t0 = time.perf_counter()
                OnlineRun(parse_online_config(doc, os.path.join(tmp, "online.json")),
                          log=lambda s: None).run()
                walls[kind].append(time.perf_counter() - t0)
                if kind != "memory":  # its database is not read again: room for the next
                    shutil.rmtree(os.path.join(tmp, f"rows-{kind}-{r}"), ignore_errors=True)
        rounds[-1]["store_walls"] = walls
    return rounds


def shrink_and_delta(args, tmp: str) -> dict:
    import jax.numpy as jnp

    from jctr.config import parse_config
    from jctr.online.feature_stats import FeatureStats, ShrinkRule
    from jctr.serving.bundle import export_bundle
    from jctr.sharding.rows import drop_keys, import_placed
    from jctr.train.trainer import Trainer

    n = args.keys
    raw = model_config(tmp, args.batch)
    raw["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = \
        int(n * 1.05)
    raw["layers"][1]["optimizer"] = {"type": "SparseAdaGradSGDRule"}
    t = Trainer(parse_config(raw), log=lambda s: None, generate_data=False)
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(1, 1 << 62, int(n * 1.01)))[:n]
    rng.shuffle(keys)
    spec = t.specs[0]
    t0 = time.perf_counter()
    table = import_placed(spec, t.state.embeddings[0],
                          {"keys": keys, "values": rng.normal(0, 0.01, (n, spec.dim))
                           .astype(np.float32),
                           "g2sum": np.zeros((n, 2), np.float32)}, t.placements[0])
    t.state = t.state._replace(embeddings=(table,))
    fill_s = time.perf_counter() - t0
    stats = FeatureStats()
    show = rng.integers(1, 50, n).astype(np.float64)
    t0 = time.perf_counter()  # every key's counts added (observe adds them at once)
    stats.observe(keys, show, np.floor(show * 0.05))
    stats.flush()
    merge_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    path = os.path.join(tmp, "full", str(t.save_checkpoint(os.path.join(tmp, "full"))))
    full_s = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    shutil.rmtree(os.path.join(tmp, "full"))

    # shrink: a tenth of the keys below the threshold
    low = rng.permutation(n)[: n // 10]
    stats.show[low] = 0.0
    stats.click[low] = 0.0
    # the run's first shrink compiles the erase (once per process): timed apart, before
    # (a key the table does not hold: nothing erased)
    t1 = time.perf_counter()
    table, _ = drop_keys(spec, t.state.embeddings[0], t.placements[0], np.array([0]))
    compile_s = time.perf_counter() - t1
    t0 = time.perf_counter()
    deleted = stats.shrink(ShrinkRule(delete_threshold=0.05))
    stats_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    table, rows = drop_keys(spec, table, t.placements[0], deleted)
    t.state = t.state._replace(embeddings=(table,))
    drop_s = time.perf_counter() - t1
    stats.rows_of(deleted[:1])  # the statistics' index, rebuilt beside the erase, is ready
    shrink_s = time.perf_counter() - t0

    # a delta of a tenth of the keys
    stats.since_delta[:] = False
    stats.since_delta[rng.permutation(len(stats))[: n // 10]] = True
    t0 = time.perf_counter()
    delta = stats.delta_keys(0.0, 0.0, 16)
    export_bundle(t.cfg, t.state, os.path.join(tmp, "delta"), t.placements, keys=[delta],
                  about={"kind": "delta", "day": DAY, "pass": 1})
    delta_s = time.perf_counter() - t0
    del jnp
    return {"keys": n, "fill_s": fill_s, "merge_s": merge_s, "full_s": full_s,
            "full_mb": size / 2**20, "deleted": int(deleted.size), "rows": rows,
            "stats_s": stats_s, "drop_s": drop_s, "shrink_s": shrink_s,
            "compile_s": compile_s,
            "delta_keys": int(delta.size),
            "delta_s": delta_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--passes", type=int, default=4, help="passes (slices) in the day")
    ap.add_argument("--files", type=int, default=2, help="files per slice")
    ap.add_argument("--samples-per-file", type=int, default=65536)
    ap.add_argument("--keys", type=int, default=10_000_000, help="table size for part 3")
    ap.add_argument("--skip-table", action="store_true", help="parts 1 and 2 only")
    ap.add_argument("--table-only", action="store_true", help="part 3 only")
    ap.add_argument("--sparse-store", action="store_true",
                    help="also run the day with sparse_store (every row in a database) and "
                         "in memory, both checkpointing every pass (sparse_store needs it)")
    ap.add_argument("--store-rounds", type=int, default=2,
                    help="rounds of the sparse_store comparison (memory and each type alternate)")
    ap.add_argument("--store-type", nargs="+", default=["rocks_db", "row_file"],
                    choices=["rocks_db", "row_file"],
                    help="the sparse_store types to run (each against the same memory day)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of part 1 (core and streaming alternate); medians printed")
    args = ap.parse_args()
    # the host memory setting of `python -m jctr.train` and `python -m jctr.online`
    # (JCTR_HOST_MEMORY_TUNING=0: off)
    reexec_with_malloc_tuning([os.path.abspath(__file__), *sys.argv[1:]])
    print(f"CPU: {cpu_name()}; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    for name, alpha in (() if args.table_only else (("uniform", 0.0), ("power-law 1.2", 1.2))):
        tmp = tempfile.mkdtemp(prefix="jctr-bench-online-")
        try:
            rounds = throughput(args, alpha, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for r in rounds:
            print(f"[{name}] {r['samples']:,} samples in {r['passes']} passes: streaming "
                  f"{r['online_rate']:,.0f} samples/s, core trainer {r['core_rate']:,.0f} "
                  f"samples/s: ratio {r['online_rate'] / r['core_rate']:.3f}; end to end "
                  f"{r['online_wall']:.1f} s streaming (statistics, per-pass validation, day "
                  f"end) vs {r['core_wall']:.1f} s core: {r['core_wall'] / r['online_wall']:.3f}")
        if len(rounds) > 1:
            steady = [r["online_rate"] / r["core_rate"] for r in rounds]
            whole = [r["core_wall"] / r["online_wall"] for r in rounds]
            print(f"[{name}] median of {len(rounds)} rounds: steady ratio "
                  f"{statistics.median(steady):.3f}, end to end {statistics.median(whole):.3f} "
                  f"(rounds {min(whole):.3f}-{max(whole):.3f})")
        r = rounds[-1]
        for kind, walls in r.get("store_walls", {}).items():
            if kind != "memory":
                mem = r["store_walls"]["memory"]
                ratios = [a / b for a, b in zip(walls, mem)]
                print(f"[{name}] sparse_store {kind}: the day in "
                      f"{' / '.join(f'{w:.1f}' for w in walls)} s with every row in the "
                      f"database, {' / '.join(f'{w:.1f}' for w in mem)} s in memory (both "
                      f"checkpointing each pass; rounds alternate): "
                      f"{' / '.join(f'{x:.2f}' for x in ratios)}x, median "
                      f"{statistics.median(ratios):.2f}x"
                      # a checkout's first round also compiles numba's code of the
                      # database's paths (its cache is per checkout: 2.34x against 1.65x)
                      + (f", after the first round {statistics.median(ratios[1:]):.2f}x"
                         if len(ratios) > 1 else ""))
        hidden = 1.0 - r["wait_s"] / r["read_s"] if r["read_s"] else float("nan")
        print(f"[{name}] prefetch: {r['read_s']:.2f} s of reading for passes 2..{r['passes']}, "
              f"{r['wait_s']:.2f} s of it waited for: {100 * hidden:.0f}% hidden behind "
              "training")
    if not args.skip_table:
        tmp = tempfile.mkdtemp(prefix="jctr-bench-online-")
        try:
            r = shrink_and_delta(args, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"[table {r['keys']:,} keys, dim 16] filled in {r['fill_s']:.1f} s; statistics "
              f"merged in {r['merge_s']:.2f} s; full checkpoint (baseline) "
              f"{r['full_s']:.1f} s ({r['full_mb']:,.0f} MiB)")
        shrink = r["shrink_s"]
        print(f"[table] shrink deleting {r['deleted']:,} keys: {shrink:.2f} s (statistics "
              f"{r['stats_s']:.2f} s, then the keys erased from the table, {r['rows']:,} rows "
              f"left in use, {r['drop_s']:.2f} s, while the statistics' index is rebuilt; until "
              f"both are done) = {shrink / r['full_s']:.2f}x a full checkpoint (the run's "
              f"first erase compiles it: {r['compile_s']:.2f} s, timed apart)")
        print(f"[table] delta model of {r['delta_keys']:,} keys: {r['delta_s']:.1f} s = "
              f"{r['delta_s'] / r['full_s']:.2f}x a full checkpoint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
