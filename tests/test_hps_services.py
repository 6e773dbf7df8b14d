"""The HPS against real servers the project starts: a 3-master Redis cluster (Debian's
redis-server, scripts/redis_cluster.sh) and ``python -m jctr.serve`` driven by Triton's own
KServe v2 client (tritonclient.http)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from jctr.config import load_config
from jctr.config.hps import PersistentDatabaseParams, VolatileDatabaseParams, load_ps_config
from jctr.serving.hps import Databases, LayerUnavailable, TableMismatch
from jctr.serving.hps_model import HPSModel
from jctr.stores import StoreError, StoreUnavailable
from jctr.stores.redis_cluster import NODE_BACKOFF_S, RedisClusterStore
from tests.conftest import ROOT, tiny_config

pytestmark = pytest.mark.service
SCRIPT = os.path.join(ROOT, "scripts", "redis_cluster.sh")
PASSWORD = "s3cret"
TOL = {"rtol": 3e-5, "atol": 3e-6}


def _free_port_block(n: int = 3) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n + 10000 + n >= 65536:
            continue
        ok = True
        for p in list(range(base, base + n)) + list(range(base + 10000, base + 10000 + n)):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return base
    raise RuntimeError("no free port block")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("redis")
    base = _free_port_block()
    env = {**os.environ, "REDIS_PORT": str(base)}
    out = subprocess.run(["bash", SCRIPT, "start", str(d), PASSWORD], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr + out.stdout
    info = {"dir": str(d), "ports": [base, base + 1, base + 2], "env": env,
            "address": f"127.0.0.1:{base},127.0.0.1:{base + 1}"}
    yield info
    subprocess.run(["bash", SCRIPT, "stop", str(d)], env=env, timeout=60)


def _start_node(cluster, port: int) -> subprocess.CompletedProcess:
    """Start the cluster's node on ``port`` again from its config (it comes back empty)."""
    return subprocess.run(["bash", SCRIPT, "node", cluster["dir"], str(port)],
                          env=cluster["env"], capture_output=True, text=True, timeout=60)


def _running(cluster, port: int) -> None:
    """Start the cluster's node on ``port`` again if a test killed it and failed before
    restarting it (the module's later tests share the cluster)."""
    try:
        pid = int(open(os.path.join(cluster["dir"], str(port), "redis.pid")).read())
        os.kill(pid, 0)
        return
    except (OSError, ValueError):
        pass
    _start_node(cluster, port)


def _volatile(cluster, **kw):
    return VolatileDatabaseParams(type="redis_cluster", address=cluster["address"],
                                  password=PASSWORD, num_partitions=6, **kw)


def _vectors(keys, dim=4):
    return np.asarray(keys, np.float32)[:, None] * 0.001 + np.arange(dim, dtype=np.float32)


def test_redis_store_insert_lookup_erase_and_overflow(cluster):
    store = RedisClusterStore(_volatile(cluster, max_get_batch_size=100,
                                        max_set_batch_size=70))
    store.drop_table("t")
    keys = np.arange(-500, 1500, dtype=np.int64) * 7919
    store.insert("t", keys, _vectors(keys))
    assert store.size("t") == keys.size and "t" in store.tables()
    sizes = store.partition_sizes("t")
    assert sizes.size == 6 and (sizes > 0).all()
    probe = np.concatenate([keys[::5], [1, 2, 3]])
    values, found = store.lookup("t", probe, 4)
    assert found[:-3].all() and not found[-3:].any()
    np.testing.assert_array_equal(values[:-3], _vectors(keys[::5]))
    store.erase("t", keys[:100])
    assert store.size("t") == keys.size - 100
    with pytest.raises(StoreError, match="holds vectors of size 4, asked for size 2"):
        store.lookup("t", keys, 2)
    store.drop_table("t")
    # overflow: every partition stays at most overflow_margin, cut to margin * target
    for policy in ("evict_oldest", "evict_random"):
        s = RedisClusterStore(_volatile(cluster, overflow_margin=50, overflow_policy=policy,
                                        overflow_resolution_target=0.6))
        s.drop_table("o")
        for start in range(0, 1200, 100):
            k = np.arange(start, start + 100)
            s.insert("o", k, _vectors(k))
            assert (s.partition_sizes("o") <= 50).all()
        assert s.evicted > 0
        if policy == "evict_oldest":
            assert s.lookup("o", np.arange(1190, 1200), 4)[1].all()
            assert not s.lookup("o", np.arange(0, 300), 4)[1].any()
        s.drop_table("o")
        s.close()
    store.close()


