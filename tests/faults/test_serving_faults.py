"""Serving never answers wrongly with a success status: databases that hold another export or a
half-finished load are refused, a layer that does not answer fails the request instead of
turning into defaults, non-finite inputs and weights are refused, relative paths mean the
parameter-server file's folder."""

import json
import os
import re

import numpy as np
import pytest

from jctr.checkpoint.model_files import ModelFileError
from jctr.config import load_config
from jctr.config.hps import PersistentDatabaseParams, VolatileDatabaseParams, load_ps_config
from jctr.serving.cli import open_models
from jctr.serving.hps import Databases, LayerUnavailable, TableMismatch
from jctr.stores.base import PartialUnavailable, StoreUnavailable
from tests.conftest import ROOT, tiny_config

TOL = {"rtol": 3e-5, "atol": 3e-6}


def _train_and_export(tmp, bundle, max_iter, seed):
    from jctr.serving.bundle import export_bundle
    from jctr.train.trainer import Trainer

    cfg = tiny_config(tmp, "wdl", max_iter=max_iter, display=100, eval_interval=10_000,
                      eval_batches=1, seed=seed)
    t = Trainer(load_config(cfg), log=lambda s: None)
    t.fit()
    export_bundle(t.cfg, t.state, str(bundle), t.placements)
    batch = next(iter(t.data.eval.batches(256, epochs=1)))
    return batch, t.predict(batch)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Two exports of the same model, one after the other into the same bundle folder."""
    tmp = tmp_path_factory.mktemp("serving_faults")
    first = _train_and_export(tmp, tmp / "bundle", 6, 1)
    os.rename(tmp / "bundle", tmp / "first")
    second = _train_and_export(tmp, tmp / "bundle", 10, 2)
    os.rename(tmp / "bundle", tmp / "second")
    return tmp, first, second


def _use(tmp, which):
    """Put export ``which`` in ``tmp/bundle`` (as re-exporting into the folder does)."""
    import shutil

    shutil.rmtree(tmp / "bundle", ignore_errors=True)
    shutil.copytree(tmp / which, tmp / "bundle")


def _ps_file(folder, tmp, volatile, **persistent):
    doc = {"volatile_db": volatile,
           "persistent_db": {"type": "rocks_db", "path": "rocks", **persistent},
           "models": [{"model": "wdl", "bundle": str(tmp / "bundle"), "max_batch_size": 256,
                       "gpucache": False}]}
    path = folder / "ps.json"
    path.write_text(json.dumps(doc))
    return path


def _serve_open(path):
    return open_models(load_ps_config(path), log=lambda s: None)


def _close(dbs, models):
    for m in models.values():
        m.close()
    dbs.close()


def _predict(path, batch):
    dbs, models = _serve_open(path)
    try:
        return models["wdl"].predict(batch)
    finally:
        _close(dbs, models)


def _load(path):
    from jctr.serving.cli import main

    assert main(["load", "--config", str(path)]) == 0


def test_a_store_holding_another_export_is_refused_until_loaded(exports, tmp_path):
    tmp, (batch, first_pred), (_, second_pred) = exports
    _use(tmp, "first")
    path = _ps_file(tmp_path, tmp, {"type": "disabled"})
    np.testing.assert_allclose(_predict(path, batch), first_pred, **TOL)  # serve loads it
    # relative persistent_db.path: beside the parameter-server file, not in the cwd
    assert (tmp_path / "rocks" / "CURRENT").exists()
    # a retrained model exported into the same folder; serve restarted without load
    _use(tmp, "second")
    with pytest.raises(TableMismatch) as e:
        _serve_open(path)
    text = str(e.value)
    assert "persistent_db (rocks_db) table hps_et.wdl.sparse_embedding1 holds export" in text
    assert "python -m jctr.serve load" in text
    ids = re.findall(r"export ([0-9a-f]{12})", text)
    assert len(set(ids)) == 2  # both identities named
    _load(path)
    np.testing.assert_allclose(_predict(path, batch), second_pred, **TOL)


def test_a_load_stopped_half_way_is_not_served(exports, tmp_path, monkeypatch):
    tmp, (batch, first_pred), _ = exports
    _use(tmp, "first")
    path = _ps_file(tmp_path, tmp, {"type": "hash_map"}, max_set_batch_size=50)
    from jctr.stores.rocksdb import RocksDBStore

    real = RocksDBStore.insert
    calls = []

    def dying_insert(self, table, keys, values):
        calls.append(len(keys))
        if len(calls) == 2:
            raise KeyboardInterrupt  # the load is stopped here
        return real(self, table, keys, values)

    monkeypatch.setattr(RocksDBStore, "insert", dying_insert)
    from jctr.serving.cli import main

    assert main(["load", "--config", str(path)]) != 0  # interrupted
    monkeypatch.setattr(RocksDBStore, "insert", real)
    with pytest.raises(TableMismatch, match="holds rows but no manifest: it was never loaded "
                                            "completely"):
        _serve_open(path)
    _load(path)
    np.testing.assert_allclose(_predict(path, batch), first_pred, **TOL)


class _DownStore:
    """A volatile store that does not answer (a Redis cluster that went away)."""

    name = "redis_cluster"

    def __init__(self, partial=None):
        self.partial = partial

    def lookup(self, table, keys, dim):
        if self.partial is None:
            raise StoreUnavailable("redis_cluster 127.0.0.1:1: lookup failed (down)")
        values = np.zeros((keys.size, dim), np.float32)
        failed = self.partial(keys)
        values[~failed] = 7.0
        raise PartialUnavailable("one master down", values, ~failed, failed)

    def get_meta(self, table):
        return None

    def close(self):
        pass


def test_an_unanswering_layer_fails_the_lookup_instead_of_defaults(tmp_path):
    keys = np.arange(10, dtype=np.int64)
    # volatile only: its keys have nowhere else to come from
    dbs = Databases(VolatileDatabaseParams(type="hash_map"), PersistentDatabaseParams())
    dbs.volatile.close()
    dbs.volatile = _DownStore()
    with pytest.raises(LayerUnavailable, match="volatile_db: 10 of 10 keys of t are held only "
                                               "by the hash_map database"):
        dbs.lookup("t", keys, 4, default=0.5)
    assert dbs.health()["volatile_db"].startswith("down") and not dbs.ready()
    # one master of several down: only its keys are unanswered
    dbs = Databases(VolatileDatabaseParams(type="hash_map"), PersistentDatabaseParams())
    dbs.volatile = _DownStore(partial=lambda k: k % 3 == 0)
    with pytest.raises(LayerUnavailable, match="4 of 10 keys"):
        dbs.lookup("t", keys, 4, default=0.5)
    # with a persistent database (it holds every row) the down master's share goes there
    rocks = PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db"))
    dbs = Databases(VolatileDatabaseParams(type="hash_map"), rocks)
    dbs.persistent.insert("t", keys[:7], np.full((7, 4), 3.0, np.float32))
    dbs.volatile = _DownStore(partial=lambda k: k % 3 == 0)
    values, found, counts = dbs.lookup("t", keys, 4, default=0.5)
    assert counts == {"volatile_db": 6, "persistent_db": 3}  # keys 0, 3, 6 from RocksDB
    assert found.tolist() == [True] * 9 + [False]  # 9: known to no layer -> default
    np.testing.assert_array_equal(values[[0, 3, 6]], 3.0)
    np.testing.assert_array_equal(values[[1, 2, 4]], 7.0)
    np.testing.assert_array_equal(values[9], 0.5)
    assert dbs.ready()
    dbs.persistent.close()


def test_serve_starts_without_redis_when_rocksdb_holds_every_row(exports, tmp_path):
    tmp, (batch, first_pred), _ = exports
    _use(tmp, "first")
    from tests.test_hps_services import _free_port_block

    port = _free_port_block(1)
    dead = {"type": "redis_cluster", "address": f"127.0.0.1:{port}"}
    path = _ps_file(tmp_path, tmp, dead)
    # nothing loaded yet: nothing holds the rows while Redis is down -> load refuses
    from jctr.serving.cli import main

    assert main(["load", "--config", str(path)]) == 2
    # the persistent database holds every row (loaded with the volatile db disabled)
    (tmp_path / "x").mkdir()
    _load(_ps_file(tmp_path / "x", tmp, {"type": "disabled"}, path=str(tmp_path / "rocks")))
    lines = []
    dbs, models = open_models(load_ps_config(path), log=lines.append)
    try:
        assert any("cannot reach the cluster" in line and "serving from the persistent db"
                   in line for line in lines), lines
        np.testing.assert_allclose(models["wdl"].predict(batch), first_pred, **TOL)
        assert dbs.ready()
        assert dbs.health()["volatile_db"].startswith("down")
    finally:
        _close(dbs, models)
    # without a persistent database, serve does not start on a dead Redis
    no_p = tmp_path / "y"
    no_p.mkdir()
    doc = json.loads(path.read_text())
    doc["persistent_db"] = {"type": "disabled"}
    (no_p / "ps.json").write_text(json.dumps(doc))
    with pytest.raises(StoreUnavailable, match="cannot reach the cluster"):
        _serve_open(no_p / "ps.json")


def _without_checksums(bundle) -> None:
    """As a bundle of an older jctr (or files put together by hand): no checksums to check,
    so the checks of the values themselves are what stands."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["files"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def test_non_finite_weights_are_refused_at_load(exports, tmp_path):
    import shutil

    tmp, (batch, _), _ = exports
    bundle = tmp_path / "bundle"
    shutil.copytree(tmp / "first", bundle)
    dense = np.fromfile(bundle / "dense.model", "<f4")
    dense[5] = np.nan
    dense.tofile(bundle / "dense.model")
    from jctr.serving.bundle import InferenceModel

    with pytest.raises(ModelFileError, match=r"dense.model: damaged bundle file \(checksum"):
        InferenceModel.load(str(bundle))
    _without_checksums(bundle)

    with pytest.raises(ModelFileError, match=r"dense.model: 1 non-finite weight\(s\)"):
        InferenceModel.load(str(bundle))
    shutil.rmtree(bundle)
    shutil.copytree(tmp / "first", bundle)
    emb = next((bundle / "sparse").iterdir()) / "emb_vector"
    vec = np.fromfile(emb, "<f4")
    vec[3] = np.inf
    vec.tofile(emb)
    _without_checksums(bundle)
    doc = {"volatile_db": {"type": "hash_map"},
           "models": [{"model": "wdl", "bundle": str(bundle), "max_batch_size": 256}]}
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    with pytest.raises(ModelFileError, match=r"emb_vector: 1 row\(s\) with non-finite values"):
        _serve_open(tmp_path / "ps.json")


