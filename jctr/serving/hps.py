"""The lookup hierarchy behind the device cache: volatile database (hash map or Redis cluster),
then persistent database (RocksDB), then the table's default value (HugeCTR's HPS order).

One :class:`Databases` object serves every model of a parameter-server file; tables are named
``hps_et.<model>.<table>``. The default value answers only keys that no layer holds: a key the
persistent database (which holds every row of a table) does not have, or, without one, a key
the volatile database does not have. When a layer that may hold a key does not answer (Redis
down, one Redis master down) and no complete layer below answered for it, the lookup raises
:class:`LayerUnavailable` (the server answers 503 naming the layer) instead of a default. A
volatile database that stops answering is skipped for ``backoff_s`` and then tried again; one
that cannot be reached when serving starts is tried again in the background.

Example::

    dbs = Databases(ps.volatile_db, ps.persistent_db)
    values, found, counts = dbs.lookup("hps_et.dlrm.emb", keys, dim=16, default=0.0)
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from jctr.config import ConfigError
from jctr.config.hps import PersistentDatabaseParams, VolatileDatabaseParams
from jctr.ops.host_sort import isin, unique
from jctr.serving.table_manifest import incomplete, links_held, mismatch
from jctr.stores.base import KeyValueStore, PartialUnavailable, StoreError, StoreUnavailable

log = logging.getLogger("jctr.serving")

LAYERS = ("device_cache", "volatile_db", "persistent_db", "default")
# the update applier's consumers (jctr.serving.updates): each writes a table under a lock of
# its own, and a model taking new files pauses them all for that table
UPDATE_SIDES = ("all", "serving", "lasting")
# the most bytes of online updates a layer's table keeps while its next chain is written
JOURNAL_BYTES = 256 << 20


class UpdateJournal:
    """The online updates written to one layer's table (``device_cache``: the cache's rows)
    while a model's next files are written into it: written again over them once they are
    in, so that the new files never put back rows older than what the stream delivered.
    Updates of the files' step or before (``after``: -1 where unknown) are the files' already
    (or older) and are not kept; past ``limit`` bytes the rest are counted, not kept.

    Example::

        kept = UpdateJournal(after=24)      # files of step 24 being taken
        kept.add(keys, rows, step=30)       # kept: newer than the files
        kept.add(keys, None, step=20)       # not: the files hold step 20's rows or newer
    """

    def __init__(self, after: int, limit: int = JOURNAL_BYTES):
        self.after, self.limit = after, limit
        self.parts: list[tuple[np.ndarray, np.ndarray | None]] = []  # values None: erased
        self.bytes = 0
        self.rows = 0
        self.dropped = 0

    def add(self, keys: np.ndarray, values: np.ndarray | None, step: int) -> None:
        if step <= self.after or not keys.size:
            return
        size = keys.nbytes + (0 if values is None else values.nbytes)
        if self.bytes + size > self.limit:
            self.dropped += int(keys.size)
            return
        self.parts.append((keys, values))
        self.bytes += size
        self.rows += int(keys.size)


class LayerUnavailable(StoreUnavailable):
    """Keys that only a layer which did not answer could give (HTTP 503 naming ``layer``)."""

    def __init__(self, layer: str, message: str):
        super().__init__(f"{layer}: {message}")
        self.layer = layer


class TableMismatch(StoreError):
    """A database holds another export of a table, or an incomplete one."""


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


_DENSE_ROW = 1024  # floats per stored row of dense weights
STAGED_SUFFIX = "~next"  # the table a new base is written into before it is swapped in
_WRITE_ROWS = 1 << 18  # rows one insert call takes (a load, a delta, an update)
# a table's rows for a load: called once per pass over them, (keys, values) parts in order
RowParts = Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]]

class Databases:
    """The volatile and persistent databases of one parameter server, looked up in order.
    ``volatile_may_be_down``: a volatile database that cannot be reached is tried again in the
    background instead of failing here (``serve`` allows it when the persistent database
    holds every row)."""

    def __init__(self, volatile: VolatileDatabaseParams, persistent: PersistentDatabaseParams,
                 *, backoff_s: float = 1.0, volatile_may_be_down: bool = False):
        if volatile.type == "disabled" and persistent.type == "disabled":
            raise ConfigError("volatile_db.type", 'and persistent_db.type are both "disabled": '
                              "the embeddings would have nowhere to live")
        self.volatile_params = volatile
        self.persistent_params = persistent
        self.backoff_s = backoff_s
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._down_until = 0.0
        self._warned_until = 0.0
        self.volatile_failures = 0
        self.write_back_failures = 0  # missed rows not cached (cache_missed_embeddings)
        self._lost: dict[str, str] = {}  # table -> why the volatile layer lost its rows
        self._lost_checked = 0.0
        self.volatile_error: str | None = None  # why the volatile database is down now
        self.expected: dict[str, dict] = {}  # table -> manifest the served model needs
        self._volatile_skip: set[str] = set()  # tables the volatile db holds for another export
        # (table, update side) -> the lock the side writes under; (layer, table) -> the
        # updates kept while a model's next files are written (begin_journal)
        self._update_locks: dict[tuple[str, str], threading.RLock] = {}
        self._journals: dict[tuple[str, str], UpdateJournal] = {}
        self._reviver: threading.Thread | None = None
        self._update_filters = {layer: [re.compile(f) for f in params.update_filters]
                                for layer, params in (("volatile_db", volatile),
                                                      ("persistent_db", persistent))}
        try:
            self.volatile = open_volatile(volatile)
        except StoreUnavailable as e:
            if not volatile_may_be_down:
                raise
            self.volatile = None
            self.volatile_error = str(e)
        try:
            self.persistent = open_persistent(persistent)
        except BaseException:
            if self.volatile is not None:
                self.volatile.close()
            raise

    @property
    def volatile_configured(self) -> bool:
        return self.volatile_params.type != "disabled"

    # -- the volatile layer may be down -------------------------------------------------------
    def _volatile_up(self) -> bool:
        return self.volatile is not None and time.monotonic() >= self._down_until

    def _write_back_failed(self, e: StoreUnavailable) -> None:
        """A missed row could not be cached in the volatile layer (one Redis master down,
        say): counted and logged, the layer stays up for the keys it can answer."""
        with self._lock:
            self.write_back_failures += 1
            now = time.monotonic()
            if now >= self._warned_until:
                log.warning("volatile_db: caching missed rows failed (%s); lookups go on", e)
                self._warned_until = now + self.backoff_s

    def _volatile_failed(self, e: StoreUnavailable) -> None:
        with self._lock:
            self.volatile_failures += 1
            self.volatile_error = str(e)
            now = time.monotonic()
            if now >= self._warned_until:  # once per backoff period, not per lookup
                log.warning("%s; its keys go to the next layer", e)
                self._warned_until = now + self.backoff_s
            if not isinstance(e, PartialUnavailable):
                self._down_until = now + self.backoff_s

    def start_reviving(self) -> None:
        """Try to reach a volatile database that was down at start every ``backoff_s``; once
        it answers, its tables are checked against :attr:`expected` before use."""
        if self.volatile is not None or not self.volatile_configured or self._reviver:
            return

        def run():
            while not self._closed.wait(self.backoff_s):
                try:
                    store = open_volatile(self.volatile_params)
                except StoreUnavailable as e:
                    self.volatile_error = str(e)
                    continue
                try:
                    self._check_volatile_tables(store)
                except StoreUnavailable as e:  # gone again while checking
                    self.volatile_error = str(e)
                    store.close()
                    continue
                self.volatile, self.volatile_error = store, None
                log.warning("volatile_db %s answers again", self.volatile_params.type)
                return

        self._reviver = threading.Thread(target=run, name="hps-volatile-revive", daemon=True)
        self._reviver.start()

    def _check_volatile_tables(self, store: KeyValueStore) -> None:
        """Tables a volatile database that came back holds for another export are not read."""
        for table, expected in self.expected.items():
            meta = store.get_meta(table)
            if meta is None and table not in store.tables():
                store.set_meta(table, expected)  # empty: rows written from now are this export's
                continue
            why = mismatch(meta, expected)
            if why:
                self._volatile_skip.add(table)
                log.error("volatile_db table %s %s; reading the persistent database for it",
                          table, why)

    def _check_lost(self, every_s: float | None = None) -> None:
        """Without a persistent database below it, a volatile table that lost rows since it
        was loaded (a Redis master came back empty) would answer defaults for them: such a
        table is down until ``python -m jctr.serve load`` fills it again (checked once per
        backoff period, or ``every_s``)."""
        now = time.monotonic()
        every_s = self.backoff_s if every_s is None else every_s
        if (self.persistent is not None or not hasattr(self.volatile, "lost")
                or now < self._lost_checked + every_s or not self._volatile_up()):
            return
        self._lost_checked = now
        try:
            lost = {t: why for t in self.expected if (why := self.volatile.lost(t))}
        except StoreUnavailable:
            return  # a master down: the lookups say so
        for table, why in lost.items():
            if table not in self._lost:
                log.error("volatile_db table %s lost rows: %s; it is down until `python -m "
                          "jctr.serve load` fills it again", table, why)
        self._lost = lost

    def health(self) -> dict[str, str]:
        """Per configured layer: "up", or "down: <why>"."""
        out = {}
        if self.volatile_configured:
            self._check_lost()
            down = self.volatile is None or time.monotonic() < self._down_until
            nodes = getattr(self.volatile, "down_nodes", lambda: [])()
            lost = "; ".join(f"table {t} lost rows ({why}): run `python -m jctr.serve load`"
                             for t, why in sorted(self._lost.items()))
            out["volatile_db"] = (f"down: {self.volatile_error}" if down else
                                  f"down: masters {', '.join(nodes)}" if nodes else
                                  f"down: {lost}" if lost else "up")
        if self.persistent is not None:
            out["persistent_db"] = "up"
        return out

    def ready(self) -> bool:
        """Every key can be answered: each configured layer is up, or a persistent database
        (which holds every row) is."""
        return self.persistent is not None or all(v == "up" for v in self.health().values())

    def lookup(self, table: str, keys: np.ndarray, dim: int, default: float
               ) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        """``(values [n, dim], found [n], per-layer counts)``: ``found`` is False where the
        default value was used. Raises :class:`LayerUnavailable` for keys only a layer that
        did not answer could hold."""
        n = keys.size
        values = np.zeros((n, dim), np.float32)
        found = np.zeros(n, bool)
        unanswered = np.zeros(n, bool)  # keys a volatile layer that failed may hold
        counts = {"volatile_db": 0, "persistent_db": 0}
        self._check_lost()
        if self.volatile_configured:
            if self._volatile_up() and table not in self._volatile_skip \
                    and table not in self._lost:
                try:
                    v, f = self.volatile.lookup(table, keys, dim)
                except PartialUnavailable as e:
                    v, f = e.values, e.found
                    unanswered |= e.failed
                    self._volatile_failed(e)
                except StoreUnavailable as e:
                    v, f = None, None
                    unanswered[:] = True
                    self._volatile_failed(e)
                if v is not None:
                    values[f] = v[f]
                    found |= f
                    counts["volatile_db"] = int(f.sum())
            else:
                unanswered[:] = True
        if self.persistent is not None and not found.all():
            miss = np.flatnonzero(~found)
            try:
                v, f = self.persistent.lookup(table, keys[miss], dim)
            except StoreUnavailable as e:
                raise LayerUnavailable("persistent_db", str(e)) from None
            hit = miss[f]
            values[hit] = v[f]
            found[hit] = True
            unanswered[:] = False  # it holds every row: what it lacks, no layer has
            counts["persistent_db"] = int(hit.size)
            if (hit.size and self.volatile_params.cache_missed_embeddings
                    and self._volatile_up() and table not in self._volatile_skip):
                try:
                    self.volatile.insert(table, keys[hit], v[f])
                except StoreUnavailable as e:  # lookups decide whether the layer is down
                    self._write_back_failed(e)
        if self.persistent is None and not found.all() and table not in self._lost:
            self._check_lost(every_s=0.05)  # keys missing: rows lost, or keys never trained?
            if table in self._lost:
                unanswered |= ~found
        if unanswered.any() and table in self._lost:
            raise LayerUnavailable(
                "volatile_db", f"{table} lost rows since it was loaded ({self._lost[table]}): "
                "run `python -m jctr.serve load` to fill it again")
        if unanswered.any():
            raise LayerUnavailable(
                "volatile_db", f"{int(unanswered.sum())} of {n} keys of {table} are held only "
                f"by the {self.volatile_params.type} database, which does not answer "
                f"({self.volatile_error or 'down'})")
        if default and not found.all():
            values[~found] = default
        return values, found, counts

    def store(self, layer: str) -> KeyValueStore | None:
        """``layer``'s database ("volatile_db" / "persistent_db"; None: none, or down)."""
        return self.volatile if layer == "volatile_db" else self.persistent

    def _up(self, layer: str) -> KeyValueStore:
        """:meth:`store`, or :class:`StoreUnavailable` where there is none (a volatile
        database down)."""
        store = self.store(layer)
        if store is None:
            raise StoreUnavailable(f"{layer} down: {self.volatile_error}")
        return store

    # -- loading --------------------------------------------------------------------------------
    def check_table(self, layer: str, table: str, expected: dict) -> str:
        """What ``layer`` holds of ``table``: "match", "absent", "down" (not reachable), or
        raises :class:`TableMismatch` naming the table and both exports."""
        store = self.store(layer)
        if store is None:
            return "down" if layer == "volatile_db" and self.volatile_configured else "absent"
        meta = store.get_meta(table)
        if meta is None and table not in store.tables():
            return "absent"
        why = mismatch(meta, expected)
        if why is None:
            return "match"
        kind = (self.volatile_params.type if layer == "volatile_db"
                else self.persistent_params.type)
        raise TableMismatch(f"{layer} ({kind}) table {table} {why}; run `python -m jctr.serve "
                            "load --config <file>` to load this export into it")

    def load(self, table: str, links: Sequence[RowParts], manifest: dict, *,
             into_persistent: bool = True, into_volatile: bool = True,
             rows: int | None = None,
             progress: Callable[[str, int], None] | None = None) -> dict[str, int]:
        """Replace a table with the rows of ``links`` (a base and its deltas, each read a part
        at a time, a later row of a key winning): every row into the persistent database
        (unless it is read-only); into the volatile one the first ``initial_cache_rate`` of
        the base's rows (``manifest["rows"]``) and every later link's (all rows when there is
        no persistent database to fall back on). In each layer the old table and its manifest
        go first and the new manifest is written last, so a load stopped half way leaves a
        table that ``serve`` refuses. ``rows``: what the links hold in all (a volatile
        database in this process makes room for its share at once). ``progress(layer,
        rows)``: called after each part written. Returns rows written per layer."""
        written = {"volatile_db": 0, "persistent_db": 0}
        progress = progress or (lambda layer, rows: None)
        if (into_persistent and self.persistent is not None
                and not self.persistent_params.read_only):
            self.persistent.drop_table(table)
            step = self.persistent_params.max_set_batch_size * 16
            for read in links:
                for keys, values in read():
                    for s in range(0, keys.size, step):
                        self.persistent.insert(table, keys[s:s + step], values[s:s + step])
                    written["persistent_db"] += int(keys.size)
                    progress("persistent_db", int(keys.size))
            self.persistent.set_meta(table, manifest)
        if into_volatile and self.volatile is not None:
            base = int(manifest["rows"])
            first = self.volatile_share(base, 0)
            first = None if first == base else first  # None: the base's every row
            self.volatile.drop_table(table)
            reserve = getattr(self.volatile, "reserve", None)
            if reserve is not None and rows is not None:
                reserve(table, self.volatile_share(base, max(rows - base, 0)),
                        int(manifest["dim"]))
            for j, read in enumerate(links):
                left = first if j == 0 else None  # the base's first rows only
                if left == 0:
                    continue
                for keys, values in read():
                    if left is not None:
                        keys, values = keys[:left], values[:left]
                        left -= keys.size
                    for s in range(0, keys.size, _WRITE_ROWS):
                        self.volatile.insert(table, keys[s:s + _WRITE_ROWS],
                                             values[s:s + _WRITE_ROWS])
                    written["volatile_db"] += int(keys.size)
                    progress("volatile_db", int(keys.size))
                    if left == 0:
                        break
            self.volatile.set_meta(table, manifest)
            self._volatile_skip.discard(table)
        return written

    def volatile_share(self, base_rows: int, delta_rows: int) -> int:
        """Rows a load writes into the volatile database of a table of ``base_rows`` rows and
        deltas of ``delta_rows``: ``initial_cache_rate`` of the base's and every delta row
        (every row when there is no persistent database to fall back on)."""
        if self.persistent is None:
            return base_rows + delta_rows
        return int(round(base_rows * self.volatile_params.initial_cache_rate)) + delta_rows

    def stored_manifests(self, table: str) -> list[dict]:
        """The manifests of ``table`` the layers up now hold (to take their files' digests)."""
        out = []
        for store in (self.persistent, self.volatile):
            try:
                meta = store.get_meta(table) if store is not None else None
            except StoreError:
                meta = None  # a layer down says so where it is checked
            if meta:
                out.append(meta)
        return out

    def refresh_manifest(self, layer: str, table: str, expected: dict) -> None:
        """A layer holding ``expected``'s export keeps its files' record as this start took
        it (new times after a copy; digests a later start can take without hashing)."""
        store = self.store(layer)
        if store is None or (store is self.persistent and self.persistent_params.read_only):
            return
        meta = store.get_meta(table)
        if meta and mismatch(meta, expected) is None and meta.get("files") != expected["files"]:
            store.set_meta(table, {**meta, "files": expected["files"]})

    def links_held(self, layer: str, table: str, expected: dict) -> int | None:
        """How many first links of ``expected``'s base + delta chain ``layer`` holds of
        ``table`` when it holds fewer than all (see
        :func:`jctr.serving.table_manifest.links_held`); else None."""
        store = self.store(layer)
        return None if store is None else links_held(store.get_meta(table), expected)

    def update_layers(self, table: str) -> list[str]:
        """The layers that take online updates of ``table``: those whose ``update_filters``
        match it (not a read-only persistent database)."""
        out = []
        if (self.persistent is not None and not self.persistent_params.read_only
                and any(f.search(table) for f in self._update_filters["persistent_db"])):
            out.append("persistent_db")
        if self.volatile_configured and any(f.search(table)
                                            for f in self._update_filters["volatile_db"]):
            out.append("volatile_db")
        return out

    def write_rows(self, layer: str, table: str, keys: np.ndarray, values: np.ndarray,
                   manifest: dict | None = None, *, pause: Callable[[], None] | None = None
                   ) -> int:
        """Write rows over ``layer``'s table (kept rows stay): an online update's (rows only;
        see :meth:`write_links` for a delta bundle's). ``pause``: called between the
        persistent database's write batches (:meth:`jctr.stores.rocksdb.RocksDBStore.
        insert`). A volatile database that is down raises :class:`StoreUnavailable`.
        Returns rows written."""
        return self.write_links(layer, table, [lambda: ((keys, values),)], manifest,
                                pause=pause)

    def write_links(self, layer: str, table: str, links: Sequence[RowParts],
                    manifest: dict | None = None, *, pause: Callable[[], None] | None = None,
                    progress: Callable[[str, int], None] | None = None) -> int:
        """:meth:`write_rows` of every part of ``links`` in order: delta bundles' rows over a
        table holding the chain's first links, with their ``manifest`` (the table is marked
        incomplete until every row is in); ``progress`` as :meth:`load`'s."""
        store = self._up(layer)
        if manifest is not None:
            store.set_meta(table, incomplete(store.get_meta(table) or {}))
        step = _WRITE_ROWS
        between = {"pause": pause} if pause is not None and store is self.persistent else {}
        written = 0
        for read in links:
            for keys, values in read():
                for s in range(0, keys.size, step):
                    if between and written + s:
                        pause()
                    store.insert(table, keys[s:s + step], values[s:s + step], **between)
                written += int(keys.size)
                if progress is not None:
                    progress(layer, int(keys.size))
        if manifest is not None:
            store.set_meta(table, manifest)
            if layer == "volatile_db":
                self._volatile_skip.discard(table)
        return written

    def switch_links(self, layer: str, table: str, links: Sequence[RowParts], manifest: dict,
                     chain_keys: Callable[[], np.ndarray], *, held_only: bool = False,
                     progress: Callable[[str, int], None] | None = None,
                     swap_now: bool = True) -> int:
        """``layer``'s table made the chain of ``links`` (another base and its deltas) while it
        serves (``held_only``: only the rows of keys it holds, for a volatile database holding
        a share). Where the database swaps tables (RocksDB, a hash map) the chain is written
        into a table of its own, with ``manifest``, and swapped in at once: requests read the
        old chain whole until then, the new one whole after (online updates applied meanwhile
        go with the old, unless kept: :meth:`begin_journal`). Elsewhere (Redis) the table is
        marked incomplete, the rows written over it, the keys not in ``chain_keys()``
        (sorted: every key of the chain) erased, then ``manifest`` written; requests
        meanwhile read old and new rows.
        ``swap_now`` False: the next table is left to :meth:`swap_staged` (a model's layers
        all written first, then swapped in one after the other). Returns rows written."""
        store = self._up(layer)
        if held_only:
            dim = int(manifest["dim"])
            if callable(getattr(store, "table_keys", None)):
                # an in-process hash map: its keys sorted once, then each part's tested
                # against them (a model file's parts come sorted: 20M keys against a share
                # of 2M, 0.6 s where looking each up took 3.1-3.6 s, docs/performance.md)
                held_keys = unique(store.table_keys(table))

                def among(keys: np.ndarray) -> np.ndarray:
                    return isin(keys, held_keys, test_sorted=True)
            else:
                def among(keys: np.ndarray) -> np.ndarray:
                    return store.lookup(table, keys, dim)[1]

            def held(read: RowParts) -> RowParts:
                def parts():
                    for keys, values in read():
                        found = among(keys)
                        yield keys[found], values[found]
                return parts

            links = [held(read) for read in links]
        if self.can_swap(layer):
            written = self.write_staged(layer, table, links, manifest, progress=progress)
            if swap_now:
                self.swap_staged(layer, table, manifest)
            return written
        store.set_meta(table, incomplete(store.get_meta(table) or {}))
        written = self.write_links(layer, table, links, progress=progress)
        held_keys = chain_keys()
        stale = [keys[~isin(keys, held_keys, test_sorted=True)]
                 for keys, _ in store.items(table)]
        self.erase_rows(layer, table, np.concatenate(stale) if stale else
                        np.zeros(0, np.int64))
        store.set_meta(table, manifest)
        if layer == "volatile_db":
            self._volatile_skip.discard(table)
        return written

    def can_swap(self, layer: str) -> bool:
        """Whether ``layer``'s database swaps a table in at once (RocksDB, a hash map)."""
        store = self.store(layer)
        return store is not None and callable(getattr(store, "swap_tables", None))

    def write_staged(self, layer: str, table: str, links: Sequence[RowParts], manifest: dict,
                     *, progress: Callable[[str, int], None] | None = None) -> int:
        """The first half of :meth:`switch_links` where ``layer`` swaps tables: the chain
        written into ``table``'s next table, with ``manifest`` (a next table a stopped switch
        left dropped first). Returns rows written."""
        self.drop_staged(table, layers=(layer,))
        return self.write_links(layer, table + STAGED_SUFFIX, links, manifest,
                                progress=progress)

    def swap_staged(self, layer: str, table: str, manifest: dict) -> None:
        """The second half: ``table``'s next table swapped in at once, the old one dropped
        (a next table of no row: the table dropped, ``manifest`` kept)."""
        store = self.store(layer)
        staged = table + STAGED_SUFFIX
        if staged in store.tables():
            store.swap_tables(table, staged)
        else:  # no row (a share of none): the table goes
            store.drop_table(table)
            store.set_meta(table, manifest)
        store.drop_table(staged)
        if layer == "volatile_db":
            self._volatile_skip.discard(table)

    def drop_staged(self, table: str, layers: Sequence[str] = ("persistent_db", "volatile_db")
                    ) -> list[str]:
        """Drop ``table``'s next chain a switch stopped before it was swapped in (a process
        killed while :meth:`switch_links` wrote it) from each of ``layers`` it is left in;
        returns those layers."""
        dropped = []
        for layer in layers:
            store = self.store(layer)
            if not self.can_swap(layer) or (
                    layer == "persistent_db" and self.persistent_params.read_only):
                continue
            staged = table + STAGED_SUFFIX
            if staged in store.tables() or store.get_meta(staged) is not None:
                store.drop_table(staged)
                dropped.append(layer)
        return dropped

    # -- online updates while a model takes new files -----------------------------------------
    def update_lock(self, table: str, side: str) -> threading.RLock:
        """The lock update side ``side`` writes ``table``'s layers under (with
        :meth:`journal`): held by :meth:`updates_paused`."""
        key = (table, side)
        lock = self._update_locks.get(key)
        if lock is None:
            with self._lock:
                lock = self._update_locks.setdefault(key, threading.RLock())
        return lock

    @contextlib.contextmanager
    def updates_paused(self, table: str) -> Iterator[None]:
        """No online update writes ``table`` meanwhile (every side's lock held, in order)."""
        locks = [self.update_lock(table, side) for side in UPDATE_SIDES]
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            yield

    def begin_journal(self, table: str, layers: Sequence[str], after: int) -> None:
        """From now on the online updates written to ``table`` in each of ``layers`` (with
        ``device_cache``: the cache's) after step ``after`` are kept (:class:`UpdateJournal`)
        until :meth:`end_journal`."""
        with self.updates_paused(table):  # no write half recorded
            for layer in layers:
                self._journals[(layer, table)] = UpdateJournal(after)

    def journal(self, layer: str, table: str, parts: Iterable[tuple]) -> None:
        """An update side wrote ``parts`` ([(keys, values or None for erased, step)]) to
        ``layer``'s ``table`` (under its :meth:`update_lock`): kept where a journal is on."""
        kept = self._journals.get((layer, table))
        if kept is not None:
            for keys, values, step in parts:
                kept.add(keys, values, step)

    def end_journal(self, layer: str, table: str) -> UpdateJournal | None:
        """What was kept for ``layer``'s ``table`` since :meth:`begin_journal`; no longer kept."""
        return self._journals.pop((layer, table), None)

    def replay_journal(self, layer: str, table: str, kept: UpdateJournal) -> int:
        """The kept updates written again into ``layer``'s ``table`` (a next table too), in
        their order; returns the rows written."""
        for keys, values in kept.parts:
            if values is None:
                self.erase_rows(layer, table, keys)
            else:
                self.write_rows(layer, table, keys, values)
        return kept.rows

    def erase_rows(self, layer: str, table: str, keys: np.ndarray) -> None:
        """Forget ``keys`` in ``layer``'s table (an online update's erased keys). A volatile
        database that is down raises :class:`StoreUnavailable`."""
        store = self._up(layer)
        for s in range(0, keys.size, _WRITE_ROWS):
            store.erase(table, keys[s:s + _WRITE_ROWS])

    # -- what online updates leave behind ------------------------------------------------------
    @property
    def in_process_volatile(self) -> bool:
        """The volatile layer lives in this process (a hash map): it starts empty."""
        return self.volatile_params.type in ("hash_map", "parallel_hash_map")

    def _lasting(self):
        """The layer whose contents outlive this process (the persistent database unless it is
        read-only, else a volatile database in another process), or None."""
        if self.persistent is not None and not self.persistent_params.read_only:
            return self.persistent
        if self.volatile_configured and not self.in_process_volatile:
            return self.volatile
        return None

    def updates_last(self, table: str) -> bool:
        """Whether online updates of ``table`` outlive this process (a lasting layer takes
        them); if not, a restarted server must read the update stream from its start."""
        lasting = self._lasting()
        if lasting is None:
            return False
        layer = "persistent_db" if lasting is self.persistent else "volatile_db"
        return layer in self.update_layers(table)

    def save_dense(self, name: str, dense: bytes, record: dict) -> bool:
        """Keep a model's dense weights applied from the update stream (``name``: its dense
        topic) in the lasting layer, ``record`` (step, BatchNorm JSON, which base) as its
        meta, written last; False where no layer lasts."""
        store = self._lasting()
        if store is None:
            return False
        pad = (-len(dense)) % (4 * _DENSE_ROW)
        rows = np.frombuffer(dense + b"\0" * pad, "<f4").reshape(-1, _DENSE_ROW)
        before = store.get_meta(name)
        store.set_meta(name, None)  # incomplete until the meta comes back
        if before and int(before.get("bytes", 0)) > len(dense):
            store.drop_table(name)  # fewer rows now: none of the old ones left behind
        # the rows are written over the last update's: a table dropped and made again each
        # update waited for any flush RocksDB was writing (its catalogue is written in turn:
        # 196 ms at worst against 18, docs/performance.md)
        store.insert(name, np.arange(rows.shape[0], dtype=np.int64), rows)
        store.set_meta(name, {**record, "bytes": len(dense)})
        return True

    def forget_dense(self, name: str) -> None:
        """The kept dense weights no longer match the tables (they were loaded again)."""
        store = self._lasting()
        if store is not None and store.get_meta(name) is not None:
            store.set_meta(name, None)
            store.drop_table(name)

    def load_dense(self, name: str) -> tuple[dict, bytes] | None:
        """What :meth:`save_dense` kept, complete, or None."""
        store = self._lasting()
        meta = store.get_meta(name) if store is not None else None
        if not meta or "bytes" not in meta:
            return None
        n = -(-int(meta["bytes"]) // (4 * _DENSE_ROW))
        rows, found = store.lookup(name, np.arange(n, dtype=np.int64), _DENSE_ROW)
        if not found.all():
            return None
        return meta, np.ascontiguousarray(rows, "<f4").tobytes()[:int(meta["bytes"])]

    def persistent_rows(self, table: str) -> RowParts:
        """Every row the persistent database holds of ``table``, a chunk at a time (for
        :meth:`load`)."""
        return lambda: self.persistent.items(table, _WRITE_ROWS)

    def close(self) -> None:
        self._closed.set()
        for store in (self.volatile, self.persistent):
            if store is not None:
                store.close()
