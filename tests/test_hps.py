"""The hierarchical parameter server without outside servers: parameters and the JSON file,
the CPU hash maps, RocksDB, the device cache, the lookup order, and predictions from the
hierarchy against the trainer's."""

import dataclasses
import json
import os
import time

import numpy as np
import pytest

from jctr.checkpoint.model_files import ModelFileError
from jctr.config import ConfigError, load_config
from jctr.config.hps import (
    InferenceParams,
    PersistentDatabaseParams,
    UpdateSourceParams,
    VolatileDatabaseParams,
    load_ps_config,
    parse_ps_config,
)
from jctr.serving.device_cache import WAYS, DeviceCache
from jctr.serving.hps import Databases
from jctr.serving.hps_model import HPSModel
from jctr.stores import HashMapStore, StoreError
from jctr.stores.rocksdb import RocksDBStore
from tests.conftest import ROOT, tiny_config

# -- parameters ------------------------------------------------------------------------------

SEED_MODEL = {  # the seed's "models" example, verbatim
    "model": "wdl",
    "sparse_files": ["/wdl_infer/model/wdl/1/wdl0_sparse_20000.model",
                     "/wdl_infer/model/wdl/1/wdl1_sparse_20000.model"],
    "dense_file": "/wdl_infer/model/wdl/1/wdl_dense_20000.model",
    "network_file": "/wdl_infer/model/wdl/1/wdl.json",
    "num_of_worker_buffer_in_pool": 4, "num_of_refresher_buffer_in_pool": 1,
    "deployed_device_list": [0], "max_batch_size": 64,
    "default_value_for_each_table": [0.0, 0.0], "maxnum_des_feature_per_sample": 26,
    "maxnum_catfeature_query_per_table_per_sample": [2, 26],
    "embedding_vecsize_per_table": [1, 15], "embedding_table_names": ["table1", "table2"],
    "refresh_delay": 0, "refresh_interval": 0, "hit_rate_threshold": 0.9, "gpucacheper": 0.1,
    "gpucache": True, "cache_refresh_percentage_per_iteration": 0.2, "label_dim": 1,
    "slot_num": 10,
}
SEED_VOLATILE = {
    "type": "redis_cluster", "address": "127.0.0.1:7003,127.0.0.1:7004,127.0.0.1:7005",
    "user_name": "default", "password": "", "num_partitions": 8, "allocation_rate": 268435456,
    "max_get_batch_size": 10000, "max_set_batch_size": 10000, "overflow_margin": 10000000,
    "overflow_policy": "evict_oldest", "overflow_resolution_target": 0.8,
    "initial_cache_rate": 1.0, "cache_missed_embeddings": False, "update_filters": [".+"],
}
SEED_PERSISTENT = {"type": "rocks_db", "path": "/tmp/rocksdb", "num_threads": 16,
                   "read_only": False, "max_get_batch_size": 10000,
                   "max_set_batch_size": 10000, "update_filters": [".+"]}
SEED_UPDATE = {"type": "kafka_message_queue", "brokers": "127.0.0.1:9092",
               "metadata_refresh_interval_ms": 30000, "poll_timeout_ms": 500,
               "receive_buffer_size": 262144, "max_batch_size": 8192, "failure_backoff_ms": 50,
               "max_commit_interval": 32}


def test_seed_parameter_server_file_parses():
    ps = parse_ps_config({"supportlonglong": True, "volatile_db": SEED_VOLATILE,
                          "persistent_db": SEED_PERSISTENT, "update_source": SEED_UPDATE,
                          "models": [SEED_MODEL]})
    m = ps.models[0]
    assert m.model_name == "wdl" and m.max_batchsize == 64 and m.cache_size_percentage == 0.1
    assert m.sparse_model_files[1].endswith("wdl1_sparse_20000.model")
    assert m.embedding_vecsize_per_table == (1, 15)
    assert m.number_of_worker_buffers_in_pool == 4 and m.deployed_devices == (0,)
    assert m.table_key(1) == "hps_et.wdl.table2" and m.i64_input_key
    assert m.volatile_db.nodes() == [("127.0.0.1", 7003), ("127.0.0.1", 7004),
                                     ("127.0.0.1", 7005)]
    assert ps.persistent_db.type == "rocks_db" and ps.update_source.max_commit_interval == 32


def test_defaults_are_hugectrs():
    v = VolatileDatabaseParams()
    assert (v.type, v.address, v.user_name, v.password, v.allocation_rate) == (
        "parallel_hash_map", "127.0.0.1:7000", "default", "", 268435456)
    assert v.overflow_margin == 2 ** 64 - 1 and v.overflow_policy == "evict_oldest"
    assert (v.overflow_resolution_target, v.initial_cache_rate) == (0.8, 1.0)
    assert not v.refresh_time_after_fetch and not v.cache_missed_embeddings
    assert v.partitions == min(os.cpu_count(), 16)
    assert VolatileDatabaseParams(type="redis_cluster").partitions == 8
    p = PersistentDatabaseParams()
    assert (p.type, p.path, p.num_threads, p.read_only) == ("disabled", "/tmp/rocksdb", 16, False)
    u = UpdateSourceParams()
    assert (u.type, u.brokers, u.poll_timeout_ms, u.max_batch_size) == (
        "null", "127.0.0.1:9092", 500, 8192)
    m = InferenceParams(model_name="m", max_batchsize=8, dense_model_file="d",
                        network_file="n", sparse_model_files=["a", "b"])
    assert (m.hit_rate_threshold, m.cache_size_percentage, m.use_gpu_embedding_cache) == (
        0.9, 0.2, True)
    assert (m.cache_refresh_percentage_per_iteration, m.maxnum_des_feature_per_sample,
            m.label_dim, m.slot_num, m.thread_pool_size) == (0.1, 26, 1, 10, 16)
    assert m.embedding_table_names == ("sparse_embedding1", "sparse_embedding2")
    assert m.default_value_for_each_table == (0.0, 0.0)


@pytest.mark.parametrize("change, message", [
    ({"gpucachepr": 0.1}, r"models\[0\].gpucachepr: unknown key"),
    ({"gpucacheper": 2}, r"models\[0\].gpucacheper: expected a number in \[0.0, 1.0\]"),
    ({"max_batch_size": "64"}, r"models\[0\].max_batch_size: expected an integer"),
    ({"embedding_vecsize_per_table": [1]},
     r"models\[0\].embedding_vecsize_per_table: expected one entry per sparse model file"),
    ({"dense_file": None}, r"models\[0\].dense_file: expected a non-empty string"),
    ({"embedding_table_names": ["a", "a"]}, r"embedding_table_names: expected distinct"),
    ({"deployed_device_list": [0, 1]}, r"models\[0\].deployed_device_list: \[0, 1\]: a jctr "
                                       r"server process runs a model on one device"),
    ({"hit_rate_threshold": -0.5}, r"models\[0\].hit_rate_threshold: expected a number >= 0"),
])
def test_model_errors_name_the_json_path(change, message):
    model = {**SEED_MODEL, **change}
    with pytest.raises(ConfigError, match=message):
        parse_ps_config({"models": [model]})


@pytest.mark.parametrize("change, message", [
    ({"overflow_policy": "lru"}, r"volatile_db.overflow_policy: expected one of"),
    ({"overflow_resolution_target": 1}, r"volatile_db.overflow_resolution_target: expected a "
                                        r"number in \(0, 1\)"),
    ({"type": "memcached"}, r"volatile_db.type: expected one of \"disabled\""),
    ({"address": "127.0.0.1:70000"}, r"volatile_db.address: expected \"host\[:port\]"),
    ({"num_partitions": 0}, r"volatile_db.num_partitions: expected a positive integer"),
    ({"update_filters": ["^hps_.+$", "(unclosed"]},
     r"volatile_db.update_filters\[1\]: '\(unclosed' is not a regular expression"),
    ({"update_filters": "^hps_.+$"}, r"volatile_db.update_filters: expected a list"),
])
def test_database_errors_name_the_json_path(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_ps_config({"volatile_db": {**SEED_VOLATILE, **change}, "models": [SEED_MODEL]})


def test_python_params_are_checked_and_file_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="overflow_policy: expected one of"):
        VolatileDatabaseParams(overflow_policy="oldest")
    with pytest.raises(ConfigError, match="cache_size_percentage"):
        InferenceParams(model_name="m", max_batchsize=8, dense_model_file="d",
                        network_file="n", sparse_model_files=["a"], cache_size_percentage=-1)
    with pytest.raises(ConfigError, match="ps.json: <file>: cannot read"):
        load_ps_config(tmp_path / "ps.json")
    (tmp_path / "ps.json").write_text('{"models": [}')
    with pytest.raises(ConfigError, match="ps.json: line 1 column 13: invalid JSON"):
        load_ps_config(tmp_path / "ps.json")
    with pytest.raises(ConfigError, match="models: expected at least one model"):
        parse_ps_config({"models": []})
    with pytest.raises(ConfigError, match="model name \"wdl\" appears twice"):
        parse_ps_config({"models": [SEED_MODEL, SEED_MODEL]})


# -- CPU hash maps ---------------------------------------------------------------------------

def _vectors(keys, dim=4):
    return (np.asarray(keys, np.float32)[:, None] * 0.001 + np.arange(dim, dtype=np.float32))


@pytest.mark.parametrize("kind", ["hash_map", "parallel_hash_map"])
def test_hash_map_insert_lookup_overwrite_erase(kind):
    store = HashMapStore(VolatileDatabaseParams(type=kind, num_partitions=4))
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(-2 ** 63, 2 ** 63 - 1, 200_000, dtype=np.int64))
    store.insert("t", keys, _vectors(keys))
    assert store.size("t") == keys.size
    probe = np.concatenate([keys[::3], keys[:10] + 1])  # +1: almost surely absent
    values, found = store.lookup("t", probe, 4)
    assert found[:keys[::3].size].all()
    np.testing.assert_array_equal(values[found], _vectors(probe[found]))
    assert (values[~found] == 0).all()
    # a key given twice keeps its last vector; overwrites keep the size
    store.insert("t", np.array([keys[0], keys[0]]), np.array([[1, 1, 1, 1], [2, 2, 2, 2]],
                                                              np.float32))
    assert store.size("t") == keys.size
    assert (store.lookup("t", keys[:1], 4)[0] == 2).all()
    store.erase("t", keys[:1000])
    assert store.size("t") == keys.size - 1000
    values, found = store.lookup("t", keys[:2000], 4)
    assert not found[:1000].any() and found[1000:].all()
    np.testing.assert_array_equal(values[1000:], _vectors(keys[1000:2000]))
    with pytest.raises(StoreError, match="holds vectors of size 4, asked for size 8"):
        store.lookup("t", keys[:3], 8)
    assert store.lookup("other", keys[:3], 8)[1].sum() == 0
    # the index holds int32 rows (half the bytes) until a table could pass 2**31 rows
    from jctr.stores.hash_map import _index_dtype

    assert store._tables["t"].index.dtype == np.int32
    assert _index_dtype(2**31) == np.int32 and _index_dtype(2**32) == np.int64