class _Http:
    """An app served by uvicorn on a thread; ``get`` / ``post`` return (status, JSON)."""

    def __init__(self, app):
        import threading

        import uvicorn

        from tests.test_hps_services import _free_port_block

        self.port = _free_port_block(1)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        import time

        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    def request(self, path, body=None):
        import urllib.error
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=body,
                                     method="POST" if body is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def test_non_finite_requests_and_predictions_never_reach_json(exports):
    from jctr.serving.server import RequestError, build_app, infer_response, request_features

    tmp, (batch, _), _ = exports
    _use(tmp, "first")
    doc = {"volatile_db": {"type": "hash_map"},
           "models": [{"model": "wdl", "bundle": str(tmp / "bundle"), "max_batch_size": 64}]}
    (tmp / "ps_nan.json").write_text(json.dumps(doc))
    dbs, models = _serve_open(tmp / "ps_nan.json")
    try:
        model = models["wdl"]
        n = 2
        des = np.zeros((n, model.cfg.data.dense_dim), np.float32)
        des[1, 3] = np.nan
        tensors = {"DES": des}
        for sp in model.cfg.data.sparse:
            tensors[f"CATCOLUMN_{sp.top}"] = np.ones((n, sp.slot_num), np.int64)
        with pytest.raises(RequestError, match=r"input DES: 1 non-finite value\(s\) \(NaN or "
                                               r"infinity\), the first at sample 1, feature 3"):
            request_features(model, tensors)
        with pytest.raises(ValueError, match="non-finite values for 1 sample"):
            infer_response(model, {}, np.array([[0.5], [np.nan]], np.float32))
        http = _Http(build_app(models))
        body = {"inputs": [{"name": "DES", "datatype": "FP32", "shape": [n, des.shape[1]],
                            "data": [0.0] * des.size}]}
        body["inputs"][0]["data"][5] = "NaN"
        status, answer = http.request("/v2/models/wdl/infer",
                                      json.dumps(body).replace('"NaN"', "NaN").encode())
        assert status == 400 and "non-finite" in answer["error"], answer
        status, cfg = http.request("/v2/models/wdl/config")
        assert cfg["name"] == "wdl" and cfg["max_batch_size"] == 64
        assert cfg["input"][0] == {"name": "DES", "data_type": "TYPE_FP32",
                                   "format": "FORMAT_NONE", "dims": [des.shape[1]],
                                   "is_shape_tensor": False, "optional": False}
        assert cfg["output"][0]["name"] == "OUTPUT0"
        assert http.request("/v2/health/ready") == (200, {"ready": True,
                                                          "layers": {"volatile_db": "up"}})
        http.close()
    finally:
        _close(dbs, models)


