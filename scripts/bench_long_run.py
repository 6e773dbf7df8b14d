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

3. A server's hash map erases a Kafka message's worth of keys (32,768) from a table of
   ``--rows`` rows of 16 floats: the columns compacted and the index rebuilt (before) against
   the last rows moved into the holes (:func:`jctr.ops.host_index.erase_rows`).
4. A server following a trainer's Kafka updates (the local broker of
   ``scripts/kafka_broker.sh``, a hash map over RocksDB): an evicting table (lru,
   ``--table-rows`` rows, DLRM synthetic data, ``--steps`` steps of 512, a publish every 10
   steps). Before, the server held every key ever trained; now the evicted keys reach it as
   erased keys: the keys its RocksDB holds against the keys trained. ``--skip-kafka``
   leaves it out.
5. A server (RocksDB, a hash map holding a tenth, a device cache of a twentieth) serving a
   base of ``--rows`` rows of 8 floats takes the next day's base (the same number of rows,
   a tenth of its keys new) without a restart (:meth:`jctr.serving.hps_model.HPSModel.
   take_chain`, on SIGHUP): written into tables of their own and swapped in (now), against
   a fresh load of that base into empty databases (what ``python -m jctr.serve load`` and
   a restart pay), and against the switch in place (before; what Redis still takes: rows
   written over the served table, then every key it holds tested against the chain's
   sorted keys and those the chain lacks erased). ``--skip-switch`` leaves it out.

Prints seconds (median of ``--rounds``) and before / now.

    python scripts/bench_long_run.py
    python scripts/bench_long_run.py --keys 30000000 --daily 3000000 --rows 40000000
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def erase_part(args) -> None:
    from jctr.config.hps import VolatileDatabaseParams
    from jctr.stores.hash_map import HashMapStore

    rng = np.random.default_rng(2)
    keys = rng.integers(1, 1 << 62, args.rows, dtype=np.int64)
    store = HashMapStore(VolatileDatabaseParams(type="hash_map"))
    store.insert("t", keys, np.zeros((keys.size, 16), np.float32))
    table = store._tables["t"]
    store.erase("t", keys[:8])  # its kernel loaded
    times = {"compacted": [], "moved": []}
    for _ in range(args.rounds):
        for way in times:
            gone = rng.choice(keys, 32768, replace=False)
            t = time.perf_counter()
            if way == "compacted":  # what an erase did before
                rows = table.find(gone)
                drop = np.zeros(table.size, bool)
                drop[rows[rows >= 0]] = True
                table.remove_rows(drop)
            else:
                store.erase("t", gone)
            times[way].append(time.perf_counter() - t)
            store.insert("t", gone, np.zeros((gone.size, 16), np.float32))  # back
    before, now = (statistics.median(times[w]) for w in ("compacted", "moved"))
    print(f"[hash map erase] 32,768 keys of {args.rows:,} rows: compacted {before * 1e3:.1f} "
          f"ms, the last rows moved in {now * 1e3:.1f} ms: {before / now:,.0f}x")


