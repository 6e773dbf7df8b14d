"""A model served from the hierarchical parameter server: the dense network on the device, the
embedding rows fetched per batch through device cache -> volatile DB -> persistent DB ->
``default_value_for_each_table``.

Per batch and table, the distinct keys are looked up once; the rows found form a small table
``[batch * keys_per_sample, dim]`` that the model's own bag and dense network read, so the
predictions are those of the trained model (the same rows, summed in the same order). The
device cache inserts what it missed synchronously while its hit rate is below
``hit_rate_threshold`` and on a worker thread above it; with ``refresh_interval`` > 0 a
refresher re-reads the cached rows from the databases (``refresh_delay`` after start,
``cache_refresh_percentage_per_iteration`` of the cache at a time).

Example::

    dbs = Databases(params.volatile_db, params.persistent_db)
    model = HPSModel(params, dbs)
    model.load_databases()            # the sparse model files into the databases
    probs = model.predict(batch)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.checkpoint.model_files import (
    ModelFileError,
    dense_from_bytes,
    load_model_files,
    sparse_model_parts,
)
from jctr.config import ConfigError
from jctr.config.hps import MODEL_JSON_NAMES, InferenceParams, dense_name
from jctr.config.parser import load_config
from jctr.data.batch import Batch, batch_from_features, check_batch
from jctr.embedding.sparse_embedding import pool
from jctr.models.ctr import StepConfig, build_model, forward
from jctr.ops.host_sort import unique
from jctr.runtime.host_memory import room_left
from jctr.serving.device_cache import WAYS, DeviceCache
from jctr.serving.hps import (
    JOURNAL_BYTES,
    LAYERS,
    STAGED_SUFFIX,
    Databases,
    LayerUnavailable,
    RowParts,
)
from jctr.serving.table_manifest import remember, table_manifest
from jctr.sharding.plan import device_room_bytes, format_bytes
from jctr.stores.base import StoreError, first_beyond_int32
from jctr.stores.hash_map import hash_map_bytes

LOAD_PART_BYTES = 64 << 20  # a sparse model's rows read at a time by a load


_CACHE_READ_KEYS = 1 << 16  # keys of a device cache read again at once at a new base
# where online updates written while a model takes new files are kept (Databases.journal)
_JOURNALED = ("persistent_db", "volatile_db", "device_cache")
_JOURNAL_MIB = JOURNAL_BYTES >> 20


class _Table:
    """One embedding table of a served model."""

    def __init__(self, key: str, spec, default: float, cache: DeviceCache | None):
        self.key = key  # hps_et.<model>.<table>
        self.spec = spec
        self.dim = spec.dim
        self.default = default
        self.cache = cache
        self.counts = dict.fromkeys(LAYERS, 0)
        self.queries = 0
        self.unanswered = 0  # batches refused: a layer that did not answer held keys


def _model_error(where: str, source: str | None, field: str, message: str) -> ConfigError:
    """An error about a field of a served model's parameters, named as the file names it."""
    name = MODEL_JSON_NAMES.get(field.split("[")[0], field.split("[")[0]) \
        if where.startswith("models[") else field.split("[")[0]
    rest = field[len(field.split("[")[0]):]
    return ConfigError(f"{where}.{name}{rest}", message, source)


def check_model_files(params: InferenceParams, *, where: str = "InferenceParams",
                      source: str | None = None) -> None:
    """Every file a served model reads is there: checked before any database is opened, so
    that a wrong path leaves no database folder behind."""
    files = [("network_file", params.network_file), ("dense_model_file", params.dense_model_file)]
    files += [(f"sparse_model_files[{i}]", p) for i, p in enumerate(params.sparse_model_files)]
    for field, path in files:
        if not os.path.exists(path):
            raise _model_error(where, source, field, f"{path}: no such file or folder")


