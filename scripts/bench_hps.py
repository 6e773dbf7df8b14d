"""HPS lookup throughput and latency per layer, next to what the storage itself gives in the
same run, and the end-to-end latency of ``/infer`` on a DLRM with the Redis layer.

Every layer answers lookups of 10,000 distinct keys (HPS queries each key of a batch once),
fresh each time: drawn uniformly or power-law (alpha 1.05) over the table's keys, 5% of them
keys the table has never seen. Baselines, measured on the same keys:

* hash maps: a Python dict {key: row} + numpy gather, and numpy ``searchsorted`` on sorted keys;
* Redis cluster: ``redis-benchmark --cluster -t set,get -P 64 -d 64 -r 100000`` (pipelined
  GETs of one 64-byte value each, of keys its SET pass wrote) against the same cluster;
* RocksDB: one raw ``rocksdict`` multi-get of the same keys (no chunking, no decoding).

The end-to-end part starts ``python -m jctr.serve`` on a DLRM of the Criteo shape
(configs/dlrm.json: 13 dense, 26 one-hot slots, dim 16) whose table lives in Redis + RocksDB
(device cache 20%), and sends 1,024-sample requests with tritonclient.

    python scripts/bench_hps.py                 # starts its own Redis cluster
    python scripts/bench_hps.py --rows 500000 --rounds 30
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jctr._x64  # noqa: E402,F401  (64-bit keys)
from jctr.config.hps import PersistentDatabaseParams, VolatileDatabaseParams  # noqa: E402
from jctr.data.tools.synthetic import power_law_ranks  # noqa: E402
from jctr.ops.host_sort import unique  # noqa: E402  (numpy's np.unique hashes: slow)
from jctr.serving.device_cache import DeviceCache  # noqa: E402
from jctr.stores.hash_map import HashMapStore  # noqa: E402
from jctr.stores.redis_cluster import RedisClusterStore  # noqa: E402
from jctr.stores.rocksdb import RocksDBStore  # noqa: E402

DIM = 16
QUERY = 10_000
PASSWORD = "bench"


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", out).group(1).strip()
        flags = re.search(r"Flags:\s*(.+)", out).group(1).split()
        simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        return f"{model} ({os.cpu_count()} CPUs; {' '.join(simd)})"
    except Exception:  # noqa: BLE001 - a label only
        return "unknown CPU"


def free_port_block(n: int) -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        ports = list(range(base, base + n)) + list(range(base + 10000, base + 10000 + n))
        if max(ports) >= 65536:
            continue
        try:
            for p in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def query_batches(rng, keys: np.ndarray, rounds: int, law: str) -> list[np.ndarray]:
    """Fresh distinct-key queries: 95% from the table (uniform or power-law), 5% unseen."""
    out = []
    order = rng.permutation(keys)  # power-law ranks over a shuffled table
    for _ in range(rounds):
        n_old = int(QUERY * 0.95)
        if law == "uniform":
            old = rng.choice(keys, n_old * 2)
        else:
            old = order[power_law_ranks(rng, n_old * 4, keys.size, 1.05)]
        old = unique(old)[:n_old]
        rng.shuffle(old)
        new = rng.integers(2 ** 62, 2 ** 63 - 1, QUERY - old.size, dtype=np.int64)
        out.append(np.concatenate([old, new]))
    return out


def timed(fn, queries) -> dict:
    fn(queries[0])  # warm-up (compiles, connects)
    lat = []
    for q in queries:
        t = time.perf_counter()
        fn(q)
        lat.append(time.perf_counter() - t)
    lat = np.array(lat)
    return {"keys_per_s": QUERY / float(np.median(lat)), "p50_ms": 1e3 * np.median(lat),
            "p99_ms": 1e3 * float(np.percentile(lat, 99))}


def row(name: str, r: dict, base: dict | None = None, base_name: str = "") -> None:
    ratio = f"  {r['keys_per_s'] / base['keys_per_s']:.2f}x {base_name}" if base else ""
    print(f"  {name:<34} {r['keys_per_s'] / 1e6:7.2f} M keys/s   p50 {r['p50_ms']:7.2f} ms   "
          f"p99 {r['p99_ms']:7.2f} ms{ratio}", flush=True)


def redis_benchmark(port: int) -> float:
    out = subprocess.run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-a", PASSWORD,
                          "--cluster", "-t", "set,get", "-n", "400000", "-P", "64",
                          "-d", str(4 * DIM), "-r", "100000", "-q"],
                         capture_output=True, text=True, timeout=300)
    m = re.findall(r"GET:\s*([\d.]+) requests per second", out.stdout + out.stderr)
    if not m:
        raise RuntimeError(f"redis-benchmark printed no GET rate: {out.stdout[-500:]}"
                           f"{out.stderr[-500:]}")
    return float(m[-1])


def bench_layers(args, rng, work: str, cluster_address: str | None, redis_port: int | None):
    keys = unique(rng.integers(0, 2 ** 62, args.rows, dtype=np.int64))
    values = rng.standard_normal((keys.size, DIM)).astype(np.float32)
    results = {}
    for law in ("uniform", "power-law"):
        bench_law(args, rng, work, keys, values, law, cluster_address, redis_port, results)
    return results


def bench_law(args, rng, work, keys, values, law, cluster_address, redis_port, results):
    queries = query_batches(rng, keys, args.rounds, law)
    print(f"\n{law} keys, {keys.size:,}-row table, dim {DIM}, {QUERY:,} distinct keys per "
          "lookup (5% unseen):", flush=True)
    # baselines for the in-memory maps
    index = {int(k): i for i, k in enumerate(keys)}

    def by_dict(q):
        rows = np.fromiter((index.get(k, -1) for k in q.tolist()), np.int64, q.size)
        return values[np.where(rows >= 0, rows, 0)]

    sorted_keys = keys  # unique sorted them

    def by_searchsorted(q):
        pos = np.minimum(np.searchsorted(sorted_keys, q), sorted_keys.size - 1)
        return values[pos], sorted_keys[pos] == q

    base_dict = timed(by_dict, queries)
    base_np = timed(by_searchsorted, queries)
    row("baseline: Python dict + numpy", base_dict)
    row("baseline: numpy searchsorted", base_np)
    for kind in ("hash_map", "parallel_hash_map"):
        store = HashMapStore(VolatileDatabaseParams(type=kind))
        for s in range(0, keys.size, 1 << 20):
            store.insert("t", keys[s:s + (1 << 20)], values[s:s + (1 << 20)])
        r = timed(lambda q, st=store: st.lookup("t", q, DIM), queries)
        row(f"jctr {kind}", r, base_dict, "dict")
        results[f"{law}/{kind}"] = r
        store.close()
    # device cache of 20% of the table, warmed with the hottest/most recent keys
    cache = DeviceCache(int(keys.size * 0.2), DIM)
    for q in query_batches(rng, keys, 20, law):
        hit, _ = cache.query(q, size=16384)
        miss = q[~hit]
        pos = np.searchsorted(keys, miss)
        known = (pos < keys.size) & (keys[np.minimum(pos, keys.size - 1)] == miss)
        cache.insert(miss[known], values[pos[known]])
    hits = []

    def by_cache(q):
        hit, vals = cache.query(q, size=16384)
        vals.block_until_ready()
        hits.append(hit.mean())

    r = timed(by_cache, queries)
    row(f"jctr device cache (hit rate {np.mean(hits):.2f})", r, base_np, "searchsorted")
    results[f"{law}/device_cache"] = r
    # RocksDB
    path = os.path.join(work, f"rocks_{law}")
    rdb = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=path))
    rdb.insert("t", keys, values)
    cf = rdb._families["t"]

    def raw_multiget(q):
        raw = q.astype("<i8").tobytes()
        return cf.get([raw[i:i + 8] for i in range(0, len(raw), 8)])

    base_rocks = timed(raw_multiget, queries)
    row("baseline: raw rocksdict multi-get", base_rocks)
    r = timed(lambda q: rdb.lookup("t", q, DIM), queries)
    row("jctr rocks_db", r, base_rocks, "raw multi-get")
    results[f"{law}/rocks_db"] = r
    rdb.close()
    # Redis cluster
    if cluster_address:
        store = RedisClusterStore(VolatileDatabaseParams(
            type="redis_cluster", address=cluster_address, password=PASSWORD))
        store.drop_table("t")
        for s in range(0, keys.size, 200_000):
            store.insert("t", keys[s:s + 200_000], values[s:s + 200_000])
        rate = redis_benchmark(redis_port)
        base = {"keys_per_s": rate, "p50_ms": float("nan"), "p99_ms": float("nan")}
        print(f"  {'baseline: redis-benchmark -P 64 GET':<34} {rate / 1e6:7.2f} M keys/s",
              flush=True)
        r = timed(lambda q: store.lookup("t", q, DIM), queries)
        row("jctr redis_cluster", r, base, "redis-benchmark")
        results[f"{law}/redis_cluster"] = r
        results[f"{law}/redis_benchmark_keys_per_s"] = rate
        store.drop_table("t")
        store.close()


def bench_infer(args, rng, work: str, cluster_address: str) -> dict:
    import tritonclient.http as th

    from jctr.checkpoint.model_files import write_sparse_model
    from jctr.config import load_config
    from jctr.models.ctr import build_model
    from jctr.serving.bundle import export_bundle

    cfg = load_config(os.path.join(ROOT, "configs", "dlrm.json"), require_solver=False)
    _, init_state = build_model(cfg, capacities={e.name: 1 for e in cfg.embeddings})
    bundle = export_bundle(cfg, init_state(), os.path.join(work, "dlrm_bundle"))
    rows = args.infer_rows
    keys = unique(rng.integers(0, 2 ** 62, rows, dtype=np.int64))
    sparse = os.path.join(work, "dlrm_sparse.model")
    write_sparse_model(sparse, keys, rng.standard_normal((keys.size, DIM)).astype(np.float32)
                       * 0.05)
    port = free_port_block(1)
    ps = {"volatile_db": {"type": "redis_cluster", "address": cluster_address,
                          "password": PASSWORD},
          "persistent_db": {"type": "rocks_db", "path": os.path.join(work, "rocks_infer")},
          "models": [{"model": "dlrm", "network_file": f"{bundle}/config.json",
                      "dense_file": f"{bundle}/dense.model", "sparse_files": [sparse],
                      "max_batch_size": 1024, "gpucacheper": 0.2}]}
    path = os.path.join(work, "ps.json")
    with open(path, "w") as f:
        json.dump(ps, f)
    proc = subprocess.Popen([sys.executable, "-m", "jctr.serve", "--config", path, "--port",
                             str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        client = th.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120)
        deadline = time.monotonic() + 300
        while True:
            try:
                if client.is_server_ready():
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {proc.stdout.read()[-2000:]}")
            time.sleep(0.5)
        order = rng.permutation(keys)
        lat = []
        for i in range(args.requests + 3):
            cat = order[power_law_ranks(rng, 1024 * 26, keys.size, 1.05)].reshape(1024, 26)
            new = rng.random(cat.shape) < 0.05
            cat[new] = rng.integers(2 ** 62, 2 ** 63 - 1, int(new.sum()), dtype=np.int64)
            dense = rng.random((1024, 13), dtype=np.float32)
            d = th.InferInput("DES", [1024, 13], "FP32")
            d.set_data_from_numpy(dense)
            k = th.InferInput("CATCOLUMN", [1024, 26], "INT64")
            k.set_data_from_numpy(cat)
            t = time.perf_counter()
            client.infer("dlrm", [d, k])
            if i >= 3:  # the first requests compile
                lat.append(time.perf_counter() - t)
        lat = np.array(lat)
        out = {"p50_ms": 1e3 * float(np.median(lat)), "p99_ms": 1e3 * float(np.percentile(lat, 99)),
               "samples_per_s": 1024 / float(np.median(lat))}
        print(f"\n/infer, DLRM (26 one-hot slots, {keys.size:,}-row table in Redis + RocksDB, "
              f"device cache 20%), 1,024-sample requests, power-law keys with 5% unseen: "
              f"p50 {out['p50_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms, "
              f"{out['samples_per_s']:,.0f} samples/s", flush=True)
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="table rows (1,000,000)")
    ap.add_argument("--rounds", type=int, default=40, help="timed lookups per layer (40)")
    ap.add_argument("--requests", type=int, default=60, help="timed /infer requests (60)")
    ap.add_argument("--infer-rows", type=int, default=500_000,
                    help="rows of the DLRM table served end to end (500,000)")
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis layer and /infer")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    print(f"bench_hps on {cpu_name()}", flush=True)
    rng = np.random.default_rng(0)
    work = tempfile.mkdtemp(prefix="jctr_bench_hps_")
    script = os.path.join(ROOT, "scripts", "redis_cluster.sh")
    env = None
    try:
        address = port = None
        if not args.no_redis:
            if not shutil.which("redis-server"):
                subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_services.sh")],
                               check=True)
            port = free_port_block(3)
            env = {**os.environ, "REDIS_PORT": str(port)}
            subprocess.run(["bash", script, "start", os.path.join(work, "redis"), PASSWORD],
                           env=env, check=True, stdout=subprocess.DEVNULL)
            address = f"127.0.0.1:{port},127.0.0.1:{port + 1},127.0.0.1:{port + 2}"
        results = bench_layers(args, rng, work, address, port)
        if address:
            results["infer"] = bench_infer(args, rng, work, address)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"cpu": cpu_name(), **results}, f, indent=1)
    finally:
        if env is not None:
            subprocess.run(["bash", script, "stop", os.path.join(work, "redis")], env=env)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