def test_a_new_base_over_redis_is_written_in_place_and_the_keys_it_lacks_erased(
        cluster, tmp_path):
    """Redis cannot swap a table in at once (``Databases.switch_links``): its share of the
    served table takes the new chain's rows of the keys it holds, then the keys the chain
    lacks are erased (read from the chain's keys, sorted); the manifest comes last."""
    dbs = Databases(_volatile(cluster),
                    PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")))
    table = "hps_et.switch.t"
    dbs.volatile.drop_table(table)
    old_keys = np.arange(100, dtype=np.int64)
    new_keys = np.arange(50, 180, dtype=np.int64)
    dbs.volatile.insert(table, old_keys[::2], _vectors(old_keys[::2]))
    asked = []

    def chain_keys():
        asked.append(1)
        return new_keys

    written = dbs.switch_links(
        "volatile_db", table, [lambda: ((new_keys, _vectors(new_keys) + 1),)],
        {"dim": 4, "day": 2}, chain_keys, held_only=True)
    assert written == 25 and asked == [1]
    keys = np.sort(np.concatenate([k for k, _ in dbs.volatile.items(table)]))
    np.testing.assert_array_equal(keys, np.arange(50, 100, 2))
    values, found = dbs.volatile.lookup(table, keys, 4)
    assert found.all()
    np.testing.assert_allclose(values, _vectors(keys) + 1)
    assert dbs.volatile.get_meta(table) == {"dim": 4, "day": 2}
    dbs.volatile.drop_table(table)
    dbs.close()


def test_wrong_password_and_unreachable_cluster_are_clear_errors(cluster):
    with pytest.raises(StoreError, match="authentication failed"):
        RedisClusterStore(VolatileDatabaseParams(type="redis_cluster",
                                                 address=cluster["address"], password="no"))
    port = _free_port_block(1)
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}: cannot reach the cluster"):
        RedisClusterStore(VolatileDatabaseParams(type="redis_cluster",
                                                 address=f"127.0.0.1:{port}"))
    assert time.monotonic() - start < 10


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from jctr.serving.bundle import export_bundle
    from jctr.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("hps_services")
    cfg = tiny_config(tmp, "wdl", max_iter=12, display=100, eval_interval=10_000,
                      eval_batches=1)
    t = Trainer(load_config(cfg), log=lambda s: None)
    t.fit()
    export_bundle(t.cfg, t.state, str(tmp / "bundle"), t.placements)
    batches = list(t.data.eval.batches(512, epochs=1))[:2]
    return tmp, [(b, t.predict(b)) for b in batches]


def test_lookups_survive_a_killed_redis_master(cluster, bundle, tmp_path):
    tmp, reference = bundle
    ps_doc = {"volatile_db": {"type": "redis_cluster", "address": cluster["address"],
                              "password": PASSWORD, "num_partitions": 6},
              "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
              "models": [{"model": "wdl_kill", "bundle": str(tmp / "bundle"),
                          "max_batch_size": 256, "gpucache": False}]}
    (tmp_path / "ps.json").write_text(json.dumps(ps_doc))
    ps = load_ps_config(tmp_path / "ps.json")
    dbs = Databases(ps.volatile_db, ps.persistent_db, backoff_s=0.3)
    model = HPSModel(ps.models[0], dbs, where="models[0]")
    errors, rounds = [], [0]
    stop = threading.Event()

    def load():
        while not stop.is_set():
            for batch, expected in reference:
                try:
                    np.testing.assert_allclose(model.predict(batch), expected, **TOL)
                except Exception as e:  # noqa: BLE001 - collected and asserted below
                    errors.append(e)
            rounds[0] += 1

    try:
        model.load_databases()
        worker = threading.Thread(target=load)
        worker.start()
        time.sleep(1.0)
        volatile_before = sum(s["volatile_db"] for s in model.stats().values())
        assert volatile_before > 0
        pid = int(open(os.path.join(cluster["dir"], str(cluster["ports"][1]),
                                    "redis.pid")).read())
        os.kill(pid, signal.SIGKILL)
        killed_at = rounds[0]
        time.sleep(1.0)
        v0 = sum(s["volatile_db"] for s in model.stats().values())
        time.sleep(1.0)
        assert rounds[0] > killed_at + 2  # requests kept coming back meanwhile
        assert dbs.volatile_failures > 0
        # down until it answers again, also between two retries after its backoff
        # (NODE_BACKOFF_S): health() does not flap to "up" on a loaded machine
        time.sleep(NODE_BACKOFF_S)
        assert dbs.volatile.down_nodes() == [f"127.0.0.1:{cluster['ports'][1]}"]
        assert dbs.health()["volatile_db"].startswith("down: ")
        # the other masters still answer: only the dead one's keys went to RocksDB
        assert sum(s["volatile_db"] for s in model.stats().values()) > v0
        persistent_during = sum(s["persistent_db"] for s in model.stats().values())
        # without RocksDB below, the dead master's keys fail the batch (no default rows)
        alone = Databases(ps.volatile_db, PersistentDatabaseParams(type="disabled"))
        solo = HPSModel(ps.models[0], alone, where="models[0]")
        try:
            with pytest.raises(LayerUnavailable, match="volatile_db: .* keys of "
                                                       "hps_et.wdl_kill.sparse_embedding"):
                solo.predict(reference[0][0])
            assert not alone.ready()
        finally:
            solo.close()
            alone.close()
        out = _start_node(cluster, cluster["ports"][1])
        assert out.returncode == 0, out.stderr
        # the restarted master comes back empty; Redis answers again and is used again
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            failures = dbs.volatile_failures
            time.sleep(1.0)
            if dbs.volatile_failures == failures:
                break
        v1 = sum(s["volatile_db"] for s in model.stats().values())
        time.sleep(1.0)
        assert sum(s["volatile_db"] for s in model.stats().values()) > v1
        assert sum(s["persistent_db"] for s in model.stats().values()) > 0
        assert persistent_during > 0
        assert dbs.volatile.down_nodes() == []
    finally:
        stop.set()
        worker.join(timeout=60)
        model.close()
        dbs.close()
        _running(cluster, cluster["ports"][1])  # the next tests' cluster whole, whatever failed
    assert not errors, errors[:3]