class HPSModel:
    """One model of a parameter server (see the module docstring). Thread-safe."""

    def __init__(self, params: InferenceParams, databases: Databases, *, where: str = "",
                 source: str | None = None):
        self.params = params
        self.dbs = databases
        self.name = params.model_name
        self._where = where or "InferenceParams"
        self._source = source
        cfg = self._network()
        self.cfg = cfg
        self._check_against_network(cfg)
        step_config, init_state = build_model(cfg, capacities={e.name: 1 for e in cfg.embeddings})
        self.step_config: StepConfig = step_config
        nt = params.non_trainable_file
        if nt is None:
            guess = os.path.join(os.path.dirname(params.dense_model_file), "non_trainable.json")
            nt = guess if os.path.isfile(guess) else None
        elif not os.path.isfile(nt):
            nt = None if not _has_batchnorm(cfg) else nt
        with jax.default_device(jax.local_devices()[0]):
            state = load_model_files(step_config, init_state(), params.dense_model_file,
                                     non_trainable_json=nt)
        self._params, self._stats = state.params, state.batch_stats
        self._dense_step = -1  # the step of the dense weights served if an update's (-1: files)
        self.batch_size = params.max_batchsize
        self.tables = []
        caching = params.use_gpu_embedding_cache and params.cache_size_percentage > 0
        if caching:
            self._check_cache_room(step_config.specs)
        for i, spec in enumerate(step_config.specs):
            rows = _stored_rows(params.sparse_model_files[i])
            cache = None
            if caching:
                cache = DeviceCache(max(1, math.ceil(rows * params.cache_size_percentage)),
                                    spec.dim)
            self.tables.append(_Table(params.table_key(i), spec,
                                      float(params.default_value_for_each_table[i]), cache))
        self._manifests: list[dict | None] = [None] * len(self.tables)
        self._forward = _make_forward(step_config)
        self._lock = threading.Lock()
        pool_size = params.number_of_worker_buffers_in_pool
        self._workers = ThreadPoolExecutor(1, thread_name_prefix=f"hps-{self.name}-insert")
        self._pending: list[Future] = []
        self._pending_max = pool_size
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self.requests = 0

    # -- construction -------------------------------------------------------------------------
    def _check_cache_room(self, specs) -> None:
        """The device caches (``gpucacheper`` of each table's rows) must fit what the device
        has left (on CPU, the host's memory): refused here, with the figures, not killed
        while they are made."""
        p = self.params
        need = sum(DeviceCache.bytes_for(
            max(1, math.ceil(_stored_rows(p.sparse_model_files[i]) * p.cache_size_percentage)),
            spec.dim) for i, spec in enumerate(specs))
        device = jax.local_devices()[0]
        room = device_room_bytes(device)
        if room is not None and need > room:
            where = "the host's memory" if device.platform == "cpu" else str(device)
            raise self._error("cache_size_percentage",
                              f"{p.cache_size_percentage}: the device caches of this model's "
                              f"tables would take {format_bytes(need)}, but {where} has "
                              f"{format_bytes(max(room, 0))} left; lower gpucacheper or set "
                              "gpucache false (the databases answer)")

    def _error(self, field: str, message: str) -> ConfigError:
        return _model_error(self._where, self._source, field, message)

    def _network(self):
        path = self.params.network_file
        if not os.path.isfile(path):
            raise self._error("network_file", f"{path}: no such file (the model's training "
                                              "config, e.g. a bundle's config.json)")
        try:
            return load_config(path, require_solver=False)
        except ConfigError as e:
            raise self._error("network_file", f"does not parse: {e}") from None

    def _check_against_network(self, cfg) -> None:
        p = self.params
        specs = [(e, next(s for s in cfg.data.sparse if s.top == e.bottom))
                 for e in cfg.embeddings]
        if len(p.sparse_model_files) != len(specs):
            raise self._error("sparse_model_files", f"{len(p.sparse_model_files)} file(s) for "
                              f"the network's {len(specs)} embedding(s) "
                              f"({', '.join(e.name for e, _ in specs)}), one per embedding in "
                              "config order")
        for i, (e, sp) in enumerate(specs):
            if p.embedding_vecsize_per_table and p.embedding_vecsize_per_table[i] < \
                    e.embedding_vec_size:
                raise self._error(f"embedding_vecsize_per_table[{i}]",
                                  f"{p.embedding_vecsize_per_table[i]}, but embedding "
                                  f'"{e.name}" has embedding_vec_size {e.embedding_vec_size} '
                                  "(this is the largest vector size the table may hold)")
            width = sp.slot_num if sp.one_hot else sp.max_feature_num_per_sample
            q = p.maxnum_catfeature_query_per_table_per_sample
            if q and q[i] < width:
                raise self._error(f"maxnum_catfeature_query_per_table_per_sample[{i}]",
                                  f"{q[i]}, but input \"{sp.top}\" carries up to {width} keys "
                                  "per sample")
        if p.label_dim != cfg.data.label_dim:
            raise self._error("label_dim", f"{p.label_dim}, but the network's label_dim is "
                                           f"{cfg.data.label_dim}")
        if cfg.data.dense_dim > p.maxnum_des_feature_per_sample:
            raise self._error("maxnum_des_feature_per_sample",
                              f"{p.maxnum_des_feature_per_sample}, but the network has "
                              f"{cfg.data.dense_dim} dense features")

    def table_manifest(self, i: int) -> dict:
        """What table ``i`` must hold (see :mod:`jctr.serving.table_manifest`)."""
        if self._manifests[i] is None:
            path = self.params.sparse_model_files[i]
            for stored in self.dbs.stored_manifests(self.tables[i].key):
                remember(stored)  # the files' digests as the last load or start took them
            self._manifests[i] = table_manifest(self.params.dense_model_file, path,
                                                rows=_stored_rows(path),
                                                dim=self.tables[i].dim,
                                                deltas=self._delta_files(i))
        return self._manifests[i]

    def _delta_files(self, i: int) -> tuple[str, ...]:
        name = self.step_config.specs[i].name
        return tuple(os.path.join(d, "sparse", f"{name}.model")
                     for d in self.params.delta_bundles)

    def _chain_rows(self, i: int) -> tuple[int, int]:
        """(rows of table ``i``'s base, rows of its deltas together), from the files' sizes."""
        return (_stored_rows(self.params.sparse_model_files[i]),
                sum(_stored_rows(d) for d in self._delta_files(i)))

    def _row_links(self, i: int, first_link: int, meter: _LoadMeter | None = None
                   ) -> list[RowParts]:
        """The rows of table ``i``'s chain from link ``first_link`` on (0: the base, then
        every delta; a later link's row of a key wins), each link read ``LOAD_PART_BYTES`` at
        a time: a model larger than memory loads into RocksDB. Every link is read through
        once here, so that a bad file is refused before any database is written."""
        dim = self.tables[i].dim
        paths = ((self.params.sparse_model_files[i],) + self._delta_files(i))[first_link:]
        part_rows = max(1024, LOAD_PART_BYTES // (8 + 4 * dim))

        def link(path: str, check: bool):  # check: the first read's checks besides finiteness
            def parts():
                for keys, values in sparse_model_parts(path, dim, part_rows, unique=check):
                    if check and not self.params.i64_input_key:
                        wide = first_beyond_int32(keys)
                        if wide is not None:
                            raise StoreError(
                                f"{path}: key {wide} does not fit in int32, but "
                                "supportlonglong is false (requests send INT32 keys); set "
                                "supportlonglong to true")
                    yield keys, values
            return parts

        meter = meter or _LoadMeter(None)
        meter.begin(f"{self.tables[i].key}: checking its files",
                    sum(_stored_rows(p) for p in paths))
        for path in paths:
            for keys, _ in link(path, True)():
                meter.add(keys.size)
        return [link(path, False) for path in paths]

    def _check_hash_map_room(self) -> None:
        """An in-process hash map takes its share of every table, all of them without a
        persistent database: refused here, with the figures, where that would not fit."""
        if not self.dbs.in_process_volatile:
            return
        need = sum(self._hash_map_bytes(self.dbs.volatile_share(*self._chain_rows(i)), t.dim)
                   for i, t in enumerate(self.tables))
        self._refuse_beyond_room(
            need, "its tables' rows would take", "at their peak", "lower initial_cache_rate "
            "or set overflow_margin with a persistent_db (rocks_db) holding every row")

    def _check_switch_room(self, tables: list[int]) -> None:
        """An in-process hash map holds a table's old chain and its next one together while
        a new base is written (:meth:`Databases.switch_links`, one table at a time): a
        switch whose largest next table would not fit beside what is held is refused, with
        the figures, before anything is written (the model served as it was)."""
        if not self.dbs.in_process_volatile or not tables:
            return
        need = 0
        for i in tables:
            t = self.tables[i]
            rows = sum(self._chain_rows(i))  # every row without a persistent database
            if self.dbs.persistent is not None:  # the share: the keys held, at most
                rows = min(rows, self.dbs.volatile.size(t.key))
            need = max(need, self._hash_map_bytes(rows, t.dim))
        self._refuse_beyond_room(
            need, "the next base's table would take", "beside the one served",
            "the model is served as it was: run `python -m jctr.serve load` and restart to "
            "take it")

    def _hash_map_bytes(self, rows: int, dim: int) -> int:
        """What ``rows`` rows take in the in-process hash map (at most what its overflow
        margin lets it hold)."""
        v = self.dbs.volatile_params
        return hash_map_bytes(min(rows, v.partitions * v.overflow_margin), dim)

    def _refuse_beyond_room(self, need: int, what: str, where: str, advice: str) -> None:
        """:class:`StoreError` with both figures where ``need`` bytes of the hash map would
        not fit in the memory this process has left."""
        room = room_left()
        if room is not None and need > room:
            raise StoreError(
                f"volatile_db ({self.dbs.volatile_params.type}) of model {self.name}: {what} "
                f"{format_bytes(need)} of this process's memory {where}, but "
                f"{format_bytes(max(room, 0))} are left; {advice}")

    def load_databases(self, *, replace: bool = False,
                       progress: Callable[[str], None] | None = None
                       ) -> dict[str, dict[str, int]]:
        """Fill the databases from the sparse model files (and delta models). ``replace``
        (``python -m jctr.serve load``): every table into every layer. Otherwise (``serve``
        starting) a layer's table is loaded where the layer lacks it, kept where it holds this
        export, and refused (:class:`jctr.serving.hps.TableMismatch`) where it holds another
        export or an incomplete load; an in-process hash map is always filled. Either way a
        layer holding the first links of this model's base + delta chain gets only the
        deltas it lacks. ``progress``: where a long load says how far it is (a line at most
        every ``_LoadMeter.EVERY_S``). Returns rows written per table and layer."""
        meter = _LoadMeter(progress)
        in_process = self.dbs.in_process_volatile
        self._check_hash_map_room()
        work = []  # every table's plan and files, checked before any database is written
        for i, t in enumerate(self.tables):
            for layer in self.dbs.drop_staged(t.key):
                if progress is not None:
                    progress(f"[jctr] {t.key}: {layer}: the next base a stopped switch had "
                             "half written, dropped")
            manifest = self.table_manifest(i)
            self.dbs.expected[t.key] = manifest
            plan = {layer: self._plan(layer, t.key, manifest, replace,
                                      in_process and layer == "volatile_db")
                    for layer in ("persistent_db", "volatile_db")}
            # the persistent database holds this export with the updates applied since: the
            # hash map starts from its rows, not the files' older ones
            from_persistent = (in_process and plan["persistent_db"] is None
                               and self.dbs.persistent is not None
                               and self.dbs.updates_last(t.key))
            if from_persistent:
                plan["volatile_db"] = None
            links = {first: self._row_links(i, first, meter) for first in set(plan.values())
                     if first is not None}
            work.append((t, manifest, plan, from_persistent, links))
        out = {}
        for i, (t, manifest, plan, from_persistent, links) in enumerate(work):
            counted = meter.layers(self, i, manifest)
            written = {"volatile_db": 0, "persistent_db": 0}
            if from_persistent:
                written["volatile_db"] = self.dbs.load(
                    t.key, [self.dbs.persistent_rows(t.key)], manifest,
                    into_persistent=False, rows=int(manifest["rows"]),
                    progress=counted)["volatile_db"]
            full = [layer for layer, step in plan.items() if step == 0]
            if "persistent_db" in full or (self.dbs.persistent is None and full):
                self.dbs.forget_dense(dense_name(self.name))  # rows from the files again
            if full:
                written.update({k: v for k, v in self.dbs.load(
                    t.key, links[0], manifest, into_persistent="persistent_db" in full,
                    into_volatile="volatile_db" in full, rows=sum(self._chain_rows(i)),
                    progress=counted).items()
                    if k in full})
            for layer, first in plan.items():
                if first is None:
                    self.dbs.refresh_manifest(layer, t.key, manifest)
                elif first:  # the same chain's first links are there: the rest over them
                    written[layer] = self.dbs.write_links(layer, t.key, links[first],
                                                          manifest, progress=counted)
            out[t.key] = written
        return out

    def take_chain(self, params: InferenceParams,
                   progress: Callable[[str], None] | None = None) -> tuple[bool, int]:
        """Serve the base and delta models ``params`` names (a parameter-server file read
        again) without a restart; returns (a new base taken, deltas taken after the base).

        The same base with more deltas: every database layer holding the chain gets the new
        deltas' rows. Another base (the next day's): every layer's table is made the new
        chain while requests go on (:meth:`Databases.switch_links`: written into a table of
        its own and swapped in at once, or in place in Redis; a volatile database holding a
        share takes those of the keys it holds). Either way every file is read through
        and checked before any write, the device cache takes the new rows of the keys it
        holds (at a new base: read again from the databases, keys the new chain lacks
        forgotten), then the last model's dense weights are swapped in. Online updates go on
        meanwhile: those written while the files were taken, of steps after the last file's,
        are written again over them (:meth:`Databases.begin_journal`), with updates paused for
        the table, before a new base is swapped in. Only the chain and its
        dense files are taken; another network or other settings take a restart, and a
        chain that drops deltas of the same base is refused (:class:`StoreError`), the model
        served as it was."""
        old = self.params
        new_deltas, held = tuple(params.delta_bundles), tuple(old.delta_bundles)
        new_base = tuple(params.sparse_model_files) != tuple(old.sparse_model_files)
        if not new_base and new_deltas == held:
            return False, 0
        if not _same_bytes(params.network_file, old.network_file) or (
                not new_base and new_deltas[:len(held)] != held):
            raise StoreError(f"model {self.name}: the new file names another network, or "
                             "deltas of the same base that do not extend those served; run "
                             "`python -m jctr.serve load` and restart")
        with open(params.dense_model_file, "rb") as f:
            dense = f.read()
        nt = params.non_trainable_file
        non_trainable = ""
        if nt and os.path.isfile(nt):
            with open(nt, encoding="utf-8") as f:
                non_trainable = f.read()
        checked = self._dense_from(dense, non_trainable)  # bad: refused before any write
        # the chain and its dense files only: other settings take a restart
        self.params = dataclasses.replace(
            old, sparse_model_files=params.sparse_model_files, network_file=params.network_file,
            delta_bundles=params.delta_bundles, dense_model_file=params.dense_model_file,
            non_trainable_file=params.non_trainable_file)
        self._manifests = [None] * len(self.tables)
        meter = _LoadMeter(progress)
        fresh = 0 if new_base else len(held) + 1  # the first link the cache has not seen
        try:
            work = []
            for i, t in enumerate(self.tables):
                manifest = self.table_manifest(i)
                layers = {}
                for layer, store in (("persistent_db", self.dbs.persistent),
                                     ("volatile_db", self.dbs.volatile)):
                    if store is None:  # none, or down: it is checked as it comes back
                        continue
                    first = 0 if new_base else self.dbs.links_held(layer, t.key, manifest)
                    if first is None or (layer == "persistent_db"
                                         and self.dbs.persistent_params.read_only):
                        raise StoreError(f"model {self.name}: {layer} does not hold the first "
                                         f"parts of {t.key}'s chain, or is read-only; run "
                                         "`python -m jctr.serve load` and restart")
                    layers[layer] = first
                links = {f: self._row_links(i, f, meter) for f in set(layers.values()) | {fresh}}
                work.append((i, t, manifest, layers, links))
            if new_base:
                self._check_switch_room([w[0] for w in work if "volatile_db" in w[3]])
        except BaseException:
            self.params, self._manifests = old, [None] * len(self.tables)
            raise
        # online updates written meanwhile are kept and written again over the new files
        # (those after the files' step: the stream is newer), each table's with its updates
        # paused, then the new base swapped in
        after = self.served_step()
        for i, t, manifest, layers, links in work:
            self.dbs.expected[t.key] = manifest
            counted = meter.layers(self, i, manifest)
            self.dbs.begin_journal(t.key, _JOURNALED, after)
            try:
                for layer, first in layers.items():
                    if new_base:
                        share = layer == "volatile_db" and self.dbs.persistent is not None
                        self.dbs.switch_links(layer, t.key, links[0], manifest,
                                              functools.partial(self._chain_keys, i),
                                              held_only=share, progress=counted,
                                              swap_now=False)
                    else:
                        self.dbs.write_links(layer, t.key, links[first], manifest,
                                             progress=counted)
                with self.dbs.updates_paused(t.key):
                    kept = {layer: self.dbs.end_journal(layer, t.key) for layer in _JOURNALED}
                    self._took(i, t, manifest, layers, links[fresh], new_base, kept, progress)
            finally:
                for layer in _JOURNALED:
                    self.dbs.end_journal(layer, t.key)
        if not self._put_dense(*checked, unless_after=after if after >= 0 else None) \
                and progress:
            progress(f"[jctr] {self.name}: the dense weights of step {self._dense_step} from the "
                     f"online updates kept (newer than the files', step {after})")
        return new_base, len(new_deltas) - (0 if new_base else len(held))

    def _took(self, i: int, t, manifest: dict, layers: dict, fresh_links, new_base: bool,
              kept: dict, progress: Callable[[str], None] | None) -> None:
        """The end of :meth:`take_chain` for table ``i``, online updates paused: the updates
        ``kept`` while its files were written written again over them, a new base's next
        tables swapped in, and the device cache made to match."""
        replayed = dropped = 0
        for layer in layers:
            staged = new_base and self.dbs.can_swap(layer)
            journal = kept.get(layer)
            if journal is not None:
                replayed = max(replayed, self.dbs.replay_journal(
                    layer, t.key + STAGED_SUFFIX if staged else t.key, journal))
                dropped = max(dropped, journal.dropped)
            # every layer's next table written, then swapped in one after the other:
            # requests meanwhile read one day in every layer (not the new persistent rows
            # under the old volatile share while the share is written)
            if staged:
                self.dbs.swap_staged(layer, t.key, manifest)
        if progress is not None and (replayed or dropped):
            progress(f"[jctr] {self.name}: {t.key}: {replayed:,} row(s) of online updates "
                     "newer than the files, written while they were taken, kept over them"
                     + (f"; {dropped:,} more past {_JOURNAL_MIB} MiB were not (served from "
                        "the files until updated again)" if dropped else ""))
        if t.cache is None:
            return
        if new_base:  # the keys the cache holds, read again from the new chain's tables
            cached = t.cache.cached_keys(0, t.cache.num_sets)
            for s in range(0, cached.size, _CACHE_READ_KEYS):
                keys = cached[s:s + _CACHE_READ_KEYS]
                try:
                    values, found, _ = self.dbs.lookup(t.key, keys, t.dim, t.default)
                except (LayerUnavailable, StoreError):  # forgotten: read again when asked
                    t.cache.forget_rows(keys)
                    continue
                t.cache.refresh_rows(keys[found], values[found])
                t.cache.forget_rows(keys[~found])
            return
        for read in fresh_links:  # the new deltas' rows of keys the cache holds
            for keys, values in read():
                t.cache.refresh_rows(keys, values)
        journal = kept.get("device_cache")
        for keys, values in journal.parts if journal is not None else ():
            if values is None:
                t.cache.forget_rows(keys)
            else:
                t.cache.refresh_rows(keys, values)

    def _chain_keys(self, i: int) -> np.ndarray:
        """Every key of table ``i``'s chain, sorted (the keys a database that cannot swap
        tables keeps at a new base; 8 bytes a key, read from the key files)."""
        return unique(np.concatenate([
            np.fromfile(os.path.join(path, "key"), "<i8").astype(np.int64)
            for path in (self.params.sparse_model_files[i], *self._delta_files(i))]))

    def base_link(self) -> str:
        """The base export this model serves (the first link of table 0's chain)."""
        return self.table_manifest(0)["links"][0]

    def served_step(self) -> int:
        """The training step of the dense weights read from the files (-1: unknown)."""
        path = os.path.join(os.path.dirname(self.params.dense_model_file), "manifest.json")
        try:
            with open(path, encoding="utf-8") as f:
                return int(json.load(f).get("step", -1))
        except (OSError, ValueError, TypeError, AttributeError):
            return -1

    def restore_dense(self) -> int | None:
        """Serve the dense weights the update stream delivered before a restart, kept by
        :meth:`Databases.save_dense`, when they came for this base after the files' step;
        returns their step, or None."""
        kept = self.dbs.load_dense(dense_name(self.name))
        if kept is None:
            return None
        meta, dense = kept
        if meta.get("base") != self.base_link() or int(meta.get("step", -1)) <= \
                self.served_step():
            return None
        self.swap_dense(dense, meta.get("non_trainable", ""), step=int(meta["step"]))
        return int(meta["step"])

    def _plan(self, layer: str, table: str, manifest: dict, replace: bool,
              always: bool) -> int | None:
        """What ``layer`` needs of ``table``: 0 the whole chain, k > 0 its links from k on,
        None nothing."""
        if always:
            return 0
        held = self.dbs.links_held(layer, table, manifest)
        if held is not None:
            if layer == "persistent_db" and self.dbs.persistent_params.read_only:
                raise StoreError(f"persistent_db ({self.dbs.persistent_params.type}, "
                                 f"read-only) {self.dbs.persistent_params.path}: holds "
                                 f"{held} of the {len(manifest['links'])} parts of {table} "
                                 "(base and deltas); turn read_only off to apply the rest")
            return held
        if replace:
            return 0
        state = self.dbs.check_table(layer, table, manifest)
        if (state == "absent" and layer == "persistent_db" and self.dbs.persistent is not None
                and self.dbs.persistent_params.read_only):
            raise StoreError(f"persistent_db ({self.dbs.persistent_params.type}, "
                             f"read-only) {self.dbs.persistent_params.path}: has no "
                             f"table {table}; load it first (python -m jctr.serve "
                             "load) or turn read_only off")
        return 0 if state == "absent" else None

    # -- lookups ------------------------------------------------------------------------------
    def _gather(self, t: _Table, keys: np.ndarray, valid: np.ndarray):
        """(compact rows [cap, dim] on device, row of each key: -1 for padding)."""
        cap = keys.size
        uniq, inverse = np.unique(keys[valid], return_inverse=True)
        rows = np.full(cap, -1, np.int32)
        rows[valid] = inverse
        n = uniq.size
        t.queries += n
        if t.cache is not None:
            hit, cached = t.cache.query(uniq, size=cap)
        else:
            hit, cached = np.zeros(n, bool), None
        miss = np.flatnonzero(~hit)
        host = np.zeros((cap, t.dim), np.float32)
        if miss.size:
            try:
                values, found, counts = self.dbs.lookup(t.key, uniq[miss], t.dim, t.default)
            except LayerUnavailable:
                t.unanswered += 1
                raise
            host[miss] = values
            for layer, c in counts.items():
                t.counts[layer] += c
            t.counts["default"] += int(miss.size - found.sum())
            if t.cache is not None and found.any():
                self._cache_insert(t, uniq[miss[found]], values[found], cap,
                                   hit_rate=1 - miss.size / n)
        t.counts["device_cache"] += int(n - miss.size)
        return cached, hit, host, rows

    def _cache_insert(self, t: _Table, keys: np.ndarray, values: np.ndarray, size: int,
                      hit_rate: float) -> None:
        self._pending = [f for f in self._pending if not f.done()]
        if hit_rate < self.params.hit_rate_threshold or len(self._pending) >= self._pending_max:
            t.cache.insert(keys, values, size)
        else:
            self._pending.append(self._workers.submit(t.cache.insert, keys, values, size))

    def predict(self, batch: Batch) -> np.ndarray:
        """Probabilities ``[samples, label_dim]`` of the batch's real samples; batches larger
        than ``max_batchsize`` are split, smaller ones padded."""
        batch = check_batch(batch, self.cfg.data)
        outs = []
        b = batch.batch_size
        if b == self.batch_size:
            return self._predict_full(batch)[batch.mask]
        for s in range(0, b, self.batch_size):
            e = min(b, s + self.batch_size)
            outs.append(self._predict_full(_slice_batch(self.cfg.data, batch, s, e,
                                                        self.batch_size))[:e - s])
        pred = np.concatenate(outs)
        return pred[batch.mask]

    def predict_features(self, dense, sparse) -> np.ndarray:
        """Probabilities from raw features (see :func:`jctr.data.batch.batch_from_features`),
        in chunks of ``max_batchsize``."""
        dense = np.asarray(dense)
        n = dense.shape[0] if dense.ndim == 2 else -1
        if n < 0:
            raise ValueError(f"dense: expected [samples, {self.cfg.data.dense_dim}]")
        b = self.batch_size
        outs = []
        for s in range(0, max(n, 1), b):
            e = min(n, s + b)
            part = [_slice_sparse(x, s, e, sp.slot_num) for x, sp in
                    zip(sparse, self.cfg.data.sparse)] if n > b else sparse
            batch = batch_from_features(self.cfg.data, dense[s:e], part, batch_size=b)
            outs.append(self._predict_full(batch)[:e - s])
        return np.concatenate(outs) if outs else np.zeros((0, self.cfg.data.label_dim))

    def _predict_full(self, batch: Batch) -> np.ndarray:
        with self._lock:
            self.requests += 1
            b = batch.batch_size
            cached, hits, hosts, rows = [], [], [], []
            for t in self.tables:
                keys = batch.keys[t.spec.input_index]
                segs = batch.segments[t.spec.input_index]
                valid = segs < b * t.spec.slot_num
                c, h, host, r = self._gather(t, keys, valid)
                cap = keys.size
                hit = np.zeros(cap, bool)
                hit[:h.size] = h
                cached.append(c if c is not None else jnp.zeros((cap, t.dim), jnp.float32))
                hits.append(hit)
                hosts.append(host)
                rows.append(r)
            pred = self._forward(self._params, self._stats, batch, tuple(cached), tuple(hits),
                                 tuple(hosts), tuple(rows))
            return np.asarray(pred)

    # -- online updates (jctr.serving.updates) -----------------------------------------------
    def table_index(self, name: str) -> int | None:
        """The table of embedding ``name`` (the name training publishes updates under)."""
        return next((i for i, t in enumerate(self.tables) if t.spec.name == name), None)

    def refresh_rows(self, i: int, keys: np.ndarray, values: np.ndarray) -> None:
        """New values for those of ``keys`` the device cache holds (the databases are written
        by the caller)."""
        cache = self.tables[i].cache
        if cache is not None:
            cache.refresh_rows(keys, values)

    def forget_rows(self, i: int, keys: np.ndarray) -> None:
        """Those of ``keys`` the device cache holds, no longer cached (an online update's
        erased keys; the databases are written by the caller)."""
        cache = self.tables[i].cache
        if cache is not None:
            cache.forget_rows(keys)

    def compile_refresh(self) -> None:
        """Compile :meth:`refresh_rows`' device step ahead (changes nothing; see
        :meth:`jctr.serving.device_cache.DeviceCache.compile_refresh`)."""
        for t in self.tables:
            if t.cache is not None:
                t.cache.compile_refresh()

    def _dense_from(self, dense: bytes, non_trainable: str):
        """Dense weights and BatchNorm statistics from an update, checked like the files
        (:class:`jctr.checkpoint.model_files.ModelFileError` where they do not fit)."""
        with self._lock:
            params, stats = self._params, self._stats
        nt = non_trainable if non_trainable and _has_batchnorm(self.cfg) else None
        with jax.default_device(jax.local_devices()[0]):
            params, stats = dense_from_bytes(self.step_config.graphdef, params, stats, dense,
                                             nt, where=f"dense update of {self.name}")
        return params, stats, nt

    def check_dense(self, dense: bytes, non_trainable: str) -> None:
        """What :meth:`swap_dense` checks, nothing swapped (the side that keeps them)."""
        self._dense_from(dense, non_trainable)

    def swap_dense(self, dense: bytes, non_trainable: str, step: int = -1) -> None:
        """New dense weights (a dense model file's bytes) and BatchNorm statistics, checked like
        the files, put in place between two requests; ``step``: the training step they are
        of (an online update's)."""
        self._put_dense(*self._dense_from(dense, non_trainable), step=step)

    def _put_dense(self, params, stats, nt, *, step: int = -1,
                   unless_after: int | None = None) -> bool:
        """Checked dense weights (:meth:`_dense_from`'s) in place between two requests;
        ``step``: the step of an online update's (-1: the files'); ``unless_after``: not
        where an online update's of a later step are served (newer than files of that step
        just taken). Returns whether they were put."""
        with self._lock:
            if unless_after is not None and self._dense_step > unless_after:
                return False
            self._params = params
            if nt is not None:
                self._stats = stats
            self._dense_step = step
            return True

    # -- cache refresh ------------------------------------------------------------------------
    def refresh_cache(self) -> int:
        """Re-read every cached row from the databases, ``cache_refresh_percentage_per_
        iteration`` of the sets at a time; returns the rows refreshed."""
        done = 0
        for t in self.tables:
            if t.cache is None:
                continue
            step = max(1, math.ceil(t.cache.num_sets
                                    * self.params.cache_refresh_percentage_per_iteration))
            for first in range(0, t.cache.num_sets, step):
                keys = t.cache.cached_keys(first, step)
                if not keys.size:
                    continue
                try:
                    values, found, _ = self.dbs.lookup(t.key, keys, t.dim, t.default)
                except LayerUnavailable:
                    continue  # the cached rows stay; the next round tries again
                t.cache.refresh(keys[found], values[found], step * WAYS)
                done += int(found.sum())
        return done

    def start_refresh(self) -> None:
        """Start the periodic refresher (when ``refresh_interval`` > 0)."""
        if self.params.refresh_interval <= 0 or self._refresher is not None:
            return

        def run():
            if self._stop.wait(self.params.refresh_delay):
                return
            while not self._stop.is_set():
                self.refresh_cache()
                if self._stop.wait(self.params.refresh_interval):
                    return

        self._refresher = threading.Thread(target=run, name=f"hps-{self.name}-refresh",
                                           daemon=True)
        self._refresher.start()

    def wait_inserts(self) -> None:
        """Block until the asynchronous cache inserts submitted so far are done."""
        for f in list(self._pending):
            f.result()

    def stats(self) -> dict:
        """Lookups per layer and table, cache hit rate and fill (the server's metrics)."""
        out = {}
        for t in self.tables:
            out[t.key] = {"queries": t.queries, **t.counts, "unanswered": t.unanswered,
                          "cache_capacity": t.cache.capacity if t.cache else 0,
                          "hit_rate": t.counts["device_cache"] / t.queries if t.queries else 0.0}
        return out

    def close(self) -> None:
        self._stop.set()
        self._workers.shutdown(wait=True)


def _same_bytes(a: str, b: str) -> bool:
    """Whether two files hold the same bytes (each bundle has its network's config.json)."""
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


class _LoadMeter:
    """How far a long load is: a line at most every ``EVERY_S`` seconds with the table, what
    is done to it, rows done of how many, the rate and the time left (``say`` None: quiet)."""

    EVERY_S = 10.0

    def __init__(self, say: Callable[[str], None] | None):
        self.say = say
        self.begin("", 0)

    def begin(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self.t0 = self.last = time.monotonic()

    def add(self, rows: int) -> None:
        self.done += int(rows)
        now = time.monotonic()
        if self.say is None or now - self.last < self.EVERY_S:
            return
        self.last = now
        rate = self.done / max(now - self.t0, 1e-9)
        left = (f", {(self.total - self.done) / rate:,.0f} s left"
                if rate and self.total > self.done else "")
        self.say(f"[jctr] {self.what}: {self.done:,} of {self.total:,} rows "
                 f"({rate / 1e6:.2f}M rows/s{left})")

    def layers(self, model: HPSModel, i: int, manifest: dict) -> Callable[[str, int], None]:
        """A :meth:`Databases.load` ``progress`` for table ``i`` of ``model``: each layer's
        rows counted against what it takes (a share of the base's in a volatile layer with
        a persistent one below, and every delta row)."""
        base, deltas = int(manifest["rows"]), model._chain_rows(i)[1]
        dbs = model.dbs
        totals = {"persistent_db": base + deltas,
                  "volatile_db": dbs.volatile_share(base, deltas)}
        kinds = {"persistent_db": dbs.persistent_params.type,
                 "volatile_db": dbs.volatile_params.type}
        at = [None]

        def counted(layer: str, rows: int) -> None:
            if at[0] != layer:
                at[0] = layer
                self.begin(f"{model.tables[i].key}: into {layer} ({kinds[layer]})",
                           totals[layer])
            self.add(rows)
        return counted


def _has_batchnorm(cfg) -> bool:
    return any(layer.type == "BatchNorm" for layer in cfg.layers)


def _stored_rows(path: str) -> int:
    kp = os.path.join(path, "key")
    if not os.path.isfile(kp):
        raise ModelFileError(f"{kp}: missing (a sparse model is a folder with `key` and "
                             "`emb_vector` files)")
    return os.path.getsize(kp) // 8


def _make_forward(sc: StepConfig):
    def fwd(params, stats, batch, cached, hits, hosts, rows):
        b = batch.label.shape[0]
        with jax.default_matmul_precision(sc.matmul_precision):
            pooled = []
            for spec, c, h, host, r in zip(sc.specs, cached, hits, hosts, rows):
                compact = jnp.where(h[:, None], c, host)
                pooled.append(pool(spec, compact, r, batch.segments[spec.input_index], b))
            _, (pred, _) = forward(sc, params, stats, tuple(pooled), batch, None, False)
            return pred

    return jax.jit(fwd)


def _slice_batch(data, batch: Batch, s: int, e: int, size: int) -> Batch:
    """Samples ``[s, e)`` of a batch as a batch of ``size`` (keys keep their order: a slot's
    sum is taken in the same order as in the whole batch)."""
    n = e - s
    b = batch.batch_size
    keys, segs = [], []
    for sp, k, g in zip(data.sparse, batch.keys, batch.segments):
        width = sp.slot_num if sp.one_hot else sp.max_feature_num_per_sample
        kk = np.zeros(size * width, np.int64)
        gg = np.full(size * width, size * sp.slot_num, np.int32)
        if sp.one_hot:  # the key of (sample, slot) sits at sample * slot_num + slot
            part = g[s * width:e * width]
            kk[:n * width] = k[s * width:e * width]
            gg[:n * width] = np.where(part < b * sp.slot_num, part - s * sp.slot_num,
                                      size * sp.slot_num)
        else:
            take = (g >= s * sp.slot_num) & (g < e * sp.slot_num)
            m = int(take.sum())
            kk[:m] = k[take]
            gg[:m] = g[take] - s * sp.slot_num
        keys.append(kk)
        segs.append(gg)
    pad = size - n

    def cut(x):
        x = x[s:e]
        return np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x

    return Batch(cut(batch.label), cut(batch.dense), tuple(keys), tuple(segs),
                 cut(batch.mask))


def _slice_sparse(x, s: int, e: int, slots: int):
    if isinstance(x, tuple):
        keys, offsets = np.asarray(x[0]), np.asarray(x[1])
        lo, hi = int(offsets[s * slots]), int(offsets[e * slots])
        return keys[lo:hi], offsets[s * slots:e * slots + 1] - lo
    return np.asarray(x)[s:e]