def test_a_hash_maps_erase_costs_its_keys_and_equals_a_dictionary():
    """Online updates erase a few keys of a large hash map at a time (the trainer's shrink and
    evictions): an erase compacted every column and rebuilt the whole index, time
    proportional to the table. Now each erased row takes the last row and its index slot is
    emptied by backward shift (``host_index.erase_rows``). Over random inserts, overwrites
    and erases (keys clustered in probe runs, keys given twice, absent keys) the table holds
    what a dictionary holds, its partition sizes too, and an erase reads no other row."""
    from jctr.ops import host_index
    from jctr.stores.base import partition_of

    rng = np.random.default_rng(4)
    store = HashMapStore(VolatileDatabaseParams(type="hash_map", num_partitions=3))
    model: dict[int, np.ndarray] = {}
    pool = rng.integers(-2 ** 63, 2 ** 63 - 1, 3_000, dtype=np.int64)
    for step in range(300):
        keys = rng.choice(pool, rng.integers(1, 60))
        if rng.random() < 0.55:
            values = rng.normal(size=(keys.size, 4)).astype(np.float32)
            store.insert("t", keys, values)
            for k, v in zip(keys.tolist(), values):
                model[k] = v
        else:
            store.erase("t", keys)
            for k in keys.tolist():
                model.pop(k, None)
        t = store._tables.get("t")
        if t is not None and (step % 25 == 0 or step == 299):
            assert store.size("t") == len(model) == t.size
            want = np.array(sorted(model), np.int64)
            values, found = store.lookup("t", pool, 4)
            assert found.sum() == len(model)
            np.testing.assert_array_equal(np.sort(pool[found]), np.unique(want))
            np.testing.assert_array_equal(values[found],
                                          np.stack([model[k] for k in pool[found].tolist()]))
            np.testing.assert_array_equal(
                t.partition_sizes(), np.bincount(partition_of(want, 3), minlength=3))
            assert host_index.rebuild(np.empty_like(t.index), t.keys, t.size) == -1
    # an erase of 10 keys of a 2M-row table: no compaction of the columns
    big = HashMapStore(VolatileDatabaseParams(type="hash_map"))
    keys = np.arange(2_000_000, dtype=np.int64)
    big.insert("b", keys, np.zeros((keys.size, 4), np.float32))
    t = big._tables["b"]
    values_before = t.values
    big.erase("b", keys[:10])
    assert t.values is values_before and big.size("b") == keys.size - 10


def test_overflow_keeps_partitions_under_the_margin_and_evicts_oldest():
    params = VolatileDatabaseParams(type="hash_map", num_partitions=2, overflow_margin=100,
                                    overflow_resolution_target=0.5)
    store = HashMapStore(params)
    for start in range(0, 1000, 25):
        keys = np.arange(start, start + 25)
        store.insert("t", keys, _vectors(keys))
        sizes = store.partition_sizes("t")
        assert (sizes <= 100).all(), sizes
    assert store.evicted > 0
    # the newest keys survive, the oldest went first
    assert store.lookup("t", np.arange(975, 1000), 4)[1].all()
    assert not store.lookup("t", np.arange(0, 100), 4)[1].any()
    # an overflow cuts a partition down to margin * target
    keys = np.arange(10_000, 10_400)
    store.insert("t", keys, _vectors(keys))
    assert (store.partition_sizes("t") <= 50).all()


def test_lru_keeps_what_was_read_with_refresh_time_after_fetch():
    params = VolatileDatabaseParams(type="hash_map", num_partitions=1, overflow_margin=10,
                                    overflow_resolution_target=0.5,
                                    refresh_time_after_fetch=True)
    store = HashMapStore(params)
    store.insert("t", np.arange(10), _vectors(np.arange(10)))
    store.lookup("t", np.array([0, 1]), 4)  # 0 and 1 become the most recently used
    store.insert("t", np.array([100]), _vectors([100]))  # 11 > 10: cut to 5
    _, found = store.lookup("t", np.array([0, 1, 100, *range(2, 10)]), 4)
    assert found[:3].all() and found[3:].sum() == 2  # 5 kept: 0, 1, 100 and two of 2..9
    # without the refresh, reads do not count: 0 and 1 are the oldest
    store = HashMapStore(VolatileDatabaseParams(type="hash_map", num_partitions=1,
                                                overflow_margin=10,
                                                overflow_resolution_target=0.5))
    store.insert("t", np.arange(10), _vectors(np.arange(10)))
    store.lookup("t", np.array([0, 1]), 4)
    store.insert("t", np.array([100]), _vectors([100]))
    assert not store.lookup("t", np.array([0, 1]), 4)[1].any()


def test_evict_random_shrinks_to_the_target():
    params = VolatileDatabaseParams(type="hash_map", num_partitions=1, overflow_margin=1000,
                                    overflow_policy="evict_random",
                                    overflow_resolution_target=0.8)
    store = HashMapStore(params)
    store.insert("t", np.arange(1000), _vectors(np.arange(1000)))
    assert store.size("t") == 1000
    store.insert("t", np.arange(1000, 1100), _vectors(np.arange(1000, 1100)))
    assert store.size("t") == 800
    _, found = store.lookup("t", np.arange(1100), 4)
    # random, not oldest-first: some of the first 300 survive, some of the last 100 go
    assert found[:300].any() and not found[1000:].all()
    kept = np.arange(1100)[found]
    np.testing.assert_array_equal(store.lookup("t", kept, 4)[0], _vectors(kept))


# -- RocksDB ---------------------------------------------------------------------------------

def test_rocksdb_persists_and_refuses_foreign_folders(tmp_path):
    path = str(tmp_path / "db")
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=path,
                                                  max_get_batch_size=7, max_set_batch_size=5))
    keys = np.array([5, -3, 2 ** 62, 17], np.int64)
    store.insert("hps_et.m.t", keys, _vectors(keys))
    store.close()
    ro = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=path, read_only=True))
    assert ro.tables() == ["hps_et.m.t"] and ro.size("hps_et.m.t") == 4
    values, found = ro.lookup("hps_et.m.t", np.array([17, 6, -3]), 4)
    assert found.tolist() == [True, False, True]
    np.testing.assert_array_equal(values[[0, 2]], _vectors([17, -3]))
    with pytest.raises(StoreError, match="read-only"):
        ro.insert("hps_et.m.u", keys, _vectors(keys))
    with pytest.raises(StoreError, match="holds vectors of size 4, asked for size 3"):
        ro.lookup("hps_et.m.t", keys, 3)
    ro.close()

    import rocksdict

    other = str(tmp_path / "other")
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    db = rocksdict.Rdict(other, opts)
    db.put(b"someone", b"else's data")
    db.close()
    before = _folder_bytes(other)
    with pytest.raises(StoreError, match="holds another RocksDB database"):
        RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=other))
    with pytest.raises(StoreError, match="holds another RocksDB database"):
        RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=other, read_only=True))
    assert _folder_bytes(other) == before  # every byte, rocksdict's config and LOG included
    files = tmp_path / "files"
    files.mkdir()
    (files / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="holds files that are not a RocksDB database"):
        RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(files)))
    assert os.listdir(files) == ["notes.txt"]
    with pytest.raises(StoreError, match="no database there to open read-only"):
        RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "none"),
                                              read_only=True))


def test_a_rocksdb_table_whose_width_was_never_written_reads_as_empty(tmp_path):
    """A server SIGKILLed as its first online update created a table's column family, before
    the table's row width was written (found by the SIGKILL test of
    tests/test_online_updates.py), left a table the next start could not read (KeyError in
    ``items``). The width now goes first; a table without one (an older database, or a
    machine's crash with RocksDB's log unsynced) holds no row: it reads as empty, and its
    first write records the width."""
    path = str(tmp_path / "db")
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=path))
    store.db.create_column_family("hps_et.m.t", store._options())  # killed right here
    store.close()
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=path))
    assert store.tables() == ["hps_et.m.t"] and store.size("hps_et.m.t") == 0
    assert list(store.items("hps_et.m.t")) == []
    keys = np.array([5, -3, 17], np.int64)
    assert not store.lookup("hps_et.m.t", keys, 4)[1].any()
    store.insert("hps_et.m.t", keys, _vectors(keys))
    store.close()
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=path))
    assert store.dim("hps_et.m.t") == 4 and store.size("hps_et.m.t") == 3
    np.testing.assert_array_equal(store.lookup("hps_et.m.t", keys, 4)[0], _vectors(keys))
    store.close()


