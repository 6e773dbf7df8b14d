"""The lookup hierarchy behind the device cache: volatile database (hash map or Redis cluster),
then persistent database (RocksDB), then the table's default value (HugeCTR's HPS order).

One :class:`Databases` object serves every model of a parameter-server file; tables are named
``hps_et.<model>.<table>``. A volatile database that stops answering is skipped for
``backoff_s`` (lookups read RocksDB meanwhile) and then tried again, so a Redis outage costs
latency, never a failed request.

Example::

    dbs = Databases(ps.volatile_db, ps.persistent_db)
    values, layers = dbs.lookup("hps_et.dlrm.emb", keys, dim=16, default=0.0)
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from jctr.config import ConfigError
from jctr.config.hps import PersistentDatabaseParams, VolatileDatabaseParams
from jctr.stores.base import KeyValueStore, StoreUnavailable

log = logging.getLogger("jctr.serving")

LAYERS = ("device_cache", "volatile_db", "persistent_db", "default")


def open_volatile(params: VolatileDatabaseParams) -> KeyValueStore | None:
    if params.type == "disabled":
        return None
    if params.type == "redis_cluster":
        from jctr.stores.redis_cluster import RedisClusterStore

        return RedisClusterStore(params)
    from jctr.stores.hash_map import HashMapStore

    return HashMapStore(params)


def open_persistent(params: PersistentDatabaseParams) -> KeyValueStore | None:
    if params.type == "disabled":
        return None
    from jctr.stores.rocksdb import RocksDBStore

    return RocksDBStore(params)


class Databases:
    """The volatile and persistent databases of one parameter server, looked up in order."""

    def __init__(self, volatile: VolatileDatabaseParams, persistent: PersistentDatabaseParams,
                 *, backoff_s: float = 1.0):
        if volatile.type == "disabled" and persistent.type == "disabled":
            raise ConfigError("volatile_db.type", 'and persistent_db.type are both "disabled": '
                              "the embeddings would have nowhere to live")
        self.volatile_params = volatile
        self.persistent_params = persistent
        self.backoff_s = backoff_s
        self.volatile = open_volatile(volatile)
        try:
            self.persistent = open_persistent(persistent)
        except BaseException:
            if self.volatile is not None:
                self.volatile.close()
            raise
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.volatile_failures = 0

    # -- the volatile layer may be down -------------------------------------------------------
    def _volatile_up(self) -> bool:
        return self.volatile is not None and time.monotonic() >= self._down_until

    def _volatile_failed(self, e: StoreUnavailable) -> None:
        with self._lock:
            self.volatile_failures += 1
            if time.monotonic() >= self._down_until:
                log.warning("%s; reading the persistent database for %.1f s", e, self.backoff_s)
            self._down_until = time.monotonic() + self.backoff_s

    def lookup(self, table: str, keys: np.ndarray, dim: int, default: float
               ) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        """``(values [n, dim], found [n], per-layer counts)``: ``found`` is False where the
        default value was used."""
        n = keys.size
        values = np.zeros((n, dim), np.float32)
        found = np.zeros(n, bool)
        counts = {"volatile_db": 0, "persistent_db": 0}
        if self._volatile_up():
            try:
                v, f = self.volatile.lookup(table, keys, dim)
                values[f] = v[f]
                found = f
                counts["volatile_db"] = int(f.sum())
            except StoreUnavailable as e:
                self._volatile_failed(e)
        if self.persistent is not None and not found.all():
            miss = np.flatnonzero(~found)
            v, f = self.persistent.lookup(table, keys[miss], dim)
            hit = miss[f]
            values[hit] = v[f]
            found[hit] = True
            counts["persistent_db"] = int(hit.size)
            if (hit.size and self.volatile_params.cache_missed_embeddings
                    and self._volatile_up()):
                try:
                    self.volatile.insert(table, keys[hit], v[f])
                except StoreUnavailable as e:
                    self._volatile_failed(e)
        if default and not found.all():
            values[~found] = default
        return values, found, counts

    def load(self, table: str, keys: np.ndarray, values: np.ndarray, *,
             into_persistent: bool = True) -> dict[str, int]:
        """Write a table: every row into the persistent database (unless it is read-only), the
        first ``initial_cache_rate`` of the rows into the volatile one (all of them when there
        is no persistent database to fall back on). Returns rows written per layer."""
        written = {"volatile_db": 0, "persistent_db": 0}
        if (into_persistent and self.persistent is not None
                and not self.persistent_params.read_only):
            step = self.persistent_params.max_set_batch_size * 16
            for s in range(0, keys.size, step):
                self.persistent.insert(table, keys[s:s + step], values[s:s + step])
            written["persistent_db"] = int(keys.size)
        if self.volatile is not None:
            rate = self.volatile_params.initial_cache_rate if self.persistent else 1.0
            n = int(round(keys.size * rate))
            step = 1 << 18
            for s in range(0, n, step):
                e = min(n, s + step)
                self.volatile.insert(table, keys[s:e], values[s:e])
            written["volatile_db"] = n
        return written

    def close(self) -> None:
        for store in (self.volatile, self.persistent):
            if store is not None:
                store.close()
