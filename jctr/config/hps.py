"""Hierarchical parameter server (HPS) parameters: the typed form of HugeCTR's
``InferenceParams`` / ``VolatileDatabaseParams`` / ``PersistentDatabaseParams`` /
``UpdateSourceParams`` and of the parameter-server JSON file (``supportlonglong``,
``volatile_db``, ``persistent_db``, ``update_source``, ``models``), with HugeCTR's names and
defaults. Values are checked when the objects are built, in Python or from JSON; JSON errors
name the path (``models[0].gpucacheper: expected a number in [0.0, 1.0], got 2``).

Example::

    ps = load_ps_config("ps.json")
    ps.models[0].model_name, ps.volatile_db.type
    params = InferenceParams(model_name="dlrm", max_batchsize=1024, ...)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from jctr.config.reader import ConfigError, ObjectReader, describe, join_path, json_from_text


def table_name(model: str, table: str) -> str:
    """An embedding table's name in the databases and its online updates' Kafka topic
    (HugeCTR's ``hps_et.<model>.<table>``): the one place it is made."""
    return f"hps_et.{model}.{table}"


def dense_name(model: str) -> str:
    """The Kafka topic of a model's dense weight updates (``hps_dense.<model>``)."""
    return f"hps_dense.{model}"


_SECURITY_KEY = re.compile(r"security\.protocol|(sasl|ssl)\.[a-z0-9_.]+")


def read_kafka_security(r: ObjectReader, key: str = "security") -> tuple[tuple[str, str], ...]:
    """A Kafka client's authentication and encryption settings (``security``: an object of
    librdkafka's ``security.protocol``, ``sasl.*`` and ``ssl.*`` properties, passed through
    as given), as sorted (name, value) pairs; () when absent."""
    if not r.has(key):
        return ()
    child = r.child(key)
    out = []
    for name, value in child.obj.items():
        if not isinstance(name, str) or not _SECURITY_KEY.fullmatch(name):
            raise ConfigError(join_path(child.path, name), "expected one of librdkafka's "
                              "security.protocol, sasl.* or ssl.* settings", r.source)
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(join_path(child.path, name), f"expected a string, number or "
                              f"boolean, got {describe(value)}", r.source)
        out.append((name, str(value).lower() if isinstance(value, bool) else str(value)))
    return tuple(sorted(out))


class DatabaseType_t:  # noqa: N801 - HugeCTR's name
    """Database implementations (HugeCTR's enum; values are the JSON strings)."""

    disabled = "disabled"
    hash_map = "hash_map"
    parallel_hash_map = "parallel_hash_map"
    redis_cluster = "redis_cluster"
    rocks_db = "rocks_db"


class DatabaseOverflowPolicy_t:  # noqa: N801 - HugeCTR's name
    """What a full partition evicts (HugeCTR's enum; values are the JSON strings)."""

    evict_oldest = "evict_oldest"
    evict_random = "evict_random"


class UpdateSourceType_t:  # noqa: N801 - HugeCTR's name
    null = "null"
    kafka_message_queue = "kafka_message_queue"


VOLATILE_TYPES = ("disabled", "hash_map", "parallel_hash_map", "redis_cluster")
PERSISTENT_TYPES = ("disabled", "rocks_db")
UPDATE_SOURCE_TYPES = ("null", "kafka_message_queue")
OVERFLOW_POLICIES = ("evict_oldest", "evict_random")
NO_LIMIT = 2 ** 64 - 1  # overflow_margin's default: no limit
DEFAULT_UPDATE_FILTERS = ("^hps_.+$",)


def _fail(name: str, message: str, value: Any) -> ConfigError:
    return ConfigError(name, f"expected {message}, got {describe(value)}")


def _check_int(obj, name: str, min_value: int) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < min_value:
        raise _fail(name, "a positive integer" if min_value == 1 else
                    f"an integer >= {min_value}", v)


def _check_fraction(obj, name: str, *, open_interval: bool = False) -> None:
    v = getattr(obj, name)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (
        0.0 < v < 1.0 if open_interval else 0.0 <= v <= 1.0)
    if not ok:
        raise _fail(name, "a number in (0, 1)" if open_interval else "a number in [0.0, 1.0]", v)


def _check_filters(obj) -> None:
    """``update_filters``: a list of regular expressions that compile."""
    import re

    filters = obj.update_filters
    if isinstance(filters, (str, bytes)) or not hasattr(filters, "__iter__"):
        raise _fail("update_filters", "a list of regular expressions", filters)
    for i, f in enumerate(filters):
        if not isinstance(f, str):
            raise ConfigError(f"update_filters[{i}]", f"expected a regular expression string, "
                              f"got {describe(f)}")
        try:
            re.compile(f)
        except re.error as e:
            raise ConfigError(f"update_filters[{i}]", f"{f!r} is not a regular expression: "
                              f"{e}") from None
    object.__setattr__(obj, "update_filters", tuple(filters))


def _check_choice(obj, name: str, choices: tuple[str, ...]) -> None:
    v = getattr(obj, name)
    if v not in choices:
        raise _fail(name, "one of " + ", ".join(f'"{c}"' for c in choices), v)


@dataclass(frozen=True)
class VolatileDatabaseParams:
    """The CPU-memory layer: ``hash_map``, ``parallel_hash_map`` (default) or
    ``redis_cluster`` (or ``disabled``). ``num_partitions`` None means HugeCTR's default:
    min(cores, 16) for the hash maps, 8 for Redis.

    Example::

        VolatileDatabaseParams(type="redis_cluster", address="127.0.0.1:7000,127.0.0.1:7001",
                               num_partitions=8, overflow_margin=1_000_000)
    """

    type: str = "parallel_hash_map"
    """``hash_map``, ``parallel_hash_map``, ``redis_cluster`` or ``disabled``."""
    address: str = "127.0.0.1:7000"
    """Redis: the cluster's nodes, ``host[:port],host[:port],...`` (port 7000)."""
    user_name: str = "default"
    """Redis: the user to authenticate as."""
    password: str = ""
    """Redis: the password (empty: none)."""
    num_partitions: int | None = None
    """Keys are split by hash into this many partitions, the unit of overflow handling (and in
    Redis the unit spread over the nodes); default min(cores, 16), Redis 8."""
    allocation_rate: int = 268435456
    """Hash maps: grow their rows by this many bytes at a time."""
    max_get_batch_size: int = 10000
    """Redis: keys per lookup command (HMGET)."""
    max_set_batch_size: int = 10000
    """Redis: keys per write command (HSET)."""
    overflow_margin: int = NO_LIMIT
    """A partition holding more keys than this is cut back (default: no limit)."""
    overflow_policy: str = "evict_oldest"
    """What a cut drops: ``evict_oldest`` (least recently written or, with
    ``refresh_time_after_fetch``, read) or ``evict_random``."""
    overflow_resolution_target: float = 0.8
    """A cut leaves ``overflow_margin * overflow_resolution_target`` keys."""
    initial_cache_rate: float = 1.0
    """The share of each table written here at load (all of it without a persistent DB)."""
    refresh_time_after_fetch: bool = False
    """A lookup refreshes a key's time, so ``evict_oldest`` drops the least recently read."""
    cache_missed_embeddings: bool = False
    """Rows found in the persistent DB are written here."""
    update_filters: tuple[str, ...] = DEFAULT_UPDATE_FILTERS
    """Regular expressions of the tables that take online updates (parsed; updates are not
    consumed by this version)."""

    def __post_init__(self):
        _check_choice(self, "type", VOLATILE_TYPES)
        _check_choice(self, "overflow_policy", OVERFLOW_POLICIES)
        if self.num_partitions is not None:
            _check_int(self, "num_partitions", 1)
        for name in ("allocation_rate", "max_get_batch_size", "max_set_batch_size",
                     "overflow_margin"):
            _check_int(self, name, 1)
        _check_fraction(self, "overflow_resolution_target", open_interval=True)
        _check_fraction(self, "initial_cache_rate")
        _check_filters(self)
        if self.type == "redis_cluster":
            self.nodes()  # address must parse

    @property
    def partitions(self) -> int:
        if self.num_partitions is not None:
            return self.num_partitions
        return 8 if self.type == "redis_cluster" else min(os.cpu_count() or 1, 16)

    def nodes(self) -> list[tuple[str, int]]:
        """``address`` as (host, port) pairs ("host-1[:port],host-2[:port]"; port 7000)."""
        out = []
        for part in self.address.split(","):
            part = part.strip()
            host, _, port = part.rpartition(":") if ":" in part else (part, "", "7000")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError("address", f'expected "host[:port],host[:port],...", got '
                                  f"{describe(self.address)}")
            out.append((host, int(port)))
        return out


@dataclass(frozen=True)
class PersistentDatabaseParams:
    """The persistent layer: ``rocks_db`` at ``path`` (or ``disabled``, the default).

    Example::

        PersistentDatabaseParams(type="rocks_db", path="/data/hps_rocksdb")
    """

    type: str = "disabled"
    """``rocks_db`` or ``disabled``."""
    path: str = "/tmp/rocksdb"
    """The RocksDB folder (created if empty; a folder holding anything else is refused). In a
    parameter-server file a relative path is taken from the file's folder."""
    num_threads: int = 16
    """RocksDB background threads."""
    read_only: bool = False
    """Open the database read-only (no load, no writes)."""
    max_get_batch_size: int = 10000
    """Keys per multi-get."""
    max_set_batch_size: int = 10000
    """Keys per write batch."""
    update_filters: tuple[str, ...] = DEFAULT_UPDATE_FILTERS
    """Regular expressions of the tables that take online updates (parsed; updates are not
    consumed by this version)."""

    def __post_init__(self):
        _check_choice(self, "type", PERSISTENT_TYPES)
        for name in ("num_threads", "max_get_batch_size", "max_set_batch_size"):
            _check_int(self, name, 1)
        if not isinstance(self.path, str) or not self.path:
            raise _fail("path", "a non-empty string", self.path)
        _check_filters(self)


@dataclass(frozen=True)
class UpdateSourceParams:
    """Where online updates come from (``kafka_message_queue``; default ``null``: none)."""

    type: str = "null"
    """``null`` (no online updates) or ``kafka_message_queue`` (``serve`` applies the updates
    training publishes with ``solver.kafka_sink``; docs/serving.md)."""
    brokers: str = "127.0.0.1:9092"
    """Kafka: the brokers, ``host:port,...``."""
    metadata_refresh_interval_ms: int = 30000
    """Kafka: how often topic metadata is refreshed."""
    poll_timeout_ms: int = 500
    """Kafka: the longest a poll waits."""
    receive_buffer_size: int = 262144
    """Kafka: the consumer's receive buffer in bytes."""
    max_batch_size: int = 8192
    """Kafka: updates applied at once at most."""
    failure_backoff_ms: int = 50
    """Kafka: the wait before a failed database write is tried again."""
    max_commit_interval: int = 32
    """Kafka: messages applied between two offset commits at most."""
    security: tuple[tuple[str, str], ...] = ()
    """Kafka (jctr extension): authentication and encryption, an object of librdkafka's
    ``security.protocol``, ``sasl.*`` and ``ssl.*`` settings, passed to the client as given."""

    def __post_init__(self):
        _check_choice(self, "type", UPDATE_SOURCE_TYPES)
        for name in ("metadata_refresh_interval_ms", "poll_timeout_ms", "receive_buffer_size",
                     "max_batch_size", "failure_backoff_ms", "max_commit_interval"):
            _check_int(self, name, 1)


@dataclass(frozen=True)
class InferenceParams:
    """One model served by the HPS (HugeCTR's ``hugectr.inference.InferenceParams``).

    ``network_file`` is the model's training config (a bundle's ``config.json``),
    ``dense_model_file`` its dense weights (``dense.model``), ``sparse_model_files`` one HugeCTR
    sparse model folder (``key`` + ``emb_vector``) per embedding in the config's order. The
    CUDA-only knobs (``use_cuda_graph``, ``use_algorithm_search``, buffer pools,
    ``thread_pool_size``, ``deployed_devices``) are accepted; docs/serving.md says what each
    maps to. ``embedding_vecsize_per_table`` and ``maxnum_catfeature_query_per_table_per_sample``
    are checked against the network when given (empty: taken from it).

    Example::

        InferenceParams(model_name="dlrm", max_batchsize=1024,
                        network_file="bundle/config.json", dense_model_file="bundle/dense.model",
                        sparse_model_files=["bundle/sparse/emb.model"],
                        i64_input_key=True, cache_size_percentage=0.5)
    """

    model_name: str
    """The model's name (requests address it; tables are ``hps_et.<model>.<table>``)."""
    max_batchsize: int
    """The compiled batch size; larger requests are split, smaller ones padded."""
    dense_model_file: str
    """The dense weights (a bundle's ``dense.model``)."""
    network_file: str
    """The training config (a bundle's ``config.json``)."""
    sparse_model_files: tuple[str, ...]
    """One HugeCTR sparse model folder (``key`` + ``emb_vector``) per embedding, in the
    config's order."""
    i64_input_key: bool = True
    """Keys are int64 (the file's ``supportlonglong``); False: requests send INT32 keys and
    every key of the model files must fit in int32 (checked at load)."""
    hit_rate_threshold: float = 0.9
    """A batch whose cache hit rate is below this inserts its misses before answering; above
    it a worker thread inserts them. Above 1: always before answering (no asynchronous
    inserts, as HugeCTR's documentation suggests to save worker buffers)."""
    use_gpu_embedding_cache: bool = True
    """Keep a device embedding cache."""
    cache_size_percentage: float = 0.2
    """Device cache rows as a share of the rows in the sparse model files."""
    use_mixed_precision: bool = False
    """Accepted; no effect (the model computes in its config's ``compute_dtype``)."""
    scaler: float = 1.0
    """Accepted; no effect (HugeCTR's mixed-precision output scale)."""
    use_algorithm_search: bool = True
    """Accepted; no effect (XLA picks its own GEMM algorithms)."""
    use_cuda_graph: bool = True
    """Accepted; no effect (XLA compiles the whole forward)."""
    number_of_worker_buffers_in_pool: int = 2
    """Asynchronous cache inserts in flight at most; beyond it inserts run synchronously."""
    number_of_refresh_buffers_in_pool: int = 1
    """Accepted; no effect (one refresher thread)."""
    thread_pool_size: int = 16
    """Accepted; no effect."""
    cache_refresh_percentage_per_iteration: float = 0.1
    """The share of the cache one refresh step re-reads from the databases."""
    deployed_devices: tuple[int, ...] = (0,)
    """One device id: the model runs on the first local device. Several are refused (one
    server process serves a model on one device: start one per device)."""
    default_value_for_each_table: tuple[float, ...] = ()
    """Per table, the value of every component of a key no layer knows (default 0)."""
    volatile_db: VolatileDatabaseParams = field(default_factory=VolatileDatabaseParams)
    """The volatile database (the file's ``volatile_db``)."""
    persistent_db: PersistentDatabaseParams = field(default_factory=PersistentDatabaseParams)
    """The persistent database (the file's ``persistent_db``)."""
    update_source: UpdateSourceParams = field(default_factory=UpdateSourceParams)
    """Where online updates come from (the file's ``update_source``)."""
    maxnum_des_feature_per_sample: int = 26
    """Checked against the network's dense features."""
    refresh_delay: float = 0.0
    """Seconds before the first cache refresh."""
    refresh_interval: float = 0.0
    """Seconds between cache refreshes (0: none)."""
    maxnum_catfeature_query_per_table_per_sample: tuple[int, ...] = ()
    """Per table, keys per sample; checked against the network (empty: taken from it)."""
    embedding_vecsize_per_table: tuple[int, ...] = ()
    """Per table, the largest vector size it may hold (HugeCTR preallocates by it); a value
    below the network's ``embedding_vec_size`` is refused (empty: taken from the network)."""
    embedding_table_names: tuple[str, ...] = ()
    """Per table, its name in the databases (default ``sparse_embedding1``, ...)."""
    label_dim: int = 1
    """Checked against the network's label width."""
    slot_num: int = 10
    """Informational; slots come from the network's Data layer."""
    non_trainable_file: str | None = None
    """jctr: the BatchNorm statistics JSON (default: ``non_trainable.json`` beside the dense
    model file)."""
    delta_bundles: tuple[str, ...] = ()
    """jctr: streaming training's delta models (``<day>/delta-<pass>`` bundle folders), in
    training order, applied over the base model that ``bundle`` names: their rows overwrite
    the base's, the dense weights and BatchNorm statistics are the last delta's. ``load``
    writes only the deltas a database lacks (see docs/streaming.md)."""

    def __post_init__(self):
        for name in ("model_name", "dense_model_file", "network_file"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise _fail(name, "a non-empty string", v)
        for name in ("sparse_model_files", "deployed_devices", "default_value_for_each_table",
                     "maxnum_catfeature_query_per_table_per_sample",
                     "embedding_vecsize_per_table", "embedding_table_names"):
            v = getattr(self, name)
            if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
                raise _fail(name, "a list", v)
            object.__setattr__(self, name, tuple(v))
        if not self.sparse_model_files:
            raise _fail("sparse_model_files", "a non-empty list of sparse model folders",
                        list(self.sparse_model_files))
        for name in ("max_batchsize", "number_of_worker_buffers_in_pool",
                     "number_of_refresh_buffers_in_pool", "thread_pool_size",
                     "maxnum_des_feature_per_sample", "label_dim", "slot_num"):
            _check_int(self, name, 1)
        v = self.hit_rate_threshold
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise _fail("hit_rate_threshold", "a number >= 0 (above 1: no asynchronous "
                        "inserts)", v)
        _check_fraction(self, "cache_size_percentage")
        _check_fraction(self, "cache_refresh_percentage_per_iteration")
        for name in ("refresh_delay", "refresh_interval", "scaler"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise _fail(name, "a non-negative number", v)
        if len(self.deployed_devices) > 1:
            raise ConfigError("deployed_devices", f"{list(self.deployed_devices)}: a jctr "
                              "server process runs a model on one device; start one server "
                              "per device (each with one id here) behind a load balancer")
        n = len(self.sparse_model_files)
        for name in ("default_value_for_each_table", "maxnum_catfeature_query_per_table_per_sample",
                     "embedding_vecsize_per_table", "embedding_table_names"):
            v = getattr(self, name)
            if v and len(v) != n:
                raise ConfigError(name, f"expected one entry per sparse model file ({n}), got "
                                  f"{len(v)}")
        if not self.default_value_for_each_table:
            object.__setattr__(self, "default_value_for_each_table", (0.0,) * n)
        if not self.embedding_table_names:
            object.__setattr__(self, "embedding_table_names",
                               tuple(f"sparse_embedding{i + 1}" for i in range(n)))
        if len(set(self.embedding_table_names)) != n:
            raise ConfigError("embedding_table_names", "expected distinct names, got "
                              f"{list(self.embedding_table_names)}")

    def table_key(self, table: int) -> str:
        """The name of one table in the databases: ``hps_et.<model>.<table>`` (HugeCTR's)."""
        return table_name(self.model_name, self.embedding_table_names[table])


@dataclass(frozen=True)
class ParameterServerConfig:
    """A parameter-server JSON file: the databases shared by its models, and the models."""

    models: tuple[InferenceParams, ...]
    """The models served (objects below)."""
    supportlonglong: bool = True
    """Keys are int64 (else int32)."""
    volatile_db: VolatileDatabaseParams = field(default_factory=VolatileDatabaseParams)
    """The volatile database shared by the models (object below)."""
    persistent_db: PersistentDatabaseParams = field(default_factory=PersistentDatabaseParams)
    """The persistent database shared by the models (object below)."""
    update_source: UpdateSourceParams = field(default_factory=UpdateSourceParams)
    """Where online updates come from (object below)."""
    source: str | None = None
    """Not in JSON: the file it came from."""

    def model(self, name: str) -> InferenceParams:
        for m in self.models:
            if m.model_name == name:
                return m
        raise KeyError(name)


# JSON key (the Triton parameter-server file) -> InferenceParams field
MODEL_JSON_KEYS = {
    "model": "model_name", "max_batch_size": "max_batchsize", "dense_file": "dense_model_file",
    "network_file": "network_file", "sparse_files": "sparse_model_files",
    "hit_rate_threshold": "hit_rate_threshold", "gpucache": "use_gpu_embedding_cache",
    "gpucacheper": "cache_size_percentage", "mixed_precision": "use_mixed_precision",
    "scaler": "scaler", "use_algorithm_search": "use_algorithm_search",
    "use_cuda_graph": "use_cuda_graph",
    "num_of_worker_buffer_in_pool": "number_of_worker_buffers_in_pool",
    "num_of_refresher_buffer_in_pool": "number_of_refresh_buffers_in_pool",
    "thread_pool_size": "thread_pool_size",
    "cache_refresh_percentage_per_iteration": "cache_refresh_percentage_per_iteration",
    "deployed_device_list": "deployed_devices",
    "default_value_for_each_table": "default_value_for_each_table",
    "maxnum_des_feature_per_sample": "maxnum_des_feature_per_sample",
    "refresh_delay": "refresh_delay", "refresh_interval": "refresh_interval",
    "maxnum_catfeature_query_per_table_per_sample":
        "maxnum_catfeature_query_per_table_per_sample",
    "embedding_vecsize_per_table": "embedding_vecsize_per_table",
    "embedding_table_names": "embedding_table_names", "label_dim": "label_dim",
    "slot_num": "slot_num", "non_trainable_file": "non_trainable_file",
    "deltas": "delta_bundles",
}
# InferenceParams field -> its JSON key (errors and messages name what the file says)
MODEL_JSON_NAMES = {field: key for key, field in MODEL_JSON_KEYS.items()}
_PATH_KEYS = ("dense_file", "network_file", "non_trainable_file")


def _read_fields(r: ObjectReader, cls, renames: dict[str, str] | None = None) -> dict[str, Any]:
    """The JSON keys of ``cls`` present in ``r``, type-checked by the field annotations."""
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    renames = renames or {name: name for name in types}
    out: dict[str, Any] = {}
    for key, name in renames.items():
        if not r.has(key):
            continue
        kind = types[name].split(" |")[0]
        if name == "security":
            out[name] = read_kafka_security(r, key)
        elif kind == "bool":
            out[name] = r.bool(key)
        elif kind == "int":
            out[name] = r.int(key)
        elif kind == "float":
            out[name] = r.float(key)
        elif kind.startswith("tuple"):
            out[name] = _read_list(r, key)
        elif name == "password" and r.raw(key) == "":
            out[name] = ""
        else:
            out[name] = r.str(key)
    return out


def _read_list(r: ObjectReader, key: str) -> list:
    value = r.list(key)
    path = join_path(r.path, key)
    for i, v in enumerate(value):
        if isinstance(v, (dict, list)) or v is None:
            raise ConfigError(join_path(path, i), f"expected a number or string, got "
                              f"{describe(v)}", r.source)
    return value


def _build(cls, kwargs: dict[str, Any], path: str, source: str | None,
           renames: dict[str, str] | None = None):
    """``cls(**kwargs)``; a value error names its JSON path."""
    try:
        return cls(**kwargs)
    except ConfigError as e:
        back = {v: k for k, v in (renames or {}).items()}
        raise ConfigError(join_path(path, back.get(e.path, e.path)), e.reason, source) from None


def parse_ps_config(raw: Any, source: str | None = None) -> ParameterServerConfig:
    """Parse a parameter-server JSON object (already loaded). Relative paths (the models'
    files, ``persistent_db.path``) are taken from the file's folder."""
    r = ObjectReader(raw, "", source)
    base = os.path.dirname(os.path.abspath(source)) if source else os.getcwd()
    supportlonglong = r.bool("supportlonglong", True)
    dbs = {}
    for key, cls in (("volatile_db", VolatileDatabaseParams),
                     ("persistent_db", PersistentDatabaseParams),
                     ("update_source", UpdateSourceParams)):
        if r.has(key):
            sub = r.child(key)
            kwargs = _read_fields(sub, cls)
            sub.finish()
            if key == "persistent_db" and "path" in kwargs and isinstance(kwargs["path"], str) \
                    and kwargs["path"]:
                # like the model paths: a file's relative paths mean the same from any cwd
                kwargs["path"] = os.path.normpath(os.path.join(base, kwargs["path"]))
            dbs[key] = _build(cls, kwargs, key, source)
        else:
            dbs[key] = cls()
    models_raw = r.list("models")
    if not models_raw:
        raise r.error("models", "expected at least one model")
    models = []
    for i, m in enumerate(models_raw):
        path = join_path("models", i)
        mr = ObjectReader(m, path, source)
        kwargs = _read_fields(mr, InferenceParams, MODEL_JSON_KEYS)
        if "delta_bundles" in kwargs:
            for key in ("dense_file", "non_trainable_file"):
                if mr.has(key):
                    raise mr.error(key, "with \"deltas\" the dense weights and BatchNorm "
                                   "statistics are the last delta's; leave it out")
            kwargs.update(_deltas(mr, base, kwargs["delta_bundles"]))
        if mr.has("bundle"):  # jctr: an exported bundle folder fills the three model paths
            bundle = os.path.join(base, mr.str("bundle"))
            kwargs.setdefault("network_file", os.path.join(bundle, "config.json"))
            kwargs.setdefault("dense_model_file", os.path.join(bundle, "dense.model"))
            kwargs.setdefault("non_trainable_file", os.path.join(bundle, "non_trainable.json"))
            if "sparse_model_files" not in kwargs:
                kwargs["sparse_model_files"] = _bundle_sparse_files(bundle, mr)
        for key in ("model", "max_batch_size", "dense_file", "network_file", "sparse_files"):
            if MODEL_JSON_KEYS[key] not in kwargs:
                raise mr.error(key, "required field is missing (or give \"bundle\": an "
                                    "exported bundle folder)" if key != "model"
                               and key != "max_batch_size" else "required field is missing")
        for key in _PATH_KEYS:
            name = MODEL_JSON_KEYS[key]
            if name in kwargs:
                kwargs[name] = os.path.join(base, kwargs[name])
        kwargs["sparse_model_files"] = [os.path.join(base, str(p))
                                        for p in kwargs["sparse_model_files"]]
        mr.finish()
        kwargs.update(i64_input_key=supportlonglong, **dbs)
        models.append(_build(InferenceParams, kwargs, path, source, MODEL_JSON_KEYS))
    names = [m.model_name for m in models]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ConfigError("models", f'model name "{dup}" appears twice; names must be unique',
                          source)
    r.finish()
    return ParameterServerConfig(models=tuple(models), supportlonglong=supportlonglong,
                                 source=source, **dbs)


def _bundle_manifest(bundle: str, mr: ObjectReader, key: str) -> dict:
    manifest = os.path.join(bundle, "manifest.json")
    try:
        with open(manifest, encoding="utf-8") as f:
            out = json.load(f)
        if not isinstance(out["embeddings"], dict):
            raise TypeError("embeddings is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise mr.error(key, f"{manifest}: not a readable jctr inference bundle ({e})") \
            from None
    return out


def _bundle_sparse_files(bundle: str, mr: ObjectReader) -> list[str]:
    tables = _bundle_manifest(bundle, mr, "bundle")["embeddings"]
    return [os.path.join(bundle, "sparse", f"{name}.model") for name in tables]


def _deltas(mr: ObjectReader, base: str, folders: list) -> dict[str, Any]:
    """Checked delta bundle folders (absolute) and the dense files they bring: the delta
    models of one base, in training order, with the base's tables."""
    if not mr.has("bundle"):
        raise mr.error("deltas", 'needs "bundle": the base model the deltas apply to')
    base_bundle = os.path.join(base, mr.str("bundle"))
    base_manifest = _bundle_manifest(base_bundle, mr, "bundle")
    last_step = int(base_manifest.get("step", 0))
    out = []
    for i, folder in enumerate(folders):
        path = os.path.normpath(os.path.join(base, str(folder)))
        manifest = _bundle_manifest(path, mr, f"deltas[{i}]")
        where = f"deltas[{i}]"
        if manifest.get("kind") != "delta":
            raise mr.error(where, f"{path}: a {manifest.get('kind', 'full')} model, not a delta "
                           "model of streaming training")
        if list(manifest["embeddings"]) != list(base_manifest["embeddings"]):
            raise mr.error(where, f"{path}: tables {list(manifest['embeddings'])}, but the base "
                           f"has {list(base_manifest['embeddings'])}")
        step = int(manifest.get("step", 0))
        if step <= last_step:
            raise mr.error(where, f"{path}: trained to iter {step}, not after the model before "
                           f"it in the list (iter {last_step}): deltas go in training order, "
                           "after their base")
        last_step = step
        out.append(path)
    if not out:
        return {"delta_bundles": ()}
    return {"delta_bundles": tuple(out),
            "dense_model_file": os.path.join(out[-1], "dense.model"),
            "non_trainable_file": os.path.join(out[-1], "non_trainable.json")}


def load_ps_config(path: str | os.PathLike | dict) -> ParameterServerConfig:
    """Read a parameter-server JSON file (or an already-loaded dict).

    Example::

        ps = load_ps_config("configs/hps/ps_dlrm.json")
    """
    if isinstance(path, dict):
        return parse_ps_config(path)
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError("<file>", f"cannot read parameter-server config: {e.strerror}",
                          source) from e
    return parse_ps_config(json_from_text(text, source), source)