def test_a_closed_rocksdb_opens_again_whatever_still_refers_to_it(tmp_path, monkeypatch):
    """rocksdict keeps a database open (its ``LOCK`` held: "lock hold by current process"
    on the next open) while any column family, handle or iterator of it lives, whatever
    ``close()`` said. A streaming run stopped by Ctrl-C and started again in the same process
    met that (tests/test_online.py's sparse_store test, now and then): a pass over a table
    left half done, or a traceback keeping a write's frame, kept the old one open. Now the
    database opens again at once after each; the half-done pass raises ``StoreError`` if
    resumed; ``close`` waits for a call in flight on another thread."""
    import threading

    import jctr.stores.rocksdb as rocksdb_module

    params = PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db"))
    keys = np.arange(200_000, dtype=np.int64)

    def reopen():
        store = RocksDBStore(params, bulk=True)
        assert store.size("t") == keys.size
        return store

    store = RocksDBStore(params, bulk=True)
    store.insert("t", keys, np.zeros((keys.size, 2), np.float32))
    for keyed in (False, True):
        half_done = store.items("t", chunk=65536, keyed=keyed)
        next(half_done)
        store.close()
        store = reopen()
        with pytest.raises(StoreError, match="database is closed"):
            next(half_done)
    # a write batch and a bulk load that failed, their tracebacks (and frames) kept
    kept = []
    with pytest.raises(ValueError, match="bytes") as batch:
        store._write_batch("t", "put", [b"12345678"], [12345])
    kept.append(batch.value)

    def failing_file(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(rocksdb_module, "write_table_file", failing_file)
    with pytest.raises(OSError) as load:
        store.ingest_columns("t", keys[:10], [np.zeros((10, 2), np.float32)])
    kept.append(load.value)
    store.close()
    store = reopen()
    monkeypatch.undo()
    # a call in flight on another thread: close waits for it, then nothing starts
    entered, release, closed_at = threading.Event(), threading.Event(), []

    def in_flight():
        with store._use():
            entered.set()
            release.wait(10)
            assert not closed_at
    worker = threading.Thread(target=in_flight)
    worker.start()
    entered.wait(10)
    closer = threading.Thread(target=lambda: (store.close(), closed_at.append(1)))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # waiting for the call in flight
    release.set()
    worker.join(10)
    closer.join(10)
    assert closed_at == [1]
    with pytest.raises(StoreError, match="the database is closed"):
        store.lookup("t", keys[:3], 2)
    reopen().close()
    del kept


def test_a_rocksdb_insert_pauses_between_its_write_batches_and_writes_every_row(tmp_path):
    """``pause`` (the online updates' persistent side yields to the serving side there) is
    called between the write batches of ``max_set_batch_size`` rows, never before the first
    or after the last, outside the store's lock (a pause may read the store); every row is
    written, a repeated key with its last row. ``Databases.write_rows`` hands it to the
    persistent database only."""
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db"),
                                                  max_set_batch_size=100))
    keys = np.concatenate([np.arange(1, 351), [7]]).astype(np.int64)
    values = _vectors(keys)
    values[-1] = 9.0
    seen = []

    def pause():
        assert not store._lock.locked()
        seen.append(store.size("t"))
    store.insert("t", keys, values, pause=pause)
    assert seen == [100, 200, 300]
    got, found = store.lookup("t", np.arange(1, 351), 4)
    want = _vectors(np.arange(1, 351))
    want[6] = 9.0
    assert found.all() and np.array_equal(got, want)
    store.close()
    dbs = Databases(VolatileDatabaseParams(type="hash_map"),
                    PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db2"),
                                             max_set_batch_size=100))
    seen.clear()
    dbs.write_rows("volatile_db", "t", keys, values, pause=lambda: seen.append("v"))
    dbs.write_rows("persistent_db", "t", keys, values, pause=lambda: seen.append("p"))
    assert seen == ["p"] * 3
    dbs.close()


def test_rocksdb_compactions_run_at_the_lowest_cpu_priority(tmp_path):
    """A compaction runs on a thread of RocksDB's LOW pool at nice 19 (RocksDB's
    ``Env::LowerThreadPoolCPUPriority``: each thread lowers itself as it takes a job), while
    the threads that apply updates and train keep theirs: on two cores compactions took ~20%
    of the machine during a burst of online updates (docs/performance.md)."""
    def niceness(name):
        out = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == name:
                        out.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
            except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
                pass
        return out
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")))
    keys = np.arange(1, 2001, dtype=np.int64)
    family = store._families
    for r in range(3):  # three files of the same keys: the compaction merges them
        store.insert("t", keys, _vectors(keys) + r)
        family["t"].flush()
    family["t"].compact_range(None, None)
    assert 19 in niceness("rocksdb:low")
    assert os.getpriority(os.PRIO_PROCESS, 0) == ours
    got, found = store.lookup("t", keys, 4)
    assert found.all() and np.array_equal(got, _vectors(keys) + 2)
    store.close()


def _folder_bytes(path):
    return {name: (open(os.path.join(path, name), "rb").read(),
                   os.stat(os.path.join(path, name)).st_mtime_ns)
            for name in sorted(os.listdir(path))}


def test_rocksdb_read_only_opens_on_read_only_storage(tmp_path):
    """``read_only: true`` on a read-only mount (a user+mount namespace makes one without
    privileges): the lookup works and nothing is written. Where user namespaces are not
    allowed the same open runs on ordinary storage, still checking that nothing is written."""
    import shutil
    import subprocess
    import sys

    namespaces = bool(shutil.which("unshare")) and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0
    path = str(tmp_path / "db")
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=path))
    keys = np.array([4, 9], np.int64)
    store.insert("hps_et.m.t", keys, _vectors(keys))
    store.close()
    before = _folder_bytes(path)
    code = ("import numpy as np\n"
            "from jctr.config.hps import PersistentDatabaseParams as P\n"
            "from jctr.stores.rocksdb import RocksDBStore\n"
            f"s = RocksDBStore(P(type='rocks_db', path={path!r}, read_only=True))\n"
            "v, f = s.lookup('hps_et.m.t', np.array([9, 5]), 4)\n"
            "s.close()\n"
            "print(f.tolist(), v[0].tolist())\n")
    script = (f"mount --bind {tmp_path} {tmp_path} && "
              f"mount -o remount,bind,ro {tmp_path} && "
              f"(touch {tmp_path}/probe 2>/dev/null && echo WRITABLE; true) && "
              f"{sys.executable} -c \"$CODE\"")
    argv = ["unshare", "-rm", "sh", "-c", script] if namespaces else [sys.executable, "-c",
                                                                     code]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CODE": code}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "WRITABLE" not in out.stdout
    assert out.stdout.strip().splitlines()[-1] == f"[True, False] {_vectors([9])[0].tolist()}"
    assert _folder_bytes(path) == before


def _rows_of(store, table):
    """(keys, rows) a whole-table pass gives, in key order."""
    parts = list(store.items(table))
    if not parts:
        return np.zeros(0, np.int64), None
    keys = np.concatenate([k for k, _ in parts])
    rows = np.concatenate([v for _, v in parts])
    order = np.argsort(keys)
    return keys[order], rows[order]


@pytest.mark.parametrize("kind", ["rocks_db", "hash_map"])
def test_tables_swap_their_rows_widths_and_manifests_at_once(tmp_path, kind):
    """``swap_tables`` (a server's next base is written into a table of its own, then swapped
    in): each table then holds the other's rows, width and manifest, to lookups and
    whole-table passes alike (RocksDB's: its table files, whose column family is now another
    name than the table's); RocksDB keeps the swap across a restart, over several days' swaps
    (each day's table written under the same name, its column family named anew) and a name
    left by a process killed before it made its family; a missing table is refused."""
    def store_():
        if kind == "hash_map":
            return HashMapStore(VolatileDatabaseParams(type="hash_map"))
        return RocksDBStore(PersistentDatabaseParams(type="rocks_db",
                                                     path=str(tmp_path / "db")))

    store = store_()
    live, staged = "hps_et.m.t", "hps_et.m.t~next"
    old_keys = np.arange(0, 40_000, dtype=np.int64)  # a bulk load (a table file) and not
    store.insert(live, old_keys, np.ones((old_keys.size, 4), np.float32))
    store.insert(live, np.array([-7], np.int64), np.full((1, 4), 3, np.float32))
    store.set_meta(live, {"day": 1})
    for day in range(2, 6):
        new_keys = np.arange(day * 100, day * 100 + 50_000, dtype=np.int64)
        store.insert(staged, new_keys, np.full((new_keys.size, 2 + day), day, np.float32))
        store.set_meta(staged, {"day": day})
        store.swap_tables(live, staged)
        for t, keys, width, value in ((live, new_keys, 2 + day, day), (staged, None, None, None)):
            if keys is None:  # the old day's
                assert store.get_meta(staged)["day"] == day - 1
                continue
            got_keys, rows = _rows_of(store, t)
            np.testing.assert_array_equal(got_keys, keys)
            assert rows.shape == (keys.size, width) and (rows == value).all()
            values, found = store.lookup(t, keys[[0, -1]], width)
            assert found.all() and (values == value).all()
            assert store.get_meta(t) == {"day": day}
        store.drop_table(staged)
        assert store.tables() == [live]
        if kind == "rocks_db":  # a restart finds the swapped table under its name
            store.close()
            store = store_()
            assert store.tables() == [live] and store.get_meta(live) == {"day": day}
            got_keys, rows = _rows_of(store, live)
            np.testing.assert_array_equal(got_keys, new_keys)
            assert (rows == day).all() and store.dim(live) == 2 + day
    with pytest.raises(StoreError, match="no table"):
        store.swap_tables(live, staged)
    if kind == "rocks_db":  # a table's name written, then killed before its family was made
        from jctr.stores.rocksdb import _family_key

        store.db.put(_family_key("hps_et.m.u"), b"hps_et.m.u#3")
        store.close()
        store = store_()
        assert store.tables() == [live]
        store.insert("hps_et.m.u", np.array([1], np.int64), np.ones((1, 2), np.float32))
        store.close()
        store = store_()
        assert store.tables() == [live, "hps_et.m.u"]
        assert _rows_of(store, "hps_et.m.u")[0].tolist() == [1]
    store.close()


@pytest.mark.parametrize("kind", ["rocks_db", "hash_map"])
def test_lookups_during_swaps_see_one_table_whole(tmp_path, kind):
    """Two threads look keys up while the next day's table is written, swapped in and the
    old one dropped, 12 times: no lookup fails (RocksDB closed the dropped table's family
    while a lookup that began before the swap still read through it: "Already borrowed"),
    none misses a key, each answers one day's rows whole, and the days never go back; the
    dropped tables' files are gone from the disk (the family is dropped once the lookups
    that began before have ended)."""
    import threading

    if kind == "hash_map":
        store = HashMapStore(VolatileDatabaseParams(type="hash_map"))
    else:
        store = RocksDBStore(PersistentDatabaseParams(type="rocks_db",
                                                      path=str(tmp_path / "db")))
    keys = np.arange(50_000, dtype=np.int64)
    store.insert("t", keys, np.zeros((keys.size, 8), np.float32))
    stop, errors, days = threading.Event(), [], [[], []]

    def table_files_bytes():
        folder = tmp_path / "db"
        return sum(f.stat().st_size for f in folder.glob("*.sst")) if kind == "rocks_db" else 0
    one_day = table_files_bytes()

    def reader(seen):
        rng = np.random.default_rng(len(seen))
        while not stop.is_set():
            try:
                values, found = store.lookup("t", rng.choice(keys, 2048), 8)
            except Exception as e:  # noqa: BLE001 - any failure is the finding
                errors.append(repr(e))
                continue
            if not found.all() or np.unique(values).size != 1:
                errors.append("a key missed, or rows of two days in one answer")
            seen.append(float(values[0, 0]))

    threads = [threading.Thread(target=reader, args=(seen,)) for seen in days]
    for t in threads:
        t.start()
    try:
        for day in range(1, 13):
            store.insert("t~next", keys, np.full((keys.size, 8), day, np.float32))
            store.swap_tables("t", "t~next")
            store.drop_table("t~next")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    for seen in days:
        assert seen and seen == sorted(seen)
    assert store.lookup("t", keys[:3], 8)[0].min() == 12
    # the dropped days' files are gone (a family kept open would keep them on disk)
    assert table_files_bytes() < 1.5 * one_day + 100_000
    store.close()