def kafka_part(args, folder: str) -> None:
    import pathlib
    import socket
    import subprocess

    from jctr.config import load_config
    from jctr.config.hps import parse_ps_config
    from jctr.serving.bundle import export_bundle
    from jctr.serving.hps import Databases
    from jctr.serving.hps_model import HPSModel
    from jctr.serving.updates import UpdateApplier, wait_for
    from jctr.sharding.rows import export_placed
    from jctr.stores.kafka import update_topics
    from jctr.train.publisher import KafkaPublisher
    from jctr.train.trainer import Trainer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = os.path.join(ROOT, "scripts", "kafka_broker.sh")
    tmp = pathlib.Path(folder)
    broker = subprocess.run(["bash", script, "start", str(tmp / "kafka"), str(port)],
                            check=True, capture_output=True, text=True).stdout.strip()
    try:
        with open(os.path.join(ROOT, "configs", "dlrm_synthetic.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        data = cfg["layers"][0]
        data["source"] = str(tmp / "data" / "train" / "_file_list.txt")
        data["eval_source"] = str(tmp / "data" / "eval" / "_file_list.txt")
        cfg["solver"].update(max_iter=args.steps, display=10**6, eval_interval=10**6,
                             eval_batches=1, batchsize=512, snapshot=0)
        cfg["solver"]["kafka_sink"] = {"model_name": "m", "brokers": broker,
                                       "every_n_steps": 10}
        cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = \
            args.table_rows
        cfg["layers"][1]["eviction"] = {"policy": "lru"}
        t = Trainer(load_config(cfg), log=lambda s: None)
        export_bundle(t.cfg, t.state, str(tmp / "bundle"), t.placements)
        ps = parse_ps_config({
            "volatile_db": {"type": "hash_map"},
            "persistent_db": {"type": "rocks_db", "path": str(tmp / "rocks")},
            "update_source": {"type": "kafka_message_queue", "brokers": broker,
                              "poll_timeout_ms": 100, "metadata_refresh_interval_ms": 200},
            "models": [{"model": "m", "bundle": str(tmp / "bundle"), "max_batch_size": 256}]},
            str(tmp / "ps.json"))
        dbs = Databases(ps.volatile_db, ps.persistent_db)
        hps = HPSModel(ps.models[0], dbs)
        hps.load_databases()
        applier = UpdateApplier(ps.update_source, dbs, {"m": hps}, group="bench")
        applier.start()
        pub = next(h for h in t.hooks if isinstance(h, KafkaPublisher))
        seen = []
        note = pub.on_batch
        pub.on_batch = lambda batch: seen.append(note(batch)[0]) or [seen[-1]]
        t0 = time.perf_counter()
        t.fit()
        train_s = time.perf_counter() - t0
        pub.sink.flush(60)
        table = hps.tables[0].key
        # every message the broker holds applied by every side (offsets, not steps: a
        # step's rows come in several messages)
        from confluent_kafka import Consumer, TopicPartition

        watch = Consumer({"bootstrap.servers": broker, "group.id": "bench-ends"})
        pattern = re.compile(update_topics(["m"]))
        ends = {(topic, p): watch.get_watermark_offsets(TopicPartition(topic, p),
                                                        timeout=10)[1]
                for topic, meta in watch.list_topics(timeout=10).topics.items()
                if pattern.match(topic) for p in meta.partitions}
        watch.close()
        wait_for(applier, lambda a: all(c.offsets.get(w, 0) >= end for c in a.consumers
                                        for w, end in ends.items()), 120)
        served = sum(k.size for k, _ in dbs.persistent.items(table))
        held = export_placed(t.state.embeddings[0], t.placements[0])["keys"].size
        trained = np.unique(np.concatenate(seen)).size
        applier.close()
        hps.close()
        dbs.close()
        print(f"[kafka] an lru table of {args.table_rows:,} rows, {args.steps} steps of 512 "
              f"({train_s:.1f} s): {trained:,} keys trained, {held:,} held; the server's "
              f"RocksDB {served:,} keys (before: every key trained), {pub.erased:,} erased "
              f"keys sent: {trained / max(served, 1):.1f}x fewer keys served")
    finally:
        subprocess.run(["bash", script, "stop", str(tmp / "kafka")], capture_output=True)


def switch_part(args, folder: str) -> None:
    import dataclasses
    import pathlib
    import shutil

    from jctr.config import load_config
    from jctr.config.hps import parse_ps_config
    from jctr.serving.bundle import export_bundle
    from jctr.serving.hps import Databases
    from jctr.serving.hps_model import HPSModel
    from jctr.stores.hash_map import HashMapStore
    from jctr.stores.rocksdb import RocksDBStore
    from jctr.train.trainer import Trainer

    tmp = pathlib.Path(folder)
    with open(os.path.join(ROOT, "configs", "dlrm_synthetic.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["layers"][0]["source"] = str(tmp / "data" / "train" / "_file_list.txt")
    cfg["layers"][0]["eval_source"] = str(tmp / "data" / "eval" / "_file_list.txt")
    cfg["solver"].update(max_iter=2, display=10**6, eval_interval=10**6, eval_batches=1,
                         batchsize=512, snapshot=0)
    t = Trainer(load_config(cfg), log=lambda s: None)
    t.fit()
    export_bundle(t.cfg, t.state, str(tmp / "bundle"), t.placements)
    tables = sorted(os.listdir(tmp / "bundle" / "sparse"))
    rng = np.random.default_rng(5)

    def base(name: str, first: int) -> dict:
        """A HugeCTR-layout model: the bundle's network and dense weights, its first table
        ``--rows`` rows of keys first, first + 1, ... (spread by a multiplier)."""
        out = tmp / name
        out.mkdir()
        for f in ("dense.model", "config.json", "non_trainable.json"):
            shutil.copy(tmp / "bundle" / f, out / f)
        files = []
        for i, table in enumerate(tables):
            files.append(str(out / table))
            if i:
                shutil.copytree(tmp / "bundle" / "sparse" / table, out / table)
                continue
            os.makedirs(out / table)
            with open(out / table / "key", "wb") as k, \
                    open(out / table / "emb_vector", "wb") as v:
                for s in range(0, args.rows, 1 << 22):
                    n = min(1 << 22, args.rows - s)
                    ((np.arange(s, s + n, dtype=np.int64) + first) * 7919 + 13).tofile(k)
                    (rng.standard_normal((n, 8), dtype=np.float32) * 0.01).tofile(v)
        return {"model": "m", "max_batch_size": 256, "gpucache": True, "gpucacheper": 0.05,
                "sparse_files": files, "dense_file": str(out / "dense.model"),
                "network_file": str(out / "config.json")}

    day1, day2 = base("day1", 0), base("day2", args.rows // 10)

    def served(model: dict, rocks: str):
        ps = parse_ps_config({
            "supportlonglong": True,
            "volatile_db": {"type": "hash_map", "initial_cache_rate": 0.1},
            "persistent_db": {"type": "rocks_db", "path": str(tmp / rocks)},
            "models": [model]}, str(tmp / "ps.json"))
        dbs = Databases(ps.volatile_db, ps.persistent_db)
        return dbs, HPSModel(ps.models[0], dbs)

    dbs, model = served(day2, "fresh")
    start = time.perf_counter()
    model.load_databases()  # the baseline: the next base loaded afresh
    fresh = time.perf_counter() - start
    model.close()
    dbs.close()
    figures = {}
    for way in ("now", "before"):
        hidden = []
        if way == "before":  # no table swaps: the switch in place
            for store_class in (RocksDBStore, HashMapStore):
                hidden.append((store_class, store_class.swap_tables))
                store_class.swap_tables = None
        try:
            dbs, model = served(day1, f"rocks_{way}")
            model.load_databases()
            chain = dataclasses.replace(
                model.params, sparse_model_files=tuple(day2["sparse_files"]),
                dense_model_file=day2["dense_file"], network_file=day2["network_file"])
            start = time.perf_counter()
            taken = model.take_chain(chain)
            figures[way] = time.perf_counter() - start
            assert taken == (True, 0), taken
            model.close()
            dbs.close()
        finally:
            for store_class, swap in hidden:
                store_class.swap_tables = swap
    print(f"[new base] {args.rows:,} rows, a tenth new: loaded afresh {fresh:.1f} s; taken "
          f"while serving {figures['now']:.1f} s ({figures['now'] / fresh:.2f}x the fresh "
          f"load), in place before {figures['before']:.1f} s ({figures['before'] / fresh:.2f}x)"
          f": {figures['before'] / figures['now']:.1f}x faster")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=10_000_000)
    ap.add_argument("--daily", type=int, default=1_000_000)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--table-rows", type=int, default=5000)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--skip-kafka", action="store_true", help="part 4 left out")
    ap.add_argument("--skip-switch", action="store_true", help="part 5 left out")
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}")
    with tempfile.TemporaryDirectory(prefix="bench_long_run_") as folder:
        statistics_part(args, folder)
    with tempfile.TemporaryDirectory(prefix="bench_long_run_") as folder:
        manifest_part(args, folder)
    erase_part(args)
    if not args.skip_kafka:
        with tempfile.TemporaryDirectory(prefix="bench_long_run_") as folder:
            kafka_part(args, folder)
    if not args.skip_switch:
        with tempfile.TemporaryDirectory(prefix="bench_long_run_") as folder:
            switch_part(args, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