def test_a_redis_master_that_comes_back_empty_is_no_source_of_defaults(cluster, bundle,
                                                                         tmp_path):
    """Redis alone (no persistent database below): a master restarted without its data would
    make every key it held answer the default vector. Its partitions' markers are gone, so the
    table is down: lookups are a 503 naming the table and `serve load`, readiness says so; a
    load fills it and answers are right again."""
    from jctr.serving.cli import main as serve_main
    from jctr.serving.cli import open_models

    tmp, reference = bundle
    doc = {"volatile_db": {"type": "redis_cluster", "address": cluster["address"],
                           "password": PASSWORD, "num_partitions": 6},
           "persistent_db": {"type": "disabled"},
           "models": [{"model": "wdl_empty", "bundle": str(tmp / "bundle"),
                       "max_batch_size": 512, "gpucache": False}]}
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    assert serve_main(["load", "--config", str(tmp_path / "ps.json")]) == 0
    dbs, models = open_models(load_ps_config(tmp_path / "ps.json"), log=lambda s: None)
    model = models["wdl_empty"]
    try:
        batch, expected = reference[0]
        np.testing.assert_allclose(model.predict(batch), expected, **TOL)
        assert dbs.ready()
        port = cluster["ports"][2]
        pid = int(open(os.path.join(cluster["dir"], str(port), "redis.pid")).read())
        os.kill(pid, signal.SIGKILL)
        out = _start_node(cluster, port)
        assert out.returncode == 0, out.stderr
        deadline, why = time.monotonic() + 30, ""
        while time.monotonic() < deadline:  # until the restarted master answers again
            try:
                model.predict(batch)
            except LayerUnavailable as e:
                why = str(e)
                if "lost rows since it was loaded" in why:
                    break
                time.sleep(0.5)  # the master is still coming back: a 503 too
            else:
                raise AssertionError("answered from a table that lost rows (defaults)")
        assert re.search(r"hps_et.wdl_empty.sparse_embedding\d lost rows since it was loaded "
                         r"\((partition|its metadata)", why), why
        assert not dbs.ready()
        assert "run `python -m jctr.serve load`" in dbs.health()["volatile_db"]
        assert serve_main(["load", "--config", str(tmp_path / "ps.json")]) == 0
        time.sleep(dbs.backoff_s + 0.1)
        np.testing.assert_allclose(model.predict(batch), expected, **TOL)
        assert dbs.ready()
    finally:
        model.close()
        dbs.close()
        _running(cluster, cluster["ports"][2])


