"""Online model updates: rows per second from a trainer's Kafka sink to the HPS layers, and the
latency from publishing a step's update to the moment the served model holds it, against what
the broker itself moves in the same run.

Setup: the pinned Tansu broker (scripts/kafka_broker.sh, loopback), a DLRM of the Criteo shape
(26 one-hot slots, dim 16) served by the HPS with a hash-map volatile database, a RocksDB
persistent database and a device cache (50%).

1. Throughput (after one small update has made the topic and been applied): ``--rows``
   fresh rows (new keys, uniform or power-law over 10M keys, so some repeat) published by
   :class:`jctr.stores.kafka.KafkaMessageSink` in messages of ``send_buffer_size``, applied
   by :class:`jctr.serving.updates.UpdateApplier`: the time until they are served (hash map
   and device cache: the serving side's consumer group) and until every layer holds them
   (RocksDB too: the persistent side's group). Baseline: the broker's own rate for the same
   bytes: a plain confluent-kafka producer then a plain consumer (no decoding, no databases).
2. Latency: ``--updates`` times, a step's update (1,024 changed rows and the dense weights) is
   published and the time until it is served (hash map, device cache, dense swap) and until
   RocksDB holds it too is taken; p50 / p99.

    python scripts/bench_updates.py
    python scripts/bench_updates.py --rows 200000 --updates 50
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jctr._x64  # noqa: E402,F401  (64-bit keys)
from scripts.bench_hps import cpu_name  # noqa: E402
from scripts.bench_train import jctr_config  # noqa: E402

DIM = 16
MODEL = "bench_updates"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broker_rate(brokers: str, payloads: list[bytes]) -> tuple[float, float]:
    """Seconds to produce, and to consume, ``payloads`` with plain clients."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    topic = "bench_raw"
    p = Producer({"bootstrap.servers": brokers, "linger.ms": 5, "acks": "all",
                  "message.max.bytes": 1 << 21})
    t0 = time.perf_counter()
    for data in payloads:
        p.produce(topic, value=data, key=b"k")
    p.flush(60)
    produce_s = time.perf_counter() - t0
    c = Consumer({"bootstrap.servers": brokers, "group.id": "bench-raw",
                  "enable.auto.commit": False, "fetch.max.bytes": 1 << 21,
                  "message.max.bytes": 1 << 21, "receive.message.max.bytes": 1 << 30})
    parts = c.list_topics(topic, timeout=5).topics[topic].partitions
    c.assign([TopicPartition(topic, q, 0) for q in parts])
    got = 0
    t0 = time.perf_counter()
    while got < len(payloads) and time.perf_counter() - t0 < 120:
        got += sum(1 for m in c.consume(min(256, len(payloads) - got), 0.5)
                   if not m.error())
    consume_s = time.perf_counter() - t0
    c.close()
    return produce_s, consume_s


