"""The distributed volatile database: a Redis cluster (``redis_cluster``).

Each table is split into ``num_partitions`` partitions by key hash; partition ``i`` of table
``T`` is the Redis hash ``{T/p<i>}`` (field: the key's 8 little-endian bytes, value: the
float32 vector's bytes) beside the sorted set ``{T/p<i>}t`` of write (and, with
``refresh_time_after_fetch``, read) times; the braces make both live on the same cluster slot,
and different partitions spread over the nodes. Lookups are HMGETs of at most
``max_get_batch_size`` keys, writes HSETs of at most ``max_set_batch_size``, all of one call
sent as one cluster pipeline. A partition that grows past ``overflow_margin`` is cut to
``overflow_margin * overflow_resolution_target`` (oldest first, or random with HRANDFIELD).

Lookups send one pipeline per master, at the same time. A master that does not answer makes
the lookup raise :class:`PartialUnavailable` within the socket timeout, carrying what the other
masters answered: only that master's keys go to the next layer, and the master is skipped
(its keys failed at once) for ``NODE_BACKOFF_S`` before it is tried again. A cluster that does
not answer at all at start is :class:`StoreUnavailable` (a wrong password is a
:class:`StoreError`).

Example::

    store = RedisClusterStore(VolatileDatabaseParams(type="redis_cluster",
                                                     address="127.0.0.1:7000"))
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jctr.config.hps import VolatileDatabaseParams
from jctr.stores.base import (
    PartialUnavailable,
    StoreError,
    StoreUnavailable,
    as_keys,
    check_dim,
    encoded_rows,
    key_columns,
    no_rows,
    partition_of,
    put_found,
)

SOCKET_TIMEOUT_S = 1.0
NODE_BACKOFF_S = 1.0
TABLES_KEY = "hps_tables"


class _Packed:
    """Command arguments already in the Redis protocol: ``count`` bulk strings of fixed width
    laid out by numpy. redis-py packs arguments one Python object at a time, which costs more
    than the server's work for the 10,000-key HMGETs and HSETs of a lookup or a load."""

    __slots__ = ("payload", "count")

    def __init__(self, payload: bytes, count: int):
        self.payload = payload
        self.count = count

    def __repr__(self) -> str:  # error messages quote commands: no binary dumps
        return f"<{self.count} packed arguments>"


def _fixed_bulks(*columns: np.ndarray) -> _Packed:
    """Rows of equal-width byte columns ([n, w] uint8 each) as RESP bulk strings, the
    columns of one row one after the other (HMGET fields; HSET field, value pairs)."""
    n = columns[0].shape[0]
    parts = []
    for col in columns:
        head = f"${col.shape[1]}\r\n".encode()
        parts += [np.broadcast_to(np.frombuffer(head, np.uint8), (n, len(head))), col,
                  np.broadcast_to(np.frombuffer(b"\r\n", np.uint8), (n, 2))]
    return _Packed(np.concatenate(parts, axis=1).tobytes(), n * len(columns))


class _PackerWithPacked:
    """Wraps a connection's command packer: commands holding :class:`_Packed` arguments are
    laid out here, every other command by redis-py."""

    def __init__(self, inner):
        self.inner = inner

    def pack(self, *args):
        if not any(isinstance(a, _Packed) for a in args):
            return self.inner.pack(*args)
        count = sum(a.count if isinstance(a, _Packed) else 1 for a in args)
        out = [b"*%d\r\n" % count]
        for a in args:
            if isinstance(a, _Packed):
                out.append(a.payload)
            else:
                b = a if isinstance(a, bytes) else str(a).encode()
                out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        return [b"".join(out)]


def _connection_class(redis):
    class PackingConnection(redis.Connection):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._command_packer = _PackerWithPacked(self._command_packer)

    return PackingConnection


def _stamps(n: int) -> np.ndarray:
    """Now (seconds, fixed width) as n rows of ZADD scores."""
    stamp = np.frombuffer(f"{time.time():.6f}".encode(), np.uint8)
    return np.broadcast_to(stamp, (n, stamp.size))