def test_shipped_parameter_server_file_keeps_its_database_in_the_checkout(exports,
                                                                         monkeypatch):
    from jctr.config.hps import parse_ps_config

    tmp = exports[0]
    shipped = os.path.join(ROOT, "configs", "hps", "ps_dlrm.json")
    with open(shipped) as f:
        raw = json.load(f)
    raw["models"][0]["bundle"] = str(tmp / "first")  # the shipped one needs a trained DLRM
    raw["models"][0].pop("default_value_for_each_table")
    monkeypatch.chdir(tmp)  # from any working directory
    ps = parse_ps_config(raw, source=shipped)
    assert ps.persistent_db.path == os.path.join(ROOT, "runs", "hps_rocksdb")


def test_a_layer_down_is_a_503_an_unready_server_and_a_metric(exports):
    """Over HTTP: the batch fails with 503 naming the layer, readiness turns 503, /metrics
    shows the layer down and the refused batch; nothing is answered with defaults."""
    import urllib.request

    from jctr.serving.server import build_app

    tmp, (batch, _), _ = exports
    _use(tmp, "first")
    doc = {"volatile_db": {"type": "hash_map"},
           "models": [{"model": "wdl", "bundle": str(tmp / "bundle"), "max_batch_size": 64,
                       "gpucache": False}]}
    (tmp / "ps_down.json").write_text(json.dumps(doc))
    dbs, models = _serve_open(tmp / "ps_down.json")
    http = None
    try:
        model = models["wdl"]
        n = 2
        body = {"inputs": [{"name": "DES", "datatype": "FP32",
                            "shape": [n, model.cfg.data.dense_dim],
                            "data": [0.0] * (n * model.cfg.data.dense_dim)}]}
        for sp in model.cfg.data.sparse:
            body["inputs"].append({"name": f"CATCOLUMN_{sp.top}", "datatype": "INT64",
                                   "shape": [n, sp.slot_num],
                                   "data": list(range(1, n * sp.slot_num + 1))})
        http = _Http(build_app(models))
        status, answer = http.request("/v2/models/wdl/infer", json.dumps(body).encode())
        assert status == 200 and len(answer["outputs"][0]["data"]) == n
        dbs.volatile.close()
        dbs.volatile = _DownStore()  # the only layer stops answering
        status, answer = http.request("/v2/models/wdl/infer", json.dumps(body).encode())
        assert status == 503, answer
        assert answer["error"].startswith("embedding lookup failed: volatile_db: ")
        status, ready = http.request("/v2/health/ready")
        assert status == 503 and ready["ready"] is False
        assert ready["layers"]["volatile_db"].startswith("down: ")
        assert http.request("/v2/models/wdl/ready")[0] == 503
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{http.port}/metrics", timeout=30).read().decode()
        assert 'jctr_store_up{layer="volatile_db"} 0.0' in metrics
        assert any(line.startswith("jctr_unanswered_batches_total{") and
                   float(line.split()[-1]) >= 1 for line in metrics.splitlines())
        assert 'jctr_requests_total{model="wdl",status="unavailable"} 1.0' in metrics
    finally:
        if http is not None:
            http.close()
        _close(dbs, models)