def _serve(ps_path, port, cwd):
    proc = subprocess.Popen([sys.executable, "-m", "jctr.serve", "--config", str(ps_path),
                             "--port", str(port)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready",
                                        timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not become ready")


def _csr(batch, data):
    """(dense, [(keys, row_offsets)] per sparse input) of a Batch's real samples."""
    n = int(batch.mask.sum())
    out = []
    for i, sp in enumerate(data.sparse):
        seg, keys = batch.segments[i], batch.keys[i]
        keep = seg < n * sp.slot_num
        order = np.argsort(seg[keep], kind="stable")
        offsets = np.searchsorted(seg[keep][order], np.arange(n * sp.slot_num + 1))
        out.append((keys[keep][order], offsets.astype(np.int32)))
    return batch.dense[:n], out


def test_kserve_v2_server_with_tritonclient(cluster, bundle, tmp_path):
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    tmp, reference = bundle
    port = _free_port_block(1)
    ps_doc = {"volatile_db": {"type": "redis_cluster", "address": cluster["address"],
                              "password": PASSWORD},
              "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
              "models": [{"model": "wdl", "bundle": str(tmp / "bundle"), "max_batch_size": 200,
                          "gpucacheper": 0.3}]}
    (tmp_path / "ps.json").write_text(json.dumps(ps_doc))
    proc = _serve(tmp_path / "ps.json", port, tmp_path)
    try:
        client = th.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_server_ready() and client.is_model_ready("wdl")
        meta = client.get_model_metadata("wdl")
        names = [i["name"] for i in meta["inputs"]]
        data = load_config(str(tmp / "bundle" / "config.json"), require_solver=False).data
        assert names == ["DES"] + [f"{kind}_{sp.top}" for sp in data.sparse
                                   for kind in ("CATCOLUMN", "ROWINDEX")]
        config = client.get_model_config("wdl")  # Triton's model configuration, as JSON
        assert config["name"] == "wdl" and config["max_batch_size"] == 200
        assert [(i["name"], i["data_type"]) for i in config["input"]][:2] == [
            ("DES", "TYPE_FP32"), (f"CATCOLUMN_{data.sparse[0].top}", "TYPE_INT64")]
        assert config["output"][0]["name"] == "OUTPUT0"
        for binary in (True, False):
            for batch, expected in reference:  # 512 samples: cut into batches of 200
                dense, sparse = _csr(batch, data)
                inputs = []
                d = th.InferInput("DES", list(dense.shape), "FP32")
                d.set_data_from_numpy(dense.astype(np.float32), binary_data=binary)
                inputs.append(d)
                for sp, (keys, offsets) in zip(data.sparse, sparse):
                    k = th.InferInput(f"CATCOLUMN_{sp.top}", [keys.size], "INT64")
                    k.set_data_from_numpy(keys, binary_data=binary)
                    o = th.InferInput(f"ROWINDEX_{sp.top}", [offsets.size], "INT32")
                    o.set_data_from_numpy(offsets, binary_data=binary)
                    inputs += [k, o]
                out = client.infer("wdl", inputs, outputs=[
                    th.InferRequestedOutput("OUTPUT0", binary_data=binary)])
                np.testing.assert_allclose(out.as_numpy("OUTPUT0").reshape(-1), expected,
                                           **TOL)
        # malformed requests: 400 naming the input; unknown models: 404
        bad = th.InferInput("DES", [2, 3], "FP32")
        bad.set_data_from_numpy(np.zeros((2, 3), np.float32))
        with pytest.raises(InferenceServerException, match=r"\[400\] input DES: expected "
                                                           r"shape \[n, 13\]"):
            client.infer("wdl", [bad])
        with pytest.raises(InferenceServerException, match="404"):
            client.infer("nope", [bad])
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/wdl/infer",
                                     data=b"{not json", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400 and b"not JSON" in e.value.read()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        assert 'jctr_requests_total{model="wdl",status="ok"} 4.0' in metrics
        assert 'jctr_requests_total{model="wdl",status="bad_request"} 2.0' in metrics
        assert "jctr_request_latency_seconds_bucket" in metrics
        hits = [line for line in metrics.splitlines()
                if line.startswith("jctr_embedding_lookups_total") and "device_cache" in line]
        assert len(hits) == 2 and any(float(h.split()[-1]) > 0 for h in hits)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_with_an_unreachable_redis_exits_with_a_clear_error(bundle, tmp_path):
    tmp, _ = bundle
    port = _free_port_block(1)
    ps_doc = {"volatile_db": {"type": "redis_cluster", "address": f"127.0.0.1:{port}"},
              "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
              "models": [{"model": "wdl", "bundle": str(tmp / "bundle"),
                          "max_batch_size": 64}]}
    (tmp_path / "ps.json").write_text(json.dumps(ps_doc))
    out = subprocess.run([sys.executable, "-m", "jctr.serve", "load", "--config",
                          str(tmp_path / "ps.json")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert f"127.0.0.1:{port}: cannot reach the cluster" in out.stderr
    assert not (tmp_path / "rocks").exists()  # nothing written


def test_persistent_only_fallback_and_load_command(bundle, tmp_path):
    """``load`` writes RocksDB; a server with no volatile database reads it."""
    tmp, reference = bundle
    ps_doc = {"volatile_db": {"type": "disabled"},
              "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
              "models": [{"model": "wdl", "bundle": str(tmp / "bundle"),
                          "max_batch_size": 512, "gpucache": False}]}
    (tmp_path / "ps.json").write_text(json.dumps(ps_doc))
    out = subprocess.run([sys.executable, "-m", "jctr.serve", "load", "--config",
                          str(tmp_path / "ps.json")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "hps_et.wdl.sparse_embedding1" in out.stdout
    ps = load_ps_config(tmp_path / "ps.json")
    dbs = Databases(ps.volatile_db, PersistentDatabaseParams(type="rocks_db",
                                                             path=str(tmp_path / "rocks"),
                                                             read_only=True))
    model = HPSModel(ps.models[0], dbs)
    try:
        batch, expected = reference[0]
        np.testing.assert_allclose(model.predict(batch), expected, **TOL)
        assert sum(s["persistent_db"] for s in model.stats().values()) > 0
    finally:
        model.close()
        dbs.close()


def _wait_closed(base: int, n: int = 3) -> None:
    """Until nothing listens on the cluster's ports (a stopped node exits asynchronously)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        busy = 0
        for p in range(base, base + n):
            with socket.socket() as s:
                busy += s.connect_ex(("127.0.0.1", p)) == 0
        if not busy:
            return
        time.sleep(0.1)
    raise AssertionError("the Redis nodes did not stop")


def test_serving_starts_while_redis_is_down_and_takes_it_up_when_it_answers(bundle, tmp_path):
    """The persistent database holds every row: serving starts without Redis, says so, keeps
    answering, and uses Redis once a cluster answers at the address."""
    from jctr.serving.cli import main as serve_main
    from jctr.serving.cli import open_models

    tmp, reference = bundle
    base = _free_port_block()
    rocks = str(tmp_path / "rocks")
    loader = {"volatile_db": {"type": "disabled"},
              "persistent_db": {"type": "rocks_db", "path": rocks},
              "models": [{"model": "wdl_up", "bundle": str(tmp / "bundle"),
                          "max_batch_size": 512, "gpucache": False}]}
    (tmp_path / "load.json").write_text(json.dumps(loader))
    assert serve_main(["load", "--config", str(tmp_path / "load.json")]) == 0
    doc = {**loader, "volatile_db": {"type": "redis_cluster", "address": f"127.0.0.1:{base}",
                                     "password": PASSWORD, "cache_missed_embeddings": True}}
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    d = tmp_path / "redis"
    env = {**os.environ, "REDIS_PORT": str(base)}
    # a cluster holding another export of a table is refused for it, naming both
    out = subprocess.run(["bash", SCRIPT, "start", str(d / "other"), PASSWORD], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr + out.stdout
    try:
        other = RedisClusterStore(VolatileDatabaseParams(
            type="redis_cluster", address=f"127.0.0.1:{base}", password=PASSWORD))
        other.set_meta("hps_et.wdl_up.sparse_embedding1", {"identity": "f" * 64, "dim": 1})
        other.close()
        with pytest.raises(TableMismatch, match=r"volatile_db \(redis_cluster\) table "
                                                r"hps_et.wdl_up.sparse_embedding1 holds export "
                                                r"ffffffffffff"):
            open_models(load_ps_config(tmp_path / "ps.json"), log=lambda s: None)
    finally:
        subprocess.run(["bash", SCRIPT, "stop", str(d / "other")], env=env, timeout=60)
    _wait_closed(base)
    lines = []
    dbs, models = open_models(load_ps_config(tmp_path / "ps.json"), log=lines.append)
    started = False
    try:
        assert any("serving from the persistent db" in x for x in lines), lines
        batch, expected = reference[0]
        np.testing.assert_allclose(models["wdl_up"].predict(batch), expected, **TOL)
        assert dbs.volatile is None and dbs.ready()
        out = subprocess.run(["bash", SCRIPT, "start", str(d), PASSWORD], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr + out.stdout
        started = True
        deadline = time.monotonic() + 30
        while dbs.volatile is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert dbs.volatile is not None and dbs.health()["volatile_db"] == "up"
        for _ in range(2):  # the first pass fills Redis (cache_missed_embeddings)
            np.testing.assert_allclose(models["wdl_up"].predict(batch), expected, **TOL)
        assert sum(s["volatile_db"] for s in models["wdl_up"].stats().values()) > 0
    finally:
        for m in models.values():
            m.close()
        dbs.close()
        if started:
            subprocess.run(["bash", SCRIPT, "stop", str(d)], env=env, timeout=60)