class RedisClusterStore:
    """``redis_cluster`` volatile database (see the module docstring)."""

    name = "redis_cluster"

    def __init__(self, params: VolatileDatabaseParams, *,
                 socket_timeout: float = SOCKET_TIMEOUT_S):
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        self._redis = redis
        self.params = params
        self.num_partitions = params.partitions
        self._lock = threading.Lock()
        self._dims: dict[str, int] = {}
        # masters whose last answer was an error -> monotonic time to try them again; one
        # stays until it answers (not only while its backoff lasts, or health() would read
        # "up" between two retries)
        self._node_down: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="hps-redis")
        self.evicted = 0
        nodes = [ClusterNode(h, p) for h, p in params.nodes()]
        try:
            host, port = params.nodes()[0]
            # through a URL, RedisCluster builds each node's pool with connection_class
            self.client = RedisCluster(
                url=f"redis://{host}:{port}", startup_nodes=nodes,
                username=params.user_name or None,
                password=params.password or None, socket_timeout=socket_timeout,
                socket_connect_timeout=socket_timeout, require_full_coverage=False,
                retry=Retry(NoBackoff(), 1), connection_class=_connection_class(redis))
            self.client.ping()
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException,
                OSError) as e:
            self._pool.shutdown(wait=False)
            text = str(e)
            if (isinstance(e, redis.exceptions.AuthenticationError)
                    or "username-password" in text or "NOAUTH" in text):
                raise StoreError(f"volatile_db redis_cluster {params.address}: authentication "
                                 f"failed for user {params.user_name!r}: {text}") from None
            raise StoreUnavailable(f"volatile_db redis_cluster {params.address}: cannot reach "
                                   f"the cluster ({type(e).__name__}: {e})") from None

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _hkey(table: str, part: int) -> str:
        return "{" + f"{table}/p{part}" + "}"

    def _chunks(self, table: str, keys: np.ndarray, step: int):
        """(partition, Redis key of the partition, positions) in chunks of at most ``step``."""
        for part, pos in self._groups(keys):
            name = self._hkey(table, part)
            for s in range(0, pos.size, step):
                yield part, name, pos[s:s + step]

    def _groups(self, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(partition, positions) for the partitions that ``keys`` touch."""
        parts = partition_of(keys, self.num_partitions)
        order = np.argsort(parts, kind="stable")
        bounds = np.searchsorted(parts[order], np.arange(self.num_partitions + 1))
        return [(p, order[bounds[p]:bounds[p + 1]]) for p in range(self.num_partitions)
                if bounds[p + 1] > bounds[p]]

    def _run(self, what: str, fn, *args):
        try:
            return fn(*args)
        except (self._redis.exceptions.RedisError,
                self._redis.exceptions.RedisClusterException) as e:
            # the first line only: pipeline errors quote the (binary) command
            text = str(e).splitlines()[0][:120].encode("ascii", "replace").decode()
            raise StoreUnavailable(f"redis_cluster {self.params.address}: {what} failed "
                                   f"({type(e).__name__}: {text})") from None
        except OSError as e:
            raise StoreUnavailable(f"redis_cluster {self.params.address}: {what} failed "
                                   f"({e})") from None

    def _dim(self, table: str) -> int | None:
        if table not in self._dims:
            raw = self._run("reading table metadata", self.client.hget,
                            f"hps_meta.{table}", "dim")
            if raw is None:
                return None
            self._dims[table] = int(raw)
        return self._dims[table]

    def _check_dim(self, table: str, dim: int) -> None:
        check_dim("redis_cluster", table, self._dim(table), dim)

    # -- protocol -----------------------------------------------------------------------------
    def lookup(self, table: str, keys, dim: int) -> tuple[np.ndarray, np.ndarray]:
        keys, values, found = no_rows(keys, dim)
        if not keys.size:
            return values, found
        self._check_dim(table, dim)
        cols = key_columns(keys)
        step = self.params.max_get_batch_size
        per_node: dict = {}
        failed = np.zeros(keys.size, bool)
        now = time.monotonic()
        for _, name, chunk in self._chunks(table, keys, step):
            node = self._node_of(name)
            if node is None or self._node_down.get(node.name, 0.0) > now:
                failed[chunk] = True
                continue
            per_node.setdefault(node.name, (node, []))[1].append((name, chunk))
        errors = []
        jobs = [(node, work) for node, work in per_node.values()]
        results = (list(self._pool.map(lambda job: self._hmget(*job, cols), jobs))
                   if len(jobs) > 1 else [self._hmget(*job, cols) for job in jobs])
        for (node, work), (replies, error) in zip(jobs, results):
            if error is not None:
                errors.append(error)
                self._node_down[node.name] = time.monotonic() + NODE_BACKOFF_S
                for _, chunk in work:
                    failed[chunk] = True
                continue
            self._node_down.pop(node.name, None)
            for (_, chunk), got in zip(work, replies):
                put_found(values, found, chunk, got)
        if self.params.refresh_time_after_fetch and found.any():
            try:
                self._touch(table, keys[found])
            except StoreUnavailable:
                pass  # an eviction-order hint; the values stand
        if failed.all():
            raise StoreUnavailable(f"redis_cluster {self.params.address}: lookup failed "
                                   f"({errors[0] if errors else 'no master answers'})")
        if failed.any():
            raise PartialUnavailable(
                f"redis_cluster {self.params.address}: {int(failed.sum())} of {keys.size} "
                f"keys unanswered ({errors[0] if errors else 'their master is down'})",
                values, found, failed)
        return values, found

    def down_nodes(self) -> list[str]:
        """Masters that failed to answer and have not answered since: one whose backoff
        (``NODE_BACKOFF_S``) is over is asked (a PING) now, so the answer does not flap to
        "up" between two lookups' retries, nor stay "down" where no lookup goes to it (its
        tables down for lost rows)."""
        now = time.monotonic()
        # (a copy: lookups of other threads change it)
        for name, retry_at in sorted(self._node_down.copy().items()):
            if retry_at > now:
                continue
            if self._answers(name):
                self._node_down.pop(name, None)
            else:
                self._node_down[name] = time.monotonic() + NODE_BACKOFF_S
        return sorted(self._node_down.copy())

    def _answers(self, name: str) -> bool:
        try:
            node = self.client.get_node(node_name=name)
            return node is not None and bool(self.client.get_redis_connection(node).ping())
        except (self._redis.exceptions.RedisError, OSError):
            return False

    def _node_of(self, name: str):
        """The master serving Redis key ``name`` (None: its slot has none)."""
        try:
            return self.client.nodes_manager.get_node_from_slot(self.client.keyslot(name))
        except (self._redis.exceptions.RedisError,
                self._redis.exceptions.RedisClusterException):
            return None

    def _hmget(self, node, work, cols) -> tuple[list | None, str | None]:
        """One master's HMGETs as one pipeline: (replies, None) or (None, the error)."""
        try:
            pipe = self.client.get_redis_connection(node).pipeline(transaction=False)
            for name, chunk in work:
                pipe.execute_command("HMGET", name, _fixed_bulks(cols[chunk]))
            return pipe.execute(), None
        except (self._redis.exceptions.RedisError, OSError) as e:
            text = str(e).splitlines()[0][:120].encode("ascii", "replace").decode()
            return None, f"{node.name}: {type(e).__name__}: {text}"

    def _touch(self, table: str, keys: np.ndarray) -> None:
        cols = key_columns(keys)
        stamps = _stamps(keys.size)
        pipe = self.client.pipeline(transaction=False)
        for part, pos in self._groups(keys):
            pipe.execute_command("ZADD", self._hkey(table, part) + "t", "XX",
                                 _fixed_bulks(stamps[:pos.size], cols[pos]))
        self._run("refreshing access times", pipe.execute)

    def insert(self, table: str, keys, values) -> None:
        keys, cols, vcols = encoded_rows(keys, values)
        if not keys.size:
            return
        dim = vcols.shape[1] // 4
        with self._lock:
            self._check_dim(table, dim)
            if self._dim(table) is None:
                def register():
                    self.client.hset(f"hps_meta.{table}", "dim", dim)
                    self.client.sadd(TABLES_KEY, table)
                self._run("creating a table", register)
                self._dims[table] = dim
            stamps = _stamps(keys.size)
            step = self.params.max_set_batch_size
            pipe = self.client.pipeline(transaction=False)
            touched = set()
            for part, name, chunk in self._chunks(table, keys, step):
                pipe.execute_command("HSET", name, _fixed_bulks(cols[chunk], vcols[chunk]))
                pipe.execute_command("ZADD", name + "t",
                                     _fixed_bulks(stamps[:chunk.size], cols[chunk]))
                touched.add(part)
            self._run("insert", pipe.execute)
            if self.params.overflow_margin < 2 ** 63:
                self._resolve_overflow(table, sorted(touched))

    def _resolve_overflow(self, table: str, parts: list[int]) -> None:
        margin = self.params.overflow_margin
        pipe = self.client.pipeline(transaction=False)
        for part in parts:
            pipe.hlen(self._hkey(table, part))
        sizes = self._run("overflow check", pipe.execute)
        target = int(margin * self.params.overflow_resolution_target)
        for part, n in zip(parts, sizes):
            if n <= margin:
                continue
            name = self._hkey(table, part)
            count = n - target
            if self.params.overflow_policy == "evict_oldest":
                victims = self._run("eviction", self.client.zrange, name + "t", 0, count - 1)
            else:
                victims = self._run("eviction", self.client.hrandfield, name, count)
            if victims:
                self._run("eviction", self._drop, name, victims)
                self.evicted += len(victims)

    def _drop(self, name: str, members: list[bytes]) -> None:
        step = self.params.max_set_batch_size
        for s in range(0, len(members), step):
            self.client.hdel(name, *members[s:s + step])
            self.client.zrem(name + "t", *members[s:s + step])

    def erase(self, table: str, keys) -> None:
        keys = as_keys(keys)
        if not keys.size:
            return
        cols = key_columns(keys)
        pipe = self.client.pipeline(transaction=False)
        for part, pos in self._groups(keys):
            name = self._hkey(table, part)
            pipe.execute_command("HDEL", name, _fixed_bulks(cols[pos]))
            pipe.execute_command("ZREM", name + "t", _fixed_bulks(cols[pos]))
        self._run("erase", pipe.execute)

    def partition_sizes(self, table: str) -> np.ndarray:
        pipe = self.client.pipeline(transaction=False)
        for part in range(self.num_partitions):
            pipe.hlen(self._hkey(table, part))
        return np.asarray(self._run("size", pipe.execute), np.int64)

    def size(self, table: str) -> int:
        return int(self.partition_sizes(table).sum())

    def tables(self) -> list[str]:
        return sorted(t.decode() for t in self._run("listing tables", self.client.smembers,
                                                     TABLES_KEY))

    def items(self, table: str, chunk: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        dim = self._dim(table)
        if dim is None:
            return
        for part in range(self.num_partitions):
            name = self._hkey(table, part)
            ks: list[bytes] = []
            vs: list[bytes] = []
            for k, v in self._run("scan", lambda n: list(self.client.hscan_iter(n)), name):
                ks.append(k)
                vs.append(v)
            if ks:
                keys = np.frombuffer(b"".join(ks), "<i8").astype(np.int64)
                values = np.frombuffer(b"".join(vs), np.float32).reshape(-1, dim).copy()
                for s in range(0, keys.size, chunk):
                    yield keys[s:s + chunk], values[s:s + chunk]

    def get_meta(self, table: str) -> dict | None:
        raw = self._run("reading table metadata", self.client.hget, f"hps_meta.{table}",
                        "manifest")
        try:
            meta = None if raw is None else json.loads(raw)
        except ValueError:
            return None
        return meta if isinstance(meta, dict) else None

    def set_meta(self, table: str, meta: dict | None) -> None:
        """The table's manifest (None: remove it). Each partition gets a marker key on its own
        master with it, so that a master that comes back empty is noticed (:meth:`lost`)."""
        key = f"hps_meta.{table}"
        if meta is None:
            self._run("writing table metadata", self.client.hdel, key, "manifest", "markers")
            return

        def run():
            pipe = self.client.pipeline(transaction=False)
            for part in range(self.num_partitions):
                pipe.set(self._hkey(table, part) + "m", b"1")
            pipe.execute()
            self.client.hset(key, mapping={"manifest": json.dumps(meta, sort_keys=True),
                                           "markers": str(self.num_partitions)})
        self._run("writing table metadata", run)

    def lost(self, table: str) -> str | None:
        """Why ``table`` lost rows since it was loaded (its metadata, or partitions whose
        master came back empty), or None. Tables loaded before markers existed: None."""
        def run():
            meta = self.client.hmget(f"hps_meta.{table}", "manifest", "markers")
            if meta[0] is None:
                return "its metadata is gone (a master came back empty)"
            if meta[1] is None:
                return None
            pipe = self.client.pipeline(transaction=False)
            for part in range(self.num_partitions):
                pipe.exists(self._hkey(table, part) + "m")
            gone = [p for p, ok in enumerate(pipe.execute()) if not ok]
            return (f"partition(s) {', '.join(map(str, gone))} are empty (a master came back "
                    "without its data)") if gone else None
        return self._run("checking the table", run)

    def drop_table(self, table: str) -> None:
        """Delete every partition of ``table`` and its metadata (``load`` replaces a table)."""
        def run():
            self.client.delete(f"hps_meta.{table}")  # first: a half-dropped table is no table
            for part in range(self.num_partitions):
                name = self._hkey(table, part)
                # UNLINK frees big hashes in the background: the server keeps answering
                self.client.unlink(name)
                self.client.unlink(name + "t")
                self.client.unlink(name + "m")
            self.client.srem(TABLES_KEY, table)
        self._run("drop table", run)
        self._dims.pop(table, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        try:
            self.client.close()
        except Exception:  # closing a client of a dead cluster must not mask the real error
            pass