def test_a_wrong_model_path_leaves_no_database_folder(tmp_path):
    """A parameter-server file whose model files are not there is refused, naming the field,
    before any database is opened: the RocksDB folder it names is not created."""
    from jctr.config import ConfigError
    from jctr.config.hps import parse_ps_config
    from jctr.serving.cli import open_models

    ps = parse_ps_config({
        "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
        "models": [{"model": "m", "max_batch_size": 64,
                    "network_file": str(tmp_path / "nope" / "config.json"),
                    "dense_file": str(tmp_path / "nope" / "dense.model"),
                    "sparse_files": [str(tmp_path / "nope" / "sparse")]}]},
        str(tmp_path / "ps.json"))
    with pytest.raises(ConfigError, match=r"models\[0\]\.network_file: .*config.json: no such"):
        open_models(ps)
    assert not (tmp_path / "rocks").exists()


def test_inference_model_refuses_what_the_endpoint_refuses(exports):
    """InferenceModel.predict took 64-bit keys narrowed to int32 (other keys: silently wrong
    predictions) and NaN dense features, which the HTTP endpoint refuses (issue 35)."""
    from jctr.data.batch import Batch, BatchError
    from jctr.serving.bundle import InferenceModel

    tmp, (batch, want), _ = exports
    model = InferenceModel.load(str(tmp / "first"))
    np.testing.assert_allclose(model.predict(batch), want, rtol=1e-5, atol=1e-6)
    narrowed = Batch(batch.label, batch.dense, tuple(np.asarray(k).astype(np.int32)
                                                     for k in batch.keys),
                     batch.segments, batch.mask)
    with pytest.raises(BatchError, match=r"Batch\.keys\[0\]: int32 keys, but the model's "
                                         r"keys are 64-bit \(input_key_type I64\)"):
        model.predict(narrowed)
    dense = np.array(batch.dense, copy=True)
    dense[3, 2] = np.nan
    with pytest.raises(BatchError, match=r"Batch\.dense: 1 non-finite value\(s\) \(NaN or "
                                         r"infinity\), the first at sample 3, feature 2"):
        model.predict(Batch(batch.label, dense, batch.keys, batch.segments, batch.mask))