def settle(db, limit_s: float = 60.0) -> None:
    """Wait until RocksDB runs no flush or compaction (at most ``limit_s``)."""
    end = time.monotonic() + limit_s
    busy = ("rocksdb.num-running-flushes", "rocksdb.num-running-compactions",
            "rocksdb.compaction-pending")
    while time.monotonic() < end and any(db.property_int_value(p) for p in busy):
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--send-buffer-size", type=int, default=262144)
    ap.add_argument("--poll-timeout-ms", type=int, default=500,
                    help="update_source.poll_timeout_ms (500: the default)")
    args = ap.parse_args()
    from jctr.config import parse_config
    from jctr.config.hps import parse_ps_config
    from jctr.data.tools.synthetic import power_law_ranks
    from jctr.serving.bundle import export_bundle
    from jctr.serving.hps import Databases
    from jctr.serving.hps_model import HPSModel
    from jctr.serving.updates import UpdateApplier, wait_for
    from jctr.stores.kafka import KafkaMessageSink
    from jctr.stores.rocksdb import RocksDBStore
    from jctr.stores.update_messages import encode_rows, rows_per_message
    from jctr.train.trainer import Trainer

    print(f"CPU: {cpu_name()}")
    tmp = tempfile.mkdtemp(prefix="jctr-bench-updates-")
    script = os.path.join(ROOT, "scripts", "kafka_broker.sh")
    brokers = subprocess.run(["bash", script, "start", tmp, str(free_port())], check=True,
                             capture_output=True, text=True).stdout.strip()
    try:
        raw = jctr_config(1024, 1)
        raw["layers"][0]["source"] = raw["layers"][0]["eval_source"] = os.path.join(tmp, "x")
        raw["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = 1 << 20
        t = Trainer(parse_config(raw), log=lambda s: None, generate_data=False)
        export_bundle(t.cfg, t.state, os.path.join(tmp, "bundle"), t.placements)
        ps = parse_ps_config({
            "volatile_db": {"type": "hash_map"},
            "persistent_db": {"type": "rocks_db", "path": os.path.join(tmp, "rocks")},
            "update_source": {"type": "kafka_message_queue", "brokers": brokers,
                              "poll_timeout_ms": args.poll_timeout_ms,
                              "metadata_refresh_interval_ms": 100,
                              "max_batch_size": 65536},
            "models": [{"model": MODEL, "bundle": os.path.join(tmp, "bundle"),
                        "max_batch_size": 1024, "gpucache": True, "gpucacheper": 0.5}]},
            os.path.join(tmp, "ps.json"))
        dbs = Databases(ps.volatile_db, ps.persistent_db)
        hps = HPSModel(ps.models[0], dbs)
        hps.load_databases()
        # a buffer for the whole burst: the bench times the apply path, and a full buffer
        # drops messages (the default 64 MB is less than 1M rows' 72 MB of messages; whether
        # the broker drained enough meanwhile decided whether a run finished)
        sink = KafkaMessageSink(brokers, MODEL, send_buffer_size=args.send_buffer_size,
                                max_buffered_bytes=max(64 << 20, 2 * args.rows * (DIM * 4 + 8)),
                                report=print)
        applier = UpdateApplier(ps.update_source, dbs, {MODEL: hps}, group="bench")
        applier.start()
        rng = np.random.default_rng(0)
        per = rows_per_message(DIM, args.send_buffer_size)
        # the topic made and found first (a server follows a trainer that has been publishing):
        # its creation and discovery (~0.1-0.15 s, once) fell in the first timed run alone;
        # and batches as large as the timed ones, so that the code of every path (RocksDB's
        # bulk loads from INGEST_ROWS_LIVE rows on) is compiled (numba's cache is per checkout:
        # a fresh one compiled during the first timed run, which read 0.06-0.07x the broker),
        # with keys outside the timed runs' range (theirs stay new)
        warm_rows = 4 * RocksDBStore.INGEST_ROWS_LIVE
        warm = rng.integers(20_000_000, 30_000_000, warm_rows).astype(np.int64)
        sink.publish_rows("sparse_embedding1", 0, warm, np.zeros((warm_rows, DIM), np.float32))
        sink.flush(60)
        if not wait_for(applier, lambda a: a.applied_rows >= warm_rows, 120):
            raise SystemExit("the first update was not applied within 120 s")
        for dist in ("uniform", "power-law"):
            if dist == "uniform":
                keys = rng.integers(1, 10_000_000, args.rows)
            else:
                keys = power_law_ranks(rng, args.rows, 10_000_000, 1.05) + 1
            values = rng.normal(0, 0.01, (args.rows, DIM)).astype(np.float32)
            before, served = applier.applied_rows, applier.serving.applied_rows
            t0 = time.perf_counter()
            sink.publish_rows("sparse_embedding1", 1, keys.astype(np.int64), values)
            sink.flush(120)
            ok = wait_for(applier, lambda a, b=served: a.serving.applied_rows >= b + args.rows,
                          120)
            serve_s = time.perf_counter() - t0
            ok = wait_for(applier, lambda a, b=before: a.applied_rows >= b + args.rows,
                          120) and ok
            jctr_s = time.perf_counter() - t0
            payloads = [encode_rows(MODEL, "sparse_embedding1", 1, keys[s:s + per],
                                    values[s:s + per]) for s in range(0, args.rows, per)]
            # the baseline on a quiet machine, its best of two: RocksDB's flushes and
            # compactions of what jctr just wrote ran beside it, and a plain consumer's fetch
            # now and then waits its fetch.wait.max.ms, so one run of it varied 2x
            settle(dbs.persistent.db)
            produce_s, consume_s = min((broker_rate(brokers, payloads) for _ in range(2)),
                                       key=sum)
            broker_s = produce_s + consume_s
            print(f"[{dist}] {args.rows:,} rows of {DIM} floats in {len(payloads)} messages: "
                  f"trainer sink -> served (hash map, device cache) {args.rows / serve_s:,.0f} "
                  f"rows/s, -> every layer (RocksDB too) {args.rows / jctr_s:,.0f} rows/s"
                  f"{'' if ok else ' (did not finish)'}; the broker alone (produce then "
                  f"consume the same bytes) {args.rows / broker_s:,.0f} rows/s (produce "
                  f"{args.rows / produce_s:,.0f}, consume {args.rows / consume_s:,.0f}): "
                  f"ratio served {broker_s / serve_s:.2f}, every layer {broker_s / jctr_s:.2f}")
        # latency of one step's update: 1,024 rows and the dense weights
        from jctr.checkpoint.model_files import dense_weights, host_network, non_trainable

        net = host_network(t.step_config, t.state)
        dense = dense_weights(net).astype("<f4").tobytes()
        nt = __import__("json").dumps(non_trainable(net))
        lat, lat_all = [], []
        # one update more than timed: the first compiles the device cache's refresh of 1,024
        # rows (~300 ms, which was the p99 of 20 updates)
        for i in range(args.updates + 1):
            step = 100 + i
            keys = rng.integers(1, 10_000_000, 1024).astype(np.int64)
            values = rng.normal(0, 0.01, (1024, DIM)).astype(np.float32)
            t0 = time.perf_counter()
            sink.publish_rows("sparse_embedding1", step, keys, values)
            sink.publish_dense(step, dense, nt)
            sink.producer.flush(0)
            key = f"hps_dense.{MODEL}"
            if wait_for(applier, lambda a, s=step, k=key: a.serving.last_step.get(k) == s,
                        30) and i:
                lat.append(time.perf_counter() - t0)
            if wait_for(applier, lambda a, s=step, k=key: a.last_step.get(k) == s, 30) and i:
                lat_all.append(time.perf_counter() - t0)

        def quantiles(xs):
            ms = sorted(1e3 * x for x in xs)
            return statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))]

        (p50, p99), (p50_all, p99_all) = quantiles(lat), quantiles(lat_all)
        print(f"[latency] {len(lat)} updates of 1,024 rows + dense weights ({len(dense):,} "
              f"bytes), publish -> served (hash map, device cache, dense swap): p50 {p50:.1f} "
              f"ms, p99 {p99:.1f} ms; -> RocksDB too: p50 {p50_all:.1f} ms, p99 "
              f"{p99_all:.1f} ms (poll_timeout_ms {args.poll_timeout_ms})")
        applier.close()
        hps.close()
        dbs.close()
    finally:
        subprocess.run(["bash", script, "stop", tmp], capture_output=True)
        # the broker's log, the bundle and the database: ~150 MB a run, left in /tmp before
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