def test_a_new_base_is_written_apart_and_swapped_in_at_once(tmp_path, monkeypatch):
    """``Databases.switch_links`` into RocksDB and a hash map: until the new chain's table is
    swapped in, the served table holds the old chain whole (no request reads rows of two
    days); after it, the new chain whole (the keys it lacks gone), its manifest, and the hash
    map's share only the keys it held. A staged table a switch killed midway left behind
    is dropped first. The keys of the chain are never gathered (only a database without
    swaps, Redis, erases what the chain lacks)."""
    from jctr.serving.hps import STAGED_SUFFIX

    dbs = Databases(VolatileDatabaseParams(type="hash_map"),
                    PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")))
    table = "hps_et.m.t"
    old_keys = np.arange(100, dtype=np.int64)
    new_keys = np.arange(50, 180, dtype=np.int64)
    dbs.persistent.insert(table, old_keys, np.ones((100, 4), np.float32))
    dbs.volatile.insert(table, old_keys[::2], np.ones((50, 4), np.float32))
    dbs.persistent.insert(table + STAGED_SUFFIX, np.array([999]), np.ones((1, 4), np.float32))
    seen = []
    for store in (dbs.persistent, dbs.volatile):
        real = store.swap_tables

        def swap(a, b, real=real, store=store):
            keys, rows = _rows_of(store, a)
            seen.append((keys, rows))
            real(a, b)
        monkeypatch.setattr(store, "swap_tables", swap)

    def chain():
        return (new_keys, np.full((new_keys.size, 4), 2, np.float32)),

    def no_keys():
        raise AssertionError("the chain's keys gathered")

    for layer, share in (("persistent_db", False), ("volatile_db", True)):
        written = dbs.switch_links(layer, table, [chain], {"dim": 4, "day": 2}, no_keys,
                                   held_only=share)
        assert written == (25 if share else new_keys.size)  # held: 50, 52, ..., 98
    for (keys, rows), want in zip(seen, (old_keys, old_keys[::2])):
        np.testing.assert_array_equal(keys, want)
        assert (rows == 1).all()  # the old chain whole until the swap
    keys, rows = _rows_of(dbs.persistent, table)
    np.testing.assert_array_equal(keys, new_keys)
    assert (rows == 2).all()
    keys, rows = _rows_of(dbs.volatile, table)
    np.testing.assert_array_equal(keys, old_keys[::2][old_keys[::2] >= 50])
    assert (rows == 2).all()
    for store in (dbs.persistent, dbs.volatile):
        assert store.tables() == [table] and store.get_meta(table) == {"dim": 4, "day": 2}
    # a switch killed while it wrote: its staged tables are dropped (a server's start does
    # this: HPSModel.load_databases), the served ones kept
    for store in (dbs.persistent, dbs.volatile):
        store.insert(table + STAGED_SUFFIX, np.array([5]), np.ones((1, 4), np.float32))
    assert dbs.drop_staged(table) == ["persistent_db", "volatile_db"]
    for store in (dbs.persistent, dbs.volatile):
        assert store.tables() == [table]
    assert dbs.drop_staged(table) == []
    dbs.close()


# -- device cache ----------------------------------------------------------------------------

def test_device_cache_hits_lru_within_a_set_and_refresh():
    cache = DeviceCache(capacity=WAYS, dim=2)  # one set: every key competes
    keys = np.arange(1, WAYS + 1, dtype=np.int64)
    cache.insert(keys, _vectors(keys, 2))
    hit, values = cache.query(np.array([3, 99], np.int64))
    assert hit.tolist() == [True, False]
    np.testing.assert_array_equal(np.asarray(values)[0], _vectors([3], 2)[0])
    assert (np.asarray(values)[1] == 0).all()
    cache.query(keys[keys != 1])  # every key but 1 is used again: 1 is the oldest
    cache.insert(np.array([50], np.int64), _vectors([50], 2))
    hit, _ = cache.query(np.concatenate([keys, [50]]))
    assert hit.tolist() == [False] + [True] * (WAYS - 1) + [True]
    cache.refresh(np.array([50, 1234], np.int64), np.full((2, 2), 7.0, np.float32))
    np.testing.assert_array_equal(np.asarray(cache.query(np.array([50]))[1])[0], [7.0, 7.0])
    assert cache.size() == WAYS and sorted(cache.cached_keys(0, 1).tolist()) == \
        sorted(list(range(2, WAYS + 1)) + [50])
    # keys erased from the model: no longer cached; their ways are the next inserts'
    cache.forget_rows(np.array([50, 3, 777], np.int64))
    assert cache.query(np.array([50, 3, 2], np.int64))[0].tolist() == [False, False, True]
    assert cache.size() == WAYS - 2
    cache.insert(np.array([60, 61], np.int64), _vectors([60, 61], 2))
    assert cache.size() == WAYS and cache.query(np.arange(2, WAYS + 1))[0].sum() == WAYS - 2
    # more keys than ways in one insert: the set keeps WAYS of them, nothing breaks
    big = DeviceCache(capacity=64, dim=2)
    many = np.arange(1000, 1500, dtype=np.int64)
    big.insert(many, _vectors(many, 2))
    hit, values = big.query(many)
    assert hit.sum() == big.capacity
    np.testing.assert_array_equal(np.asarray(values)[:many.size][hit], _vectors(many[hit], 2))


@pytest.mark.parametrize("near", [0, 1 << 30, (1 << 31) - 1])
def test_device_cache_keeps_its_lru_order_as_its_clock_turns_back(near):
    """A busy server calls a table's cache thousands of times a second: its 32-bit clock
    passed 2**31 within days, and from then on every stamp read as empty (no hits). The
    clock turns back by ``CLOCK_SHIFT`` at ``CLOCK_LIMIT``, its stamps with it: a cache
    moved on to just below the limit, or to 2**31, hits and evicts as a fresh one
    (``device_cache._turned_back``)."""
    import jax.numpy as jnp

    from jctr.ops.clocks import CLOCK_LIMIT

    cache = DeviceCache(capacity=WAYS, dim=2)  # one set: every key competes
    keys = np.arange(1, WAYS + 1, dtype=np.int64)
    cache.insert(keys, _vectors(keys, 2))
    cache.query(keys[keys != 1])  # 1 is the oldest
    if near:
        st = cache.state
        offset = near - int(st.clock) - 2
        stamps = np.asarray(st.stamps)
        cache.state = st._replace(
            stamps=jnp.asarray(np.where(stamps >= 0, stamps + offset, -1), jnp.int32),
            clock=jnp.asarray(int(st.clock) + offset, jnp.int32))
    for _ in range(4):  # across the limit (or 2**31)
        hit, _ = cache.query(keys[keys != 1])
        assert hit.all()
    cache.insert(np.array([50], np.int64), _vectors([50], 2))
    hit, _ = cache.query(np.concatenate([keys, [50]]))
    assert hit.tolist() == [False] + [True] * (WAYS - 1) + [True]
    assert cache.size() == WAYS and 0 < int(cache.state.clock) < CLOCK_LIMIT


def test_update_refreshes_of_any_size_compile_once_and_ahead():
    """Online updates come in any number of rows; each refresh shape first met compiled for
    ~0.2 s while holding the cache's lock, which requests wait on. ``refresh_rows`` refreshes
    in calls of one shape, and ``compile_refresh`` (the update thread calls it before its first
    update) compiles that shape without changing the cache: no update compiles afterwards,
    whatever its size, and every cached key of it gets its new row."""
    import jax

    compiles = []

    def listen(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        _refresh_without_compiles(compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _refresh_without_compiles(compiles: list) -> None:
    import jax

    from jctr.serving.device_cache import REFRESH_ROWS

    cache = DeviceCache(capacity=1 << 14, dim=2)
    cached = np.arange(1, 3001, dtype=np.int64)
    cache.insert(cached, _vectors(cached, 2), 4096)
    held = cached[cache.query(cached, 4096)[0]]
    before = jax.tree.map(np.asarray, cache.state)
    cache.compile_refresh()
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, cache.state))
    for n in (1, 700, REFRESH_ROWS + 1, 3 * REFRESH_ROWS):  # uncached keys beyond 3,000
        keys = np.arange(1, n + 1, dtype=np.int64)
        compiles.clear()
        cache.refresh_rows(keys, np.full((n, 2), float(n), np.float32))
        assert not compiles, n
        hit, values = cache.query(keys[np.isin(keys, held)], 4096)
        assert hit.all()
        assert (np.asarray(values)[:hit.size] == float(n)).all()
        if n == 700:  # the cached keys this update did not name kept their rows
            rest = held[held > n]
            np.testing.assert_array_equal(np.asarray(cache.query(rest, 4096)[1])[:rest.size],
                                          _vectors(rest, 2))


# -- the lookup order ------------------------------------------------------------------------

def test_a_failed_write_back_leaves_the_volatile_layer_up(tmp_path, monkeypatch):
    """cache_missed_embeddings: when caching rows the persistent database found fails (a Redis
    master of the cluster is down, say), the failure is counted and the volatile layer stays
    up: the next lookups are still answered by it (before, every such failure marked the whole
    layer down for the backoff, and nearly every lookup went to the persistent database)."""
    from jctr.stores import StoreUnavailable

    dbs = Databases(VolatileDatabaseParams(type="hash_map", cache_missed_embeddings=True),
                    PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")),
                    backoff_s=60.0)
    dbs.volatile.insert("t", np.array([1, 2]), _vectors([1, 2]))
    dbs.persistent.insert("t", np.arange(1, 10), _vectors(list(range(1, 10))) + 100)

    def dead_master(table, keys, values):
        raise StoreUnavailable("redis_cluster: master 127.0.0.1:7001 does not answer")

    monkeypatch.setattr(dbs.volatile, "insert", dead_master)
    for _ in range(3):
        _, found, counts = dbs.lookup("t", np.array([1, 2, 5]), 4, default=0.0)
        assert found.all() and counts == {"volatile_db": 2, "persistent_db": 1}
    assert dbs.write_back_failures == 3 and dbs.volatile_failures == 0
    assert dbs.health() == {"volatile_db": "up", "persistent_db": "up"}
    dbs.close()


def test_lookup_order_fallbacks_and_defaults(tmp_path):
    dbs = Databases(VolatileDatabaseParams(type="hash_map", cache_missed_embeddings=True),
                    PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")))
    dbs.volatile.insert("t", np.array([1, 2]), _vectors([1, 2]))
    dbs.persistent.insert("t", np.array([2, 3]), _vectors([2, 3]) + 100)
    values, found, counts = dbs.lookup("t", np.array([1, 2, 3, 4]), 4, default=-1.0)
    assert found.tolist() == [True, True, True, False]
    np.testing.assert_array_equal(values[0:2], _vectors([1, 2]))  # volatile wins
    np.testing.assert_array_equal(values[2], _vectors([3])[0] + 100)  # then persistent
    assert (values[3] == -1).all()  # then the default
    assert counts == {"volatile_db": 2, "persistent_db": 1}
    # cache_missed_embeddings: what the persistent db found is now in the volatile one
    assert dbs.volatile.lookup("t", np.array([3]), 4)[1].all()
    _, _, counts = dbs.lookup("t", np.array([3]), 4, default=0.0)
    assert counts == {"volatile_db": 1, "persistent_db": 0}
    with pytest.raises(ConfigError, match="both \"disabled\": the embeddings would have "
                                          "nowhere to live"):
        Databases(VolatileDatabaseParams(type="disabled"), PersistentDatabaseParams())
    # load: all rows persistent, initial_cache_rate of them volatile
    dbs.close()
    dbs = Databases(VolatileDatabaseParams(type="hash_map", initial_cache_rate=0.25),
                    PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db2")))
    # a base read in parts, then a delta whose rows win (the volatile layer takes the base's
    # first rows and every delta row: none of its rows is older than the persistent one's)
    keys = np.arange(100)
    manifest = {"identity": "x", "dim": 4, "rows": 100}
    base = lambda: ((keys[s:s + 30], _vectors(keys[s:s + 30])) for s in range(0, 100, 30))
    delta_keys = np.array([5, 60, 200])
    delta = lambda: ((delta_keys, _vectors(delta_keys) + 1000),)
    assert dbs.load("u", [base, delta], manifest, rows=103) == {"volatile_db": 28,
                                                                 "persistent_db": 103}
    assert dbs.volatile._tables["u"].keys.size == 28  # its share's room made once, not grown
    assert dbs.persistent.get_meta("u") == manifest == dbs.volatile.get_meta("u")
    assert dbs.volatile.size("u") == 27 and dbs.persistent.size("u") == 101
    for store in (dbs.volatile, dbs.persistent):
        values, found = store.lookup("u", np.array([5, 60, 200, 7]), 4)
        assert found.all()
        np.testing.assert_array_equal(values[:3], _vectors(delta_keys) + 1000)
    assert not dbs.volatile.lookup("u", np.array([30]), 4)[1].any()
    more = np.arange(500, 540)  # past the room made: grown as before
    dbs.volatile.insert("u", more, _vectors(more))
    assert dbs.volatile.lookup("u", np.concatenate([more, [0, 200]]), 4)[1].all()
    dbs.close()


# -- predictions through the hierarchy -------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from jctr.serving.bundle import export_bundle
    from jctr.train.trainer import Trainer

    runs = {}

    def get(model):
        if model not in runs:
            tmp = tmp_path_factory.mktemp(f"hps_{model}")
            cfg = tiny_config(tmp, model, max_iter=12, display=100, eval_interval=10_000,
                              eval_batches=1)
            t = Trainer(load_config(cfg), log=lambda s: None)
            t.fit()
            export_bundle(t.cfg, t.state, str(tmp / "bundle"), t.placements)
            batches = list(t.data.eval.batches(512, epochs=1))[:2]
            runs[model] = (tmp, [(b, t.predict(b)) for b in batches])
        return runs[model]

    return get


def _ps(tmp, name, volatile=None, persistent=True, **model):
    doc = {"models": [{"model": name, "bundle": "bundle", "max_batch_size": 256, **model}]}
    if volatile is not None:
        doc["volatile_db"] = volatile
    if persistent:
        doc["persistent_db"] = {"type": "rocks_db", "path": str(tmp / f"rocks_{name}")}
    path = tmp / f"ps_{name}.json"
    path.write_text(json.dumps(doc))
    return load_ps_config(path)


# the same rows are summed in the same order; XLA fuses the bag into a different graph than the
# trainer's eval step, which moves float32 rounding (DeepFM: 2e-6 at most)
TOL = {"rtol": 3e-5, "atol": 3e-6}


@pytest.mark.parametrize("model, cache, volatile", [
    ("dlrm", {"gpucacheper": 0.05, "hit_rate_threshold": 1.0},
     {"type": "parallel_hash_map", "overflow_margin": 300, "num_partitions": 4}),
    ("wdl", {"gpucacheper": 1.0, "hit_rate_threshold": 0.0}, {"type": "disabled"}),
    ("deepfm", {"gpucacheper": 0.2}, {"type": "hash_map", "initial_cache_rate": 0.3}),
])
def test_predictions_equal_the_trainers(trained, model, cache, volatile):
    tmp, reference = trained(model)
    ps = _ps(tmp, f"{model}_{len(os.listdir(tmp))}", volatile, **cache)
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    m = HPSModel(ps.models[0], dbs, where="models[0]", source=ps.source)
    try:
        m.load_databases()
        for _ in range(2):  # the second pass reads what the cache took in
            for batch, expected in reference:  # 512 samples: two batches of 256
                np.testing.assert_allclose(m.predict(batch), expected, **TOL)
            m.wait_inserts()
        stats = m.stats()
        total = {k: sum(s[k] for s in stats.values()) for k in
                 ("queries", "device_cache", "volatile_db", "persistent_db", "default")}
        assert total["queries"] == sum(total[k] for k in ("device_cache", "volatile_db",
                                                          "persistent_db", "default"))
        if cache.get("gpucache", True):
            assert total["device_cache"] > 0
        else:
            assert total["device_cache"] == 0
        if volatile["type"] == "disabled" or volatile.get("initial_cache_rate", 1) < 1 or \
                volatile.get("overflow_margin"):
            assert total["persistent_db"] > 0
        # raw features give the same as the batch
        batch, expected = reference[0]
        sp = m.cfg.data.sparse
        b = batch.batch_size
        sparse = []
        for i, s in enumerate(sp):
            width = s.slot_num if s.one_hot else s.max_feature_num_per_sample
            seg, keys = batch.segments[i], batch.keys[i]
            keep = seg < b * s.slot_num
            order = np.argsort(seg[keep], kind="stable")
            offsets = np.searchsorted(seg[keep][order], np.arange(b * s.slot_num + 1))
            sparse.append((keys[keep][order], offsets))
            assert width
        np.testing.assert_allclose(m.predict_features(batch.dense, sparse), expected,
                                   **TOL)
    finally:
        m.close()
        dbs.close()


def test_refresh_rereads_cached_rows(trained, tmp_path):
    tmp, reference = trained("dlrm")
    ps = _ps(tmp, "dlrm_refresh", {"type": "hash_map"}, persistent=False, gpucacheper=1.0,
             hit_rate_threshold=1.0, cache_refresh_percentage_per_iteration=0.3)
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    m = HPSModel(ps.models[0], dbs)
    try:
        m.load_databases()
        batch, expected = reference[0]
        np.testing.assert_allclose(m.predict(batch), expected, **TOL)
        table = m.tables[0]
        # the database changes (an online update): the cache still serves the old rows
        for keys, values in list(dbs.volatile.items(table.key)):
            dbs.volatile.insert(table.key, keys, values * 0.0)
        np.testing.assert_allclose(m.predict(batch), expected, **TOL)
        assert m.refresh_cache() > 0
        fresh = m.predict(batch)
        assert np.abs(fresh - expected).max() > 1e-3
        # what a model without a cache reads from the changed database
        direct = HPSModel(dataclasses.replace(ps.models[0], use_gpu_embedding_cache=False), dbs)
        np.testing.assert_allclose(fresh, direct.predict(batch), **TOL)
        direct.close()
        # the periodic refresher does the same on its own (refresh_delay, refresh_interval)
        timed = HPSModel(dataclasses.replace(ps.models[0], refresh_interval=0.1), dbs)
        for keys, values in list(dbs.volatile.items(table.key)):
            dbs.volatile.insert(table.key, keys, values + 1.0)
        np.testing.assert_allclose(timed.predict(batch), direct.predict(batch), **TOL)
        for keys, values in list(dbs.volatile.items(table.key)):
            dbs.volatile.insert(table.key, keys, values * 0.0)
        stale = timed.predict(batch)
        assert np.abs(stale - fresh).max() > 1e-3  # cached rows: the +1 vectors
        timed.start_refresh()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and np.abs(timed.predict(batch) - fresh).max() > 1e-5:
            time.sleep(0.05)
        np.testing.assert_allclose(timed.predict(batch), fresh, **TOL)
        timed.close()
    finally:
        m.close()
        dbs.close()


def test_models_share_the_databases_under_their_own_names(trained, tmp_path):
    from jctr.serving.cli import open_models

    (tmp_dlrm, ref_dlrm), (tmp_wdl, ref_wdl) = trained("dlrm"), trained("wdl")
    doc = {"volatile_db": {"type": "hash_map"},
           "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
           "models": [{"model": "a", "bundle": str(tmp_dlrm / "bundle"), "max_batch_size": 128},
                      {"model": "b", "bundle": str(tmp_wdl / "bundle"), "max_batch_size": 128,
                       "embedding_table_names": ["wide", "deep"]}]}
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    dbs, models = open_models(load_ps_config(tmp_path / "ps.json"), log=lambda s: None)
    try:
        assert dbs.volatile.tables() == dbs.persistent.tables() == [
            "hps_et.a.sparse_embedding1", "hps_et.b.deep", "hps_et.b.wide"]
        np.testing.assert_allclose(models["a"].predict(ref_dlrm[0][0]), ref_dlrm[0][1], **TOL)
        np.testing.assert_allclose(models["b"].predict(ref_wdl[0][0]), ref_wdl[0][1], **TOL)
    finally:
        for m in models.values():
            m.close()
        dbs.close()


def test_bad_model_files_and_sizes_are_clear_errors(trained, tmp_path):
    tmp, _ = trained("wdl")
    bundle = tmp / "bundle"
    base = {"model": "w", "bundle": str(bundle), "max_batch_size": 64}
    dbs = Databases(VolatileDatabaseParams(type="hash_map"), PersistentDatabaseParams())
    try:
        for change, error, message in [
            ({"dense_file": str(tmp_path / "missing.model")}, (ModelFileError, OSError),
             "missing.model"),
            ({"embedding_vecsize_per_table": [1, 4]}, ConfigError,
             r"models\[0\].embedding_vecsize_per_table\[1\]: 4, but embedding "
             r"\"sparse_embedding1\" has embedding_vec_size 8"),
            ({"maxnum_catfeature_query_per_table_per_sample": [1, 8]}, ConfigError,
             r"maxnum_catfeature_query_per_table_per_sample\[0\]: 1, but input \"wide_data\""),
            ({"sparse_files": [str(bundle / "sparse" / "sparse_embedding2.model")]},
             ConfigError, r"models\[0\].sparse_files: 1 file\(s\) for the network's 2"),
            ({"network_file": str(tmp_path / "nope.json")}, ConfigError,
             r"models\[0\].network_file: .*nope.json: no such file"),
            ({"label_dim": 2}, ConfigError, r"models\[0\].label_dim: 2, but"),
        ]:
            ps = parse_ps_config({"models": [{**base, **change}]}, str(tmp_path / "ps.json"))
            with pytest.raises(error, match=message):
                HPSModel(ps.models[0], dbs, where="models[0]")
    finally:
        dbs.close()


def _rocks_model(tmp_path, name):
    """(parameter-server config, databases, model) of ``tmp_path/bundle``: a hash map
    holding half the rows over RocksDB in ``tmp_path/rocks``, no device cache."""
    doc = {"volatile_db": {"type": "hash_map", "initial_cache_rate": 0.5},
           "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
           "models": [{"model": name, "bundle": "bundle", "max_batch_size": 256,
                       "gpucache": False}]}
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    ps = load_ps_config(tmp_path / "ps.json")
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    return ps, dbs, HPSModel(ps.models[0], dbs)


def test_a_model_larger_than_memory_loads_a_part_at_a_time(trained, tmp_path, monkeypatch):
    """HugeCTR's HPS reads a whole table into memory before it fills a database
    (``RawModelLoader::load``, HugeCTR/hps/modelloader.cpp): a table larger than memory, the
    kind RocksDB is there for, cannot be served. jctr reads each sparse file
    ``LOAD_PART_BYTES`` at a time (here 1,024 rows) into RocksDB and the hash map, saying how
    far it is, and serves what the trainer predicts; a non-finite row in the last part, or a
    key given twice, is refused before any database is written (the table loaded before stays
    whole); a hash map that would need more memory than is left is refused with the
    figures."""
    import shutil

    from jctr.serving import hps_model

    tmp, reference = trained("dlrm")
    shutil.copytree(tmp / "bundle", tmp_path / "bundle")
    folder = tmp_path / "bundle" / "sparse" / "sparse_embedding1.model"
    rows = (folder / "key").stat().st_size // 8
    assert rows > 2 * 1024  # the table is read in three parts or more
    monkeypatch.setattr(hps_model, "LOAD_PART_BYTES", 1)  # the least: 1,024 rows a part
    seen = []
    real = hps_model.sparse_model_parts

    def parts(*args, **kwargs):
        for keys, values in real(*args, **kwargs):
            seen.append(keys.size)
            yield keys, values

    monkeypatch.setattr(hps_model, "sparse_model_parts", parts)
    ps, dbs, m = _rocks_model(tmp_path, "big")
    monkeypatch.setattr(hps_model._LoadMeter, "EVERY_S", 0.0)  # a line every part
    lines = []
    try:
        written = m.load_databases(progress=lines.append)[m.tables[0].key]
        assert written == {"persistent_db": rows, "volatile_db": round(rows * 0.5)}
        # how far the load is, for a long one: every phase, rows done of how many, the rate
        table = m.tables[0].key
        for what, total in (("checking its files", rows),
                            ("into persistent_db (rocks_db)", rows),
                            ("into volatile_db (hash_map)", round(rows * 0.5))):
            said = [x for x in lines if x.startswith(f"[jctr] {table}: {what}: ")]
            assert said and f": 1,024 of {total:,} rows (" in said[0] and \
                "M rows/s" in said[0], lines
        # read to check, to write RocksDB, and the parts the hash map's half takes
        assert max(seen) == 1024 and sum(seen) == 2 * rows + -(-rows // 2 // 1024) * 1024
        for batch, expected in reference:
            np.testing.assert_allclose(m.predict(batch), expected, **TOL)
    finally:
        m.close()
        dbs.close()
    # a NaN in the last row: refused, and RocksDB still holds the table loaded above
    vectors = np.fromfile(folder / "emb_vector", "<f4")
    vectors[-1] = np.nan
    vectors.tofile(folder / "emb_vector")
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    del manifest["files"]  # changed by hand: the checksums no longer apply
    (tmp_path / "bundle" / "manifest.json").write_text(json.dumps(manifest))
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    with pytest.raises(ModelFileError, match=r"emb_vector: 1 row\(s\) with non-finite values"):
        HPSModel(ps.models[0], dbs).load_databases(replace=True)
    # ... and so is a key given twice (named)
    vectors[-1] = 0.0
    vectors.tofile(folder / "emb_vector")
    keys = np.fromfile(folder / "key", "<i8")
    keys[-1] = keys[1]
    keys.tofile(folder / "key")
    with pytest.raises(ModelFileError, match=rf"key: duplicate keys \(key {keys[1]},"):
        HPSModel(ps.models[0], dbs).load_databases(replace=True)
    table = "hps_et.big.sparse_embedding1"
    meta = dbs.persistent.get_meta(table)
    assert meta is not None and not meta.get("incomplete")
    assert dbs.persistent.size(table) == rows
    dbs.close()
    # a model of two tables: the second's bad file leaves the first's database table as
    # it was too (every table's files are checked before any is written)
    wide, _ = trained("wdl")
    shutil.copytree(wide / "bundle", tmp_path / "wdl")
    doc = {"persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks_wdl")},
           "models": [{"model": "w", "bundle": "wdl", "max_batch_size": 64}]}
    (tmp_path / "ps_w.json").write_text(json.dumps(doc))
    ps = load_ps_config(tmp_path / "ps_w.json")
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    m = HPSModel(ps.models[0], dbs)
    m.load_databases()
    first = m.tables[0].key
    folder = tmp_path / "wdl" / "sparse" / f"{m.tables[-1].spec.name}.model"
    vectors = np.fromfile(folder / "emb_vector", "<f4")
    vectors[-1] = np.inf
    vectors.tofile(folder / "emb_vector")
    manifest = json.loads((tmp_path / "wdl" / "manifest.json").read_text())
    del manifest["files"]
    (tmp_path / "wdl" / "manifest.json").write_text(json.dumps(manifest))
    held = dbs.persistent.get_meta(first)
    mark = np.full((1, m.tables[0].dim), 7.0, np.float32)  # gone if the table were loaded
    dbs.persistent.insert(first, np.array([-7], np.int64), mark)
    with pytest.raises(ModelFileError, match="non-finite"):
        HPSModel(ps.models[0], dbs).load_databases(replace=True)
    assert dbs.persistent.get_meta(first) == held and not held.get("incomplete")
    assert dbs.persistent.lookup(first, np.array([-7], np.int64), m.tables[0].dim)[1].all()
    m.close()
    dbs.close()
    # the hash map alone must hold every row: refused where memory has no room for them
    monkeypatch.setattr(hps_model, "room_left", lambda reserve=0: 1 << 10)
    doc = {"volatile_db": {"type": "hash_map"}, "persistent_db": {"type": "disabled"},
           "models": [{"model": "big", "bundle": "bundle", "max_batch_size": 256}]}
    ps = parse_ps_config(doc, str(tmp_path / "ps2.json"))
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    with pytest.raises(StoreError, match=r"volatile_db \(hash_map\) of model big: its tables' "
                                         r"rows would take \d+\.\d+ KiB .* but 1\.00 KiB are "
                                         "left; lower initial_cache_rate or set overflow_margin"):
        HPSModel(ps.models[0], dbs).load_databases()
    dbs.close()


def test_device_caches_larger_than_the_device_has_left_are_refused(trained, tmp_path,
                                                                    monkeypatch):
    """``gpucacheper`` of a table's rows on the device: on CPU, host memory. HugeCTR's HPS
    allocates its embedding cache and fails in CUDA when it does not fit; a cache too large
    is refused when the model is made, naming the JSON field and both figures."""
    import jax

    from jctr.serving import hps_model
    from jctr.sharding.plan import device_room_bytes

    assert device_room_bytes(jax.local_devices()[0]) > 0  # CPU: what the host has left
    tmp, _ = trained("dlrm")
    ps = _ps(tmp, "dlrm_cache_room", {"type": "hash_map"}, persistent=False,
             gpucacheper=0.5)
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    monkeypatch.setattr(hps_model, "device_room_bytes", lambda device: 1 << 10)
    with pytest.raises(ConfigError, match=r"models\[0\]\.gpucacheper: 0\.5: the device caches "
                                          r"of this model's tables would take \d+\.\d+ KiB, "
                                          r"but the host's memory has 1\.00 KiB left; lower "
                                          "gpucacheper or set gpucache false"):
        HPSModel(ps.models[0], dbs, where="models[0]", source=ps.source)
    monkeypatch.setattr(hps_model, "device_room_bytes", lambda device: 1 << 40)
    HPSModel(ps.models[0], dbs, where="models[0]", source=ps.source).close()
    dbs.close()


def test_a_restart_takes_the_digests_its_last_load_recorded(trained, tmp_path, monkeypatch):
    """``serve`` names the export a database table holds by the SHA-256 of its model files
    (~1.1 GB/s here: a 50 GB model read whole before the first answer at every start). A
    table's manifest records each file's size, mtime, ctime, inode and digest; a restart
    takes the digest of a file that still has all of them and was written ``RACY_NS``
    before its hashing began (git's index check, Documentation/technical/racy-git.txt). A
    file written again, even with the same size and its mtime set back, has a new ctime: it
    is hashed, and a changed export is refused as before; one rewritten with the same bytes
    is hashed once more and its new record kept for the next start."""
    import shutil

    from jctr.serving import table_manifest
    from jctr.serving.hps import TableMismatch

    tmp, reference = trained("dlrm")
    shutil.copytree(tmp / "bundle", tmp_path / "bundle")
    time.sleep(0.05)
    monkeypatch.setattr(table_manifest, "RACY_NS", 20_000_000)  # the files are 50 ms old
    hashed = []
    real = table_manifest._hash_file
    monkeypatch.setattr(table_manifest, "_hash_file",
                        lambda path: hashed.append(path) or real(path))
    files = 3  # the dense file, the table's key and emb_vector

    def start(replace=False):
        """A new process's start: nothing hashed in memory; the files hashed now."""
        table_manifest._digests.clear()
        hashed.clear()
        _, dbs, m = _rocks_model(tmp_path, "m")
        try:
            written = m.load_databases(replace=replace)[m.tables[0].key]
            batch, expected = reference[0]
            np.testing.assert_allclose(m.predict(batch), expected, **TOL)
            meta = dbs.persistent.get_meta(m.tables[0].key)
            return written["persistent_db"], len(hashed), meta
        finally:
            m.close()
            dbs.close()

    rows, n, meta = start(replace=True)
    assert rows > 0 and n == files and len(meta["files"]) == files
    assert start() == (0, 0, meta)  # the restart reads no file and keeps the table
    # a file written again with the same bytes: hashed again, the table kept, its new
    # record stored (now old enough to be taken at the next start)
    key = tmp_path / "bundle" / "sparse" / "sparse_embedding1.model" / "key"
    key.write_bytes(key.read_bytes())
    time.sleep(0.05)
    rows, n, after = start()
    assert (rows, n) == (0, 1) and after["files"] != meta["files"]
    assert after["identity"] == meta["identity"]
    assert start() == (0, 0, after)
    # written just before its hashing: a later write in the same tick of the file system's
    # clock would keep its mtime, so its record is not taken
    monkeypatch.setattr(table_manifest, "RACY_NS", 60_000_000_000)
    assert start()[1] == files
    monkeypatch.setattr(table_manifest, "RACY_NS", 20_000_000)
    # another export's bytes with the same size, the mtime set back: the ctime tells
    vectors = key.parent / "emb_vector"
    st = vectors.stat()
    data = bytearray(vectors.read_bytes())
    data[:4] = np.float32(7.5).tobytes()
    vectors.write_bytes(bytes(data))
    os.utime(vectors, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert vectors.stat().st_mtime_ns == st.st_mtime_ns
    time.sleep(0.05)
    with pytest.raises(TableMismatch, match="holds export .* but the model files give export"):
        start()


def test_seed_valid_settings_work(trained, tmp_path):
    """hit_rate_threshold above 1 (never asynchronous), embedding_vecsize_per_table as a
    maximum, supportlonglong false (INT32 keys; a model with wider keys is refused)."""
    import shutil

    from jctr.serving.server import input_names

    tmp, reference = trained("dlrm")
    shutil.copytree(tmp / "bundle", tmp_path / "bundle")
    doc = {"volatile_db": {"type": "hash_map"},
           "models": [{"model": "dlrm_seed", "bundle": "bundle", "max_batch_size": 256,
                       "gpucacheper": 0.5, "hit_rate_threshold": 1.5}]}
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    ps = load_ps_config(tmp_path / "ps.json")
    dims = [e.embedding_vec_size for e in
            load_config(str(tmp_path / "bundle" / "config.json"), require_solver=False).embeddings]
    params = dataclasses.replace(ps.models[0], embedding_vecsize_per_table=[d * 4 for d in dims])
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    m = HPSModel(params, dbs)
    try:
        m.load_databases()
        for _ in range(2):
            for batch, expected in reference:
                np.testing.assert_allclose(m.predict(batch), expected, **TOL)
        assert m._pending == []  # every insert ran before the answer
        assert m.stats()[m.tables[0].key]["device_cache"] > 0
        small = dataclasses.replace(params, embedding_vecsize_per_table=[d - 1 for d in dims])
        with pytest.raises(ConfigError, match=r"embedding_vecsize_per_table\[0\]: .* the "
                                              "largest vector size the table may hold"):
            HPSModel(small, dbs)
    finally:
        m.close()
        dbs.close()
    # supportlonglong false: these hashed keys are 64-bit -> refused at load, naming the file
    narrow = dataclasses.replace(params, i64_input_key=False)
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    wide = HPSModel(narrow, dbs)
    with pytest.raises(StoreError, match="does not fit in int32, but supportlonglong is false"):
        wide.load_databases()
    wide.close()
    dbs.close()
    # ... and with keys that fit (the same model, keys masked to 31 bits on both sides)
    mask = np.int64(0x7FFFFFFF)
    for folder in (tmp_path / "bundle" / "sparse").iterdir():
        keys = np.fromfile(folder / "key", "<i8")
        assert np.unique(keys & mask).size == keys.size
        (keys & mask).tofile(folder / "key")
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    del manifest["files"]  # files changed by hand: their checksums no longer apply
    (tmp_path / "bundle" / "manifest.json").write_text(json.dumps(manifest))
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    m = HPSModel(narrow, dbs)
    try:
        m.load_databases()
        assert [d for n, d, _ in input_names(m) if n.startswith("CATCOLUMN")] == ["INT32"]
        for batch, expected in reference:
            narrowed = batch._replace(keys=tuple(k & mask for k in batch.keys))
            np.testing.assert_allclose(m.predict(narrowed), expected, **TOL)
    finally:
        m.close()
        dbs.close()


def test_update_messages_round_trip_and_refuse_garbage():
    """The documented binary layout of online updates: rows, erased keys and dense weights
    come back as they went in; anything else is a clear MessageError, never a crash."""
    from jctr.stores.update_messages import (
        MessageError,
        decode,
        encode_dense,
        encode_erase,
        encode_rows,
        join_dense,
        rows_per_message,
    )

    keys = np.array([3, -7, 2**62], np.int64)
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    data = encode_rows("dlrm", "sparse_embedding1", 42, keys, values)
    assert data[:8] == b"JCTRUPD1" and len(data) == 32 + 4 + 17 + 8 * 3 + 4 * 12
    u = decode(data)
    assert (u.kind, u.model, u.table, u.step) == ("rows", "dlrm", "sparse_embedding1", 42)
    np.testing.assert_array_equal(u.keys, keys)
    np.testing.assert_array_equal(u.values, values)
    (whole,) = encode_dense("dlrm", 7, b"\x00\x01\x02\x03", '{"layers": []}')
    d = decode(whole)
    assert (d.kind, d.step, d.dense, d.non_trainable) == ("dense", 7, b"\x00\x01\x02\x03",
                                                          '{"layers": []}')
    # dense weights larger than a message travel in parts
    weights = np.arange(5000, dtype=np.float32).tobytes()
    parts = encode_dense("dlrm", 8, weights, '{"layers": [1]}', max_bytes=4096)
    assert len(parts) == 5 and all(len(p) <= 4096 + 64 for p in parts)
    joined = join_dense([decode(p) for p in parts])
    assert (joined.dense, joined.non_trainable, joined.step) == (weights, '{"layers": [1]}', 8)
    with pytest.raises(MessageError, match="do not add up"):
        join_dense([decode(p) for p in parts[:2] + parts[3:]])
    with pytest.raises(MessageError, match="no JCTRUPD1 header"):
        decode(b"\x80\x04pickle")
    with pytest.raises(MessageError, match="rows of 4 need"):
        decode(data[:-1])
    assert rows_per_message(16, 262144) * (8 + 64) < 262144
    erased = encode_erase("dlrm", "sparse_embedding1", 43, keys)
    assert len(erased) == 32 + 4 + 17 + 8 * 3
    e = decode(erased)
    assert (e.kind, e.table, e.step, e.values) == ("erase", "sparse_embedding1", 43, None)
    np.testing.assert_array_equal(e.keys, keys)
    with pytest.raises(MessageError, match="bytes of erased keys, 3 keys need"):
        decode(erased + b"\0")
    assert rows_per_message(0, 262144) * 8 < 262144


def test_dense_weights_kept_from_the_update_stream(tmp_path):
    """Databases.save_dense keeps a model's applied dense weights in the layer that outlives
    the process (meta written last), load_dense gives them back byte for byte, forget_dense
    drops them (a table loaded again from the files); with only an in-process hash map
    nothing lasts, and updates_last says so (the applier then reads the topics from their
    start)."""
    dbs = Databases(VolatileDatabaseParams(type="hash_map"),
                    PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")))
    dense = np.random.default_rng(0).normal(size=5000).astype("<f4").tobytes() + b"\1\2"
    record = {"step": 7, "non_trainable": '{"layers": []}', "base": "abc"}
    assert dbs.save_dense("hps_dense.m", dense, record)
    meta, got = dbs.load_dense("hps_dense.m")
    assert got == dense and meta["step"] == 7 and meta["base"] == "abc"
    assert dbs.updates_last("hps_et.m.t")
    # the next updates write over it: longer, then shorter, each read back whole
    for size, step in ((9000, 8), (3000, 9)):
        other = np.random.default_rng(step).normal(size=size).astype("<f4").tobytes()
        assert dbs.save_dense("hps_dense.m", other, {**record, "step": step})
        meta, got = dbs.load_dense("hps_dense.m")
        assert got == other and meta["step"] == step
    rows = dbs.persistent.lookup("hps_dense.m", np.arange(4, dtype=np.int64), 1024)[1]
    assert rows.tolist() == [True, True, True, False]  # 3,000 floats: no row of 9,000's left
    dbs.forget_dense("hps_dense.m")
    assert dbs.load_dense("hps_dense.m") is None
    dbs.close()
    alone = Databases(VolatileDatabaseParams(type="hash_map"), PersistentDatabaseParams())
    assert not alone.save_dense("hps_dense.m", dense, record)
    assert alone.load_dense("hps_dense.m") is None and not alone.updates_last("hps_et.m.t")
    alone.close()


def test_rocksdb_scan_answers_as_point_reads(tmp_path):
    """lookup_by_scan (one pass over a table, what a pull of many keys takes) gives lookup's
    answer: the same rows and found flags for present, absent and repeated keys; the row
    store switches to it for a large share of the stored rows."""
    from jctr.online.row_store import RowStore
    from jctr.stores.rocksdb import RocksDBStore

    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")))
    rng = np.random.default_rng(0)
    keys = rng.choice(10**12, 5000, replace=False).astype(np.int64)
    store.insert("t", keys, rng.random((5000, 4)).astype(np.float32))
    store.erase("t", keys[:100])
    q = np.concatenate([keys[50:3000], keys[:10], keys[2000:2010], [-1, 7]]).astype(np.int64)
    want = store.lookup("t", q, 4)
    got = store.lookup_by_scan("t", q, 4)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])
    assert 0 < want[1].sum() < q.size
    assert store.lookup_by_scan("absent", q, 4)[1].sum() == 0
    store.close()

    # the row store reads a large share of its rows by the scan, a few keys by point reads
    from types import SimpleNamespace

    rows = RowStore(str(tmp_path / "rows"), [SimpleNamespace(name="t", dim=3)], [{}])
    stored = {"keys": keys, "values": rng.random((5000, 3)).astype(np.float32),
              "slot": np.zeros(5000, np.int32)}
    rows.push(0, stored)
    scans = []
    real = rows.db.lookup_by_scan
    rows.db.lookup_by_scan = lambda *a, **k: scans.append(1) or real(*a, **k)
    few, many = rows.pull(0, keys[200:220]), rows.pull(0, keys[100:4000])
    assert scans == [1]
    np.testing.assert_array_equal(few["values"], stored["values"][200:220])
    np.testing.assert_array_equal(many["keys"], keys[100:4000])
    np.testing.assert_array_equal(many["values"], stored["values"][100:4000])
    rows.close()


def test_a_row_stores_rows_hold_their_keys_and_an_older_database_is_kept_as_it_is(tmp_path):
    """A RocksDB row store writes each row's key into its value too (two float32 columns
    first), so a pass over the table reads values alone (``RocksDBStore.items(keyed=True)``:
    half the interpreter's time a row); pulls by scan and by point reads, the rows of other
    keys, the scaling of a slot's columns and an undo (the written keys erased, the pulled
    rows put back) give what was pushed. A database a row store wrote before rows held their
    keys (its width one key's columns short) is read and written in its own layout."""
    from types import SimpleNamespace

    from jctr.online.row_store import RowStore

    rng = np.random.default_rng(3)
    specs, shapes = [SimpleNamespace(name="t", dim=3)], [{"accum": (2,)}]
    keys = rng.choice(10**12, 4000, replace=False).astype(np.int64) - 10**11
    stored = {"keys": keys, "values": rng.random((4000, 3)).astype(np.float32),
              "accum": rng.random((4000, 2)).astype(np.float32),
              "slot": rng.integers(0, 5, 4000).astype(np.int32)}

    def check(rows, keyed):
        assert rows.keyed == [keyed]
        assert rows.db.dim("online.t") == rows.width(0) + 2 * keyed == 6 + 2 * keyed
        few, many = rows.pull(0, keys[10:30]), rows.pull(0, keys[5:3500])
        for got, part in ((few, slice(10, 30)), (many, slice(5, 3500))):
            for name in stored:
                np.testing.assert_array_equal(got[name], stored[name][part], err_msg=name)
        held = KeySet()
        held.add(keys[:1000])
        other = rows.pull_except(0, held)
        order = np.argsort(other["keys"])
        want = np.argsort(keys[1000:]) + 1000
        for name in stored:
            np.testing.assert_array_equal(other[name][order], stored[name][want])

    from jctr.ops.host_index import KeySet

    rows = RowStore(str(tmp_path / "new"), specs, shapes)
    rows.push(0, stored)
    k, v = next(rows.db.items("online.t", keyed=True))
    np.testing.assert_array_equal(v[:, :2].copy().view(np.int64).reshape(-1), k)
    check(rows, True)
    # the undo saves every key the write-back writes: those the database did not hold are
    # erased again, the pulled rows put back
    fresh = rng.choice(10**12, 30, replace=False).astype(np.int64) + 10**12
    rows.save_undo(str(tmp_path / "undo.npz"), [rows.pull(0, keys[:50])],
                   [np.concatenate([fresh[:10], keys[:50], fresh[10:]])],
                   {"day": "d", "pass": 1})
    rows.push(0, {"keys": np.concatenate([keys[:50], fresh]),
                  "values": np.zeros((80, 3), np.float32),
                  "accum": np.ones((80, 2), np.float32), "slot": np.ones(80, np.int32)})
    assert rows.size(0) == 4030
    assert rows.undo(str(tmp_path / "undo.npz")) == ("d", 1)
    assert rows.size(0) == 4000 and rows.pull(0, fresh)["keys"].size == 0
    rows.scale(0, "accum", (2.0, 0.5))
    got = rows.pull(0, keys[:50])
    np.testing.assert_array_equal(got["values"], stored["values"][:50])
    np.testing.assert_array_equal(got["accum"], stored["accum"][:50] * [2.0, 0.5])
    rows.scale(0, "accum", (0.5, 2.0))
    check(rows, True)
    # an undo file an earlier jctr wrote (its rows joined in one array) is put back too
    before = rows.pull(0, keys[:50])
    packed = np.concatenate([keys[:50, None].view(np.float32), before["values"],
                             before["accum"], before["slot"][:, None].astype(np.float32)], 1)
    np.savez(str(tmp_path / "old_undo.npz"), day=np.array("d"), **{"pass": np.array(2)},
             **{"0/added": keys[:0], "0/keys": keys[:50], "0/rows": packed})
    rows.push(0, {**{n: a[:50] for n, a in stored.items()},
                  "values": np.ones((50, 3), np.float32)})
    assert rows.undo(str(tmp_path / "old_undo.npz")) == ("d", 2)
    check(rows, True)
    rows.close()

    old = RowStore(str(tmp_path / "old"), specs, shapes)
    old.keyed = [False]  # as a row store wrote before rows held their keys
    old.push(0, {n: a[:2000] for n, a in stored.items()})
    old.close()
    rows = RowStore(str(tmp_path / "old"), specs, shapes)
    rows.push(0, {n: a[2000:] for n, a in stored.items()})
    check(rows, False)
    rows.close()


def test_rows_go_to_rocksdb_in_its_key_order_each_key_with_its_last_row():
    """:func:`jctr.stores.base.bytewise_order` (every RocksDB write, batched or ingested):
    RocksDB's default comparator orders keys by their bytes, and the stores write a key as
    its 8 little-endian bytes, so the order is that of the byte-swapped keys as unsigned
    integers (negative keys last); a key given more than once is written once, with its
    last position's row (as later writes of one batch win). Checked against Python's own
    sort of the byte strings and a dictionary of last positions."""
    from jctr.stores.base import bytewise_order, encoded_rows, key_columns

    rng = np.random.default_rng(7)
    for keys in (rng.integers(-50, 50, 400), rng.choice(10**15, 300, replace=False) - 10**14,
                 np.array([5], np.int64), np.array([3, 3, 3], np.int64)):
        keys = keys.astype(np.int64)
        last = {int(k): i for i, k in enumerate(keys)}
        want = [last[k] for k in sorted(last, key=lambda k: k.to_bytes(8, "little",
                                                                          signed=True))]
        assert bytewise_order(key_columns(keys)).tolist() == want
        values = rng.random((keys.size, 3)).astype(np.float32)
        got_keys, kcols, vcols = encoded_rows(keys, values, key_order=True)
        assert got_keys.tolist() == keys[want].tolist()
        assert kcols.tobytes() == keys[want].astype("<i8").tobytes()
        assert vcols.tobytes() == values[want].astype("<f4").tobytes()


@pytest.mark.parametrize("bulk", [True, False])
def test_a_large_insert_is_ingested_as_a_write_batch_would_write_it(tmp_path, monkeypatch,
                                                                    bulk):
    """A large insert is written as one sorted table file and ingested (RocksDB's bulk load)
    by a bulk store (the streaming row store, ``INGEST_ROWS``) and by a served database
    (``INGEST_ROWS_LIVE``: a model load, a poll's online updates): the database then answers
    exactly as after the write-batch path -- a key given twice keeps its last row, earlier
    rows of a key are overwritten (in the served database's memtable too), erased keys come
    back when written again, negative keys sort as bytes -- and no file is left beside the
    database (one left by a process killed while writing it goes at the next open)."""
    import os

    from jctr.stores.rocksdb import RocksDBStore

    rng = np.random.default_rng(1)
    old = rng.choice(10**12, 3000, replace=False).astype(np.int64) - 5 * 10**11
    new = np.concatenate([old[:1000], rng.choice(10**12, 2000).astype(np.int64), old[:10]])
    rows_old = rng.random((old.size, 4)).astype(np.float32)
    rows_new = rng.random((new.size, 4)).astype(np.float32)
    query = np.concatenate([old, new, [-1, 0, 2**62]]).astype(np.int64)
    answers = []
    for name, ingest_from in (("batches", 10**9), ("ingested", 1)):
        monkeypatch.setattr(RocksDBStore, "INGEST_ROWS" if bulk else "INGEST_ROWS_LIVE",
                            ingest_from)
        path = str(tmp_path / name)
        store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=path), bulk=bulk)
        store.insert("t", old, rows_old)
        store.erase("t", old[:5])
        store.insert("t", new, rows_new)
        answers.append((store.lookup("t", query, 4), store.lookup_by_scan("t", query, 4),
                        sorted(k for ks, _ in store.items("t") for k in ks.tolist())))
        assert not [f for f in os.listdir(path) if f.startswith("jctr-ingest")]
        store.close()
    # a table file left by a process killed while writing it is removed at the next open
    left = os.path.join(path, "jctr-ingest-4242-1.sst")
    with open(left, "wb") as f:
        f.write(b"half a file")
    RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=path), bulk=bulk).close()
    assert not os.path.exists(left)
    (point, scan, listed), (point2, scan2, listed2) = answers
    for a, b in ((point, point2), (scan, scan2), (point, scan2)):
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(a[0], b[0])
    assert listed == listed2 == sorted(set(old.tolist()) | set(new.tolist()))
    # the last of a key's rows in one insert wins (old[:10] appear twice in `new`)
    got, found = point2
    assert found[:10].all()
    np.testing.assert_array_equal(got[:10], rows_new[-10:])