def test_malformed_binary_requests_are_400s_that_say_what_is_off():
    """A tensor header of shape [2^32, 2^32] with binary_data_size 0 wrapped to 0 values and
    became an HTTP 500 (ValueError); a binary request whose JSON header length was off was
    reported as "not JSON" (issue 35). Both are request errors (400) naming the cause."""
    from jctr.serving.server import HEADER, RequestError, parse_infer_request

    huge = {"inputs": [{"name": "DES", "datatype": "FP32", "shape": [2**32, 2**32],
                        "parameters": {"binary_data_size": 0}}]}
    head = json.dumps(huge).encode()
    with pytest.raises(RequestError, match=r"input DES: shape \[4294967296, 4294967296\] "
                                           r"holds 18,446,744,073,709,551,616 values; at most"):
        parse_infer_request(head, len(head))
    ok = {"inputs": [{"name": "DES", "datatype": "FP32", "shape": [1, 2],
                      "parameters": {"binary_data_size": 8}}]}
    head = json.dumps(ok).encode()
    body = head + np.zeros(2, np.float32).tobytes()
    _, tensors = parse_infer_request(body, len(head))
    assert tensors["DES"].shape == (1, 2)
    with pytest.raises(RequestError, match=rf"the first {len(head) + 3} bytes of the body "
                                           rf"\({HEADER}\) are not a JSON request header .*is "
                                           rf"{HEADER} the length of the JSON part"):
        parse_infer_request(body, len(head) + 3)


def test_a_dead_update_source_is_said_once_and_named_by_readiness(exports, tmp_path, caplog):
    """Serving with update_source at a dead broker printed ~40 raw client lines a second and
    reported ready (issue 35). The failure is said once, the client's repeats are dropped,
    the server stays unready (the updates waiting at start cannot be known applied) and the
    readiness body names the update source's state."""
    import logging
    import socket
    import time

    from jctr.config.hps import load_ps_config
    from jctr.serving.server import build_app
    from jctr.serving.updates import UpdateApplier

    pytest.importorskip("confluent_kafka")
    tmp, _, _ = exports
    _use(tmp, "first")
    path = _ps_file(tmp_path, tmp, {"type": "hash_map"})
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    doc = json.loads(path.read_text())
    doc["update_source"] = {"type": "kafka_message_queue", "brokers": f"127.0.0.1:{port}"}
    path.write_text(json.dumps(doc))
    ps = load_ps_config(path)
    dbs, models = _serve_open(path)
    caplog.set_level(logging.DEBUG)
    applier = UpdateApplier(ps.update_source, dbs, models)
    try:
        applier.start()
        time.sleep(5)
        assert applier.error is not None and "no broker answers" in applier.error
        assert not applier.caught_up
        said = [r for r in caplog.records if r.name == "jctr.serving"]
        assert len(said) == 1 and "retrying every" in said[0].getMessage()
        client = [r for r in caplog.records if r.name == "jctr.kafka.client"]
        assert len(client) <= 10, [r.getMessage() for r in client]
        app = build_app(models, applier)
        ready = next(r for r in app.routes if r.path == "/v2/health/ready").endpoint
        import asyncio

        response = asyncio.run(ready(None))
        body = json.loads(response.body)
        assert response.status_code == 503 and "no broker answers" in body["update_source"]
    finally:
        applier.close()
        _close(dbs, models)
