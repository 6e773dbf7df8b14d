"""Orbax checkpoints of the whole training state, written so that no exit loses or damages one.

Layout under the checkpoint directory (``<snapshot_prefix>checkpoints``):

* ``<step>/``: a finished checkpoint with two Orbax items -- ``dense`` (step, base RNG key,
  dense parameters, BatchNorm statistics, dense optimizer state) and ``meta`` (JSON: format
  version, data reader positions, the config, the tables' shapes) -- and ``rows/``, every
  embedding table by key with its optimizer rows (:mod:`jctr.sharding.rows`, so that another
  table capacity or device count can load it): one headerless little-endian file per array
  in a folder per table, named (with dtype and shape) in ``rows/index.json``, written by
  jctr past the page cache (:mod:`jctr.runtime.direct_io`; version 2 kept them in a third
  Orbax item, ``tables``, which still restores) -- plus ``jctr_integrity.json``, the size and
  CRC32 of every file;
* ``non_trainable_<step>.json`` beside it (BatchNorm statistics, HugeCTR's format);
* ``.pending/<step>/``: a save in flight. Orbax writes it (asynchronously) and jctr the rows
  beside it (``.pending/<step>.rows/``); once both are complete, the rows move in, the
  integrity record goes in and the folder is renamed to ``<step>/``. Only then is the snapshot
  reported. A process killed at any moment therefore leaves either a finished, sealed checkpoint
  or an invisible pending one, and the previous checkpoints untouched;
* ``LOCK``: the run that owns the directory (process id, host, start time). A second run on the
  same directory stops with a message; a lock whose process is gone is reported and taken over.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jctr.checkpoint.integrity import check_files, file_digests, note_written
from jctr.embedding.sparse_embedding import EmbeddingSpec
from jctr.errors import UserError
from jctr.models.ctr import TrainState
from jctr.runtime.direct_io import replace_file, replace_json, write_file
from jctr.runtime.folder_lock import FolderLock
from jctr.sharding.mesh import to_host
from jctr.sharding.plan import format_bytes
from jctr.sharding.rows import (
    export_placed,
    held_here,
    import_placed,
    restore_layout,
    slot_layout,
)

FORMAT = "jctr-checkpoint"
VERSION = 3  # 2: sealed from .pending/ with jctr_integrity.json inside; 3: rows/ by jctr
ROWS = "rows"
INTEGRITY = "jctr_integrity.json"
PENDING = ".pending"
LOCK = "LOCK"
BEST = "best.json"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete, unreadable, or its directory is in use; the message
    names the path."""


def _dense_tree(state: TrainState) -> dict[str, Any]:
    return {"step": state.step, "rng": state.rng, "params": state.params,
            "batch_stats": state.batch_stats, "opt_state": state.opt_state}


def export_tables(state: TrainState, specs: tuple[EmbeddingSpec, ...], placements=None, *,
                  copy: bool = True) -> dict[str, dict[str, np.ndarray]]:
    """Every table's used rows on the host, by name (what a checkpoint stores); ``copy``
    False: views where they can be (:func:`jctr.sharding.rows.export_placed`)."""
    placements = placements or (None,) * len(specs)
    out = {s.name: export_placed(e, p, copy=copy)
           for s, e, p in zip(specs, state.embeddings, placements)}
    for s, p in zip(specs, placements):
        if s.eviction is not None and s.eviction.spill:  # and the rows in the database(s)
            from jctr.embedding import spill

            spread = p is not None and p.sharded and jax.process_count() > 1
            out[s.name] = spill.with_spilled(s, out[s.name], gather=spread)
    return out


@functools.cache
def _no_host_copies() -> None:
    """Orbax copies every numpy array before an asynchronous save, against changes meanwhile;
    a checkpoint's host arrays are fresh exports nobody changes, and the copy of a table of
    millions of rows took most of a second. Registered once, for numpy arrays."""
    from orbax.checkpoint import type_handlers

    try:
        handler = type_handlers.NumpyHandler(deepcopy_host_arrays=False)
    except TypeError:  # an Orbax without the switch: keep its copies
        return
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # its note that a handler is replaced is not for users
    try:
        type_handlers.register_type_handler(np.ndarray, handler, override=True)
    finally:
        absl.setLevel(level)


def _save_handlers():
    """Orbax's handlers for a save; the tables' without zstd: trained float rows shrink by
    ~7% under it, and compressing them took ~2.5x the time of the uncompressed write on two
    cores (docs/performance.md, "Day-end cost, third round"). Restores read either, since
    each array's metadata names its codec."""
    try:
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("dense", ocp.args.StandardSave, ocp.StandardCheckpointHandler())
        registry.add("tables", ocp.args.PyTreeSave,
                     ocp.PyTreeCheckpointHandler(use_compression=False))
        registry.add("meta", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
    except (AttributeError, TypeError):  # an Orbax without these: its defaults (compressed)
        return None
    return registry


# an evicting table's slots as saved (``slot_keys``), stored as a table of this name beside it
LAYOUT_PREFIX = "slot_layout_of_"


def _slot_layouts(state: TrainState, specs: tuple[EmbeddingSpec, ...]
                  ) -> dict[str, dict[str, np.ndarray]]:
    """Where each evicting table's keys sit in its slots, tombstones included
    (:func:`jctr.sharding.rows.slot_layout`): its evictions choose among the keys of slot
    windows, so a restore puts them back there to evict as the saved table would. With
    several processes every one takes part (the parts are gathered as the rows are), and
    process 0 writes them."""
    return {LAYOUT_PREFIX + s.name: {"slot_keys": slot_layout(e)}
            for s, e in zip(specs, state.embeddings) if s.eviction is not None}


def _eviction_counts(spec: EmbeddingSpec, es) -> dict[str, int]:
    """An evicting table's keys evicted and refused so far (the log's, TensorBoard's and the
    report's figures), kept with its snapshot so that a resumed run counts on."""
    if spec.eviction is None:
        return {}
    return {"evicted": int(np.sum(to_host(es.table.evicted))),
            "refused": int(np.sum(to_host(es.table.overflow)))}


def _with_eviction_counts(spec: EmbeddingSpec, es, stored: dict[str, Any]):
    """``es`` counting on from the saved counts (:func:`_eviction_counts`); a sharded
    table's parts count each their own, so the totals go to the first part (a restore may
    be on another device count). Counts of a table saved without eviction start at 0."""
    if spec.eviction is None or "evicted" not in stored:
        return es

    def put(x, total: int):
        now = np.zeros(np.shape(x), x.dtype)
        now.flat[0] = total
        return jax.device_put(now, x.sharding)

    table = es.table
    return es._replace(table=table._replace(evicted=put(table.evicted, stored["evicted"]),
                                            overflow=put(table.overflow, stored["refused"])))


class Checkpointer:
    """Saves and restores :class:`TrainState` under ``directory``, keeping the last ``keep``.

    ``on_sealed(step, path)`` is called once a snapshot is complete on disk (from a background
    thread for asynchronous saves).

    Example::

        ckpt = Checkpointer("runs/dlrm/checkpoints", keep=3)
        ckpt.acquire()                                      # this run owns the directory
        ckpt.save(state, specs, meta={"reader": {...}})
        ckpt.wait()                                         # sealed: the snapshot is on disk
        state, meta = ckpt.restore(fresh_state, specs)      # the latest step
    """

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
                 on_sealed: Callable[[int, str], None] | None = None):
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self.on_sealed = on_sealed
        self.run_id = uuid.uuid4().hex
        self._async = async_save
        self._saver_obj = None
        self._loader = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
        self._in_flight: int | None = None
        self._beside: dict[str, bytes] = {}
        self._sealer: threading.Thread | None = None
        self._seal_error: BaseException | None = None
        self._rows: Future | None = None  # the tables' rows being written (async, process 0)
        self._lock = FolderLock(self.directory, run_id=self.run_id, error=CheckpointError,
                                hint="choose another snapshot_prefix")
        self._replace: set[int] = set()  # another run's steps this run may delete (--force)
        self.sealed: set[int] = set()  # steps this run wrote
        self._overwrite: set[int] = set()  # steps after the one this run resumed from

    @property
    def _saver(self):
        if self._saver_obj is None:  # made on first use, closed by finish()
            registry = _save_handlers()
            handler = (ocp.CompositeCheckpointHandler(handler_registry=registry) if registry
                       else ocp.CompositeCheckpointHandler())
            self._saver_obj = (ocp.AsyncCheckpointer(handler) if self._async
                               else ocp.Checkpointer(handler))
        return self._saver_obj

    # ---- listing ------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Finished checkpoints, oldest first."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(n) for n in os.listdir(self.directory)
                      if n.isdigit() and os.path.isdir(os.path.join(self.directory, n)))

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def best(self) -> dict | None:
        """Early stopping's record of the best evaluation (``best.json``: its step, metric and
        value), or None."""
        try:
            with open(os.path.join(self.directory, BEST), encoding="utf-8") as f:
                best = json.load(f)
        except (OSError, ValueError):
            return None
        return best if isinstance(best, dict) and isinstance(best.get("step"), int) else None

    def best_step(self) -> int | None:
        best = self.best()
        return None if best is None else best["step"]

    def mark_best(self, step: int, **info) -> None:
        """Record ``step`` as the best evaluation's snapshot (export takes it by default; the
        rotation keeps it)."""
        replace_json(os.path.join(self.directory, BEST), {"step": int(step), **info})

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _pending_dir(self, step: int) -> str:
        return os.path.join(self.directory, PENDING, str(step))

    # ---- ownership ----------------------------------------------------------------------

    @property
    def lock_path(self) -> str:
        return self._lock.path

    def lock_owner(self) -> dict | None:
        """The LOCK file's record, or None when the directory is not locked."""
        return self._lock.owner()

    def check_not_in_use(self) -> None:
        """Raise if another live run holds the directory (a stale lock does not count)."""
        self._lock.check_free()

    def acquire(self, report: Callable[[str], None] = print) -> None:
        """Own the directory for this run: create it, take ``LOCK`` (a stale lock of a process
        that is gone is reported and taken over) and remove what an earlier run left in flight.
        """
        if self._lock.held:
            return
        try:
            os.makedirs(os.path.join(self.directory, PENDING), exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{self.directory}: cannot create the checkpoint directory: "
                                  f"{e.strerror}") from e
        self._lock.acquire(report)
        atexit.register(self.finish)  # a save started from a notebook still completes
        pending = os.path.join(self.directory, PENDING)
        for name in sorted(os.listdir(pending)):
            report(f"[jctr] {self.directory}: removing the unfinished snapshot "
                   f"{PENDING}/{name} of a run that stopped during a save")
            shutil.rmtree(os.path.join(pending, name), ignore_errors=True)

    def release(self) -> None:
        """Give the directory up (the lock file is removed if it is still ours)."""
        self._lock.release()

    def replace_at_first_save(self, steps: list[int]) -> None:
        """``--force``: another run's checkpoints, deleted once this run's first is sealed."""
        self._replace = set(steps)

    def resumed_from(self, step: int) -> None:
        """This run continues ``step``: later checkpoints of the same run are replaced when the
        resumed run reaches their iteration again."""
        self._overwrite = {s for s in self.steps() if s > step}

    def check_writable(self, need_bytes: int) -> None:
        """Raise unless a file can be written here and ``need_bytes`` are free."""
        probe = os.path.join(self.directory, PENDING, f"probe-{self.run_id}")
        try:
            with open(probe, "wb") as f:
                f.write(b"jctr")
            os.remove(probe)
        except OSError as e:
            raise CheckpointError(f"{self.directory}: checkpoint directory is not writable: "
                                  f"{e.strerror}") from e
        free = shutil.disk_usage(self.directory).free
        if free < need_bytes:
            raise CheckpointError(
                f"{self.directory}: {format_bytes(free)} free, but one snapshot may need up "
                f"to {format_bytes(need_bytes)}; free some space or choose another "
                "snapshot_prefix")

    # ---- saving -------------------------------------------------------------------------

    def save(self, state: TrainState, specs: tuple[EmbeddingSpec, ...],
             meta: dict[str, Any] | None = None, placements=None,
             beside: dict[str, bytes] | None = None,
             tables: dict[str, dict[str, np.ndarray]] | None = None) -> int:
        """Start saving (asynchronously where Orbax allows) into ``.pending/<step>``; the
        snapshot is sealed and reported once complete. ``placements`` (from the sharding plan)
        says how tables are laid out; ``beside`` names small files written next to the
        checkpoint when it is sealed (``non_trainable_<step>.json``); ``tables``: the state's
        tables exported already (:func:`export_tables`; they must not change until the save
        is finished). Returns the step."""
        step = int(to_host(state.step))
        if tables is None:
            tables = export_tables(state, specs, placements)
        tables = {**tables, **_slot_layouts(state, specs)}
        info = {"format": FORMAT, "version": VERSION, "step": step,
                "tables": {s.name: {"rows": int(tables[s.name]["keys"].shape[0]), "dim": s.dim,
                                    "capacity": s.capacity, **_eviction_counts(s, e)}
                           for s, e in zip(specs, state.embeddings)},
                **(meta or {})}
        if not ROWS_BY_JCTR:
            # Orbax cannot store zero-size arrays: a table without keys (a snapshot before the
            # first step, or an input that never had a key) is stored as one zero row, and
            # meta's "rows" (0) says to drop it on restore
            tables = {name: {k: v if v.shape[0] else np.zeros((1, *v.shape[1:]), v.dtype)
                             for k, v in t.items()} for name, t in tables.items()}
            _no_host_copies()
        self.wait()  # one save in flight at a time
        if step in self.steps() and step not in self._replace | self._overwrite:
            raise CheckpointError(f"{self.step_dir(step)}: a checkpoint of iter {step} exists "
                                  "already")
        pending = self._pending_dir(step)
        if jax.process_index() == 0:
            self._remove_pending(step)  # ours: this run holds the lock
        self._in_flight, self._beside = step, dict(beside or {})
        items = {"dense": ocp.args.StandardSave(_dense_tree(state)),
                 "meta": ocp.args.JsonSave(info)}
        if not ROWS_BY_JCTR:
            items["tables"] = ocp.args.PyTreeSave(tables)
        try:
            if ROWS_BY_JCTR and jax.process_index() == 0:  # every process holds every row
                if self._async:
                    self._rows = _start(_write_rows, f"{pending}.{ROWS}", tables)
                else:
                    _write_rows(f"{pending}.{ROWS}", tables)
            self._saver.save(pending, args=ocp.args.Composite(**items))
        except BaseException as e:
            self._abandon()
            if isinstance(e, Exception):  # Ctrl-C and SIGTERM go on as themselves
                raise _not_written(pending, step, e) from e
            raise
        if jax.process_index() == 0 and self._async:
            self._seal_error = None
            self._sealer = threading.Thread(target=self._seal_when_written, daemon=True)
            self._sealer.start()
        return step

    def _seal_when_written(self) -> None:
        try:
            self._saver.wait_until_finished()
            self._seal()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread in wait()
            self._seal_error = e

    def _seal(self) -> None:
        """Integrity record into the finished pending folder, then rename it into place."""
        step = self._in_flight
        pending, final = self._pending_dir(step), self.step_dir(step)
        rows, self._rows = self._rows, None
        if rows is not None:  # written on a thread of their own
            rows.result()
        if os.path.isdir(f"{pending}.{ROWS}"):  # jctr's rows, beside Orbax's folder, move in
            os.rename(f"{pending}.{ROWS}", os.path.join(pending, ROWS))
        replace_json(os.path.join(pending, INTEGRITY), file_digests(pending))
        if os.path.isdir(final) and step in self._replace | self._overwrite:
            self._remove_step(step)
        # ours before it is visible: the main thread's next save may list the steps while this
        # thread renames, and must not take the new folder for another run's
        self.sealed.add(step)
        os.rename(pending, final)
        for name, data in self._beside.items():
            replace_file(os.path.join(self.directory, name), data)
        self._in_flight, self._beside = None, {}
        for old in sorted(self._replace):  # --force: the other run's checkpoints go now
            if old != step:
                self._remove_step(old)
        self._replace = set()
        best = self.best_step()
        for old in self.steps()[:-self.keep]:
            if old != best:  # early stopping's restored best outlives the rotation
                self._remove_step(old)
        if self.on_sealed is not None:
            self.on_sealed(step, final)

    def _remove_step(self, step: int) -> None:
        if step == self.best_step():  # the record must not name a snapshot that is gone
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.directory, BEST))
        shutil.rmtree(self.step_dir(step), ignore_errors=True)
        for name in (f"non_trainable_{step}.json", f"{step}.integrity.json"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.directory, name))

    def wait(self) -> None:
        """Finish the save in flight: wait for its files, seal it and report it. A save that
        failed (disk full, ...) is removed and raises :class:`CheckpointError`; so does an
        interruption while waiting (the unfinished snapshot is removed first)."""
        if self._in_flight is None:
            return
        step, pending = self._in_flight, self._pending_dir(self._in_flight)
        try:
            if self._sealer is not None:
                while self._sealer.is_alive():
                    self._sealer.join(0.1)
                self._sealer = None
                if self._seal_error is not None:
                    raise self._seal_error
            else:  # a synchronous save is on disk once save() returned
                if self._async:
                    self._saver.wait_until_finished()
                if jax.process_index() == 0:
                    self._seal()
            self._in_flight = None
        except BaseException as e:
            self._abandon()
            if isinstance(e, Exception):
                raise _not_written(pending, step, e) from e
            raise

    def _abandon(self) -> None:
        """Remove the unfinished snapshot in flight (the previous checkpoints stay)."""
        step, self._in_flight, self._sealer = self._in_flight, None, None
        rows, self._rows = self._rows, None
        if rows is not None:  # its files must not be written into a folder being removed
            with contextlib.suppress(BaseException):
                rows.result()
        if step is None or jax.process_index() != 0:
            return
        self._remove_pending(step)

    def _remove_pending(self, step: int) -> None:
        """``.pending/<step>`` and Orbax's temporary folders beside it."""
        pending = os.path.join(self.directory, PENDING)
        with contextlib.suppress(OSError):
            for name in os.listdir(pending):
                if name == str(step) or name.startswith(f"{step}."):
                    shutil.rmtree(os.path.join(pending, name), ignore_errors=True)

    def finish(self, report: Callable[[str], None] = print) -> None:
        """On any exit: finish the snapshot in flight (or remove it and say so), then release
        the directory. Never raises for the snapshot; the caller's own error goes on."""
        step = self._in_flight
        try:
            self.wait()
        except BaseException as e:  # noqa: BLE001 - reported, the exit goes on
            report(f"[jctr] snapshot of iter {step} was not written "
                   f"({_first_line(e) or type(e).__name__}); the earlier checkpoints are kept")
        finally:
            self.release()
            saver, self._saver_obj = self._saver_obj, None
            if saver is not None:  # its threads must not outlive the run (exit aborts)
                with contextlib.suppress(Exception):
                    saver.close()

    # ---- reading ------------------------------------------------------------------------

    def _integrity_record(self, step: int) -> dict | None:
        for path in (os.path.join(self.step_dir(step), INTEGRITY),
                     os.path.join(self.directory, f"{step}.integrity.json")):  # version 1
            if os.path.exists(path):
                try:
                    with open(path, encoding="utf-8") as f:
                        return json.load(f)
                except (OSError, json.JSONDecodeError) as e:
                    raise CheckpointError(f"{path}: integrity record unreadable: {e}") from e
        return None

    def verify(self, step: int) -> None:
        """Raise :class:`CheckpointError` naming the first missing or damaged file."""
        expected = self._integrity_record(step)
        root = self.step_dir(step)
        if expected is None:
            if self._version(step) >= 2:
                raise CheckpointError(f"{root}/{INTEGRITY}: missing; the checkpoint cannot be "
                                      "checked for damage")
            return  # version 1, sealed late: Orbax's own checks only
        check_files(root, expected, CheckpointError, "checkpoint")

    def _version(self, step: int) -> int:
        try:
            return int(self.read_meta(step).get("version", 1))
        except CheckpointError:
            return VERSION

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self._pick(step)
        path = os.path.join(self.step_dir(step), "meta", "metadata")
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: checkpoint metadata unreadable: {e}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT \
                or meta.get("version", 0) > VERSION:
            raise CheckpointError(f"{path}: not a jctr checkpoint of version <= {VERSION}")
        return meta

    def _pick(self, step: int | None) -> int:
        self.wait()
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"{self.directory}: no complete checkpoint found")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"{self.directory}: no checkpoint for step {step}; "
                                  f"available: {steps}")
        return step

    def restore(self, fresh: TrainState, specs: tuple[EmbeddingSpec, ...],
                step: int | None = None, placements=None) -> tuple[TrainState, dict[str, Any]]:
        """Restore ``step`` (default: the latest complete one) onto a freshly built state.

        Table rows are re-inserted by key; rows never used keep ``fresh``'s initial values,
        which is what an uninterrupted run would have had.
        """
        step = self._pick(step)
        self.verify(step)
        meta = self.read_meta(step)
        where = self.step_dir(step)
        by_jctr = os.path.isdir(os.path.join(where, ROWS))  # version 3; 2 kept an Orbax item
        for item in ("dense",) if by_jctr else ("dense", "tables"):
            if not os.path.isdir(os.path.join(where, item)):
                raise CheckpointError(f"{os.path.join(where, item)}: missing checkpoint item")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _dense_tree(fresh))
        if fresh.opt_state is None:  # a model without its optimizer (export, serving)
            target["opt_state"] = self._stored_opt_state(where, fresh)
        items = {"dense": ocp.args.StandardRestore(target)}
        if not by_jctr:
            items["tables"] = ocp.args.StandardRestore()
        try:
            restored = self._loader.restore(where, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise many kinds
            raise CheckpointError(f"{where}: checkpoint cannot be restored "
                                  f"({type(e).__name__}: {_first_line(e)})") from e
        dense = restored["dense"]
        tables = read_rows(os.path.join(where, ROWS)) if by_jctr else restored["tables"]
        embeddings = []
        placements = placements or (None,) * len(specs)
        for spec, es, placement in zip(specs, fresh.embeddings, placements):
            if spec.name not in tables:
                raise CheckpointError(f"{where}/tables: no table \"{spec.name}\"; stored: "
                                      f"{sorted(tables)}")
            rows = meta.get("tables", {}).get(spec.name, {}).get("rows")
            stored = {k: np.asarray(v)[:rows] for k, v in tables[spec.name].items()}
            if spec.eviction is not None and spec.eviction.spill:  # spilled rows to the database
                from jctr.embedding import spill

                stored = spill.restore_spilled(spec, stored, held_here(
                    spec, es, stored, placement, source=f"{where}/tables"))
            try:
                es = import_placed(spec, es, stored, placement, source=f"{where}/tables")
            except ValueError as e:
                raise CheckpointError(str(e)) from e
            layout = tables.get(LAYOUT_PREFIX + spec.name)
            if spec.eviction is not None and layout is not None:
                es = restore_layout(es, np.asarray(layout["slot_keys"]))
            saved = meta.get("tables", {}).get(spec.name, {})
            embeddings.append(_with_eviction_counts(spec, es, saved))
        state = TrainState(step=dense["step"], rng=dense["rng"], params=dense["params"],
                           batch_stats=dense["batch_stats"],
                           opt_state=None if fresh.opt_state is None else dense["opt_state"],
                           embeddings=tuple(embeddings), lr_scale=fresh.lr_scale)
        return state, meta

    @staticmethod
    def _stored_opt_state(where: str, fresh: TrainState):
        """The dense optimizer state's shapes as stored, placed like ``fresh.step``: restoring
        a model needs no optimizer of its own, on any device count."""
        from etils import epath

        try:
            stored = ocp.StandardCheckpointHandler().metadata(epath.Path(where) / "dense")
        except Exception as e:  # noqa: BLE001 - Orbax raises many kinds
            raise CheckpointError(f"{where}/dense: checkpoint metadata unreadable "
                                  f"({type(e).__name__}: {_first_line(e)})") from e
        sharding = fresh.step.sharding if isinstance(fresh.step, jax.Array) else None
        return jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
            dict(stored)["opt_state"])

    def close(self) -> None:
        self.finish()


ROWS_BY_JCTR = True  # False: the tables in an Orbax item, as version 2 wrote them (tests)


def _write_rows(folder: str, tables: dict[str, dict[str, np.ndarray]]) -> None:
    """Every table's arrays as headerless little-endian files under ``folder`` (``<i>/<j>``:
    the ``j``-th array of the ``i``-th table; names, dtypes and shapes in ``index.json``), so
    that a model file holding the same bytes can be a link to one (:func:`read_rows`). Large
    ones go past the page cache; each is synced and its CRC-32 noted for the integrity record
    (no reading back)."""
    os.makedirs(folder)
    index = {}
    for i, (name, arrays) in enumerate(tables.items()):
        os.makedirs(os.path.join(folder, str(i)))
        files = {}
        for key, arr in arrays.items():
            rel = f"{i}/{len(files)}"
            arr = np.ascontiguousarray(arr, np.asarray(arr).dtype.newbyteorder("<"))
            path = os.path.join(folder, rel)
            note_written(path, *write_file(path, arr.reshape(-1).view(np.uint8)))
            files[key] = {"file": rel, "dtype": arr.dtype.str, "shape": list(arr.shape)}
        index[name] = files
    replace_json(os.path.join(folder, "index.json"), {"tables": index})


def read_rows(folder: str, *, mmap: bool = False) -> dict[str, dict[str, np.ndarray]]:
    """The tables a checkpoint's ``rows/`` folder holds (by name, then array name); ``mmap``:
    read-only memory maps of the files (a model file written from one of them may be a link
    to it: :func:`jctr.checkpoint.model_files.write_sparse_model`). The checkpoint's integrity
    record is checked by :meth:`Checkpointer.restore`, not here."""
    index_path = os.path.join(folder, "index.json")
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)["tables"]
        out = {name: {key: (os.path.join(folder, ent["file"]), np.dtype(ent["dtype"]),
                            tuple(int(d) for d in ent["shape"]))
                      for key, ent in files.items()} for name, files in index.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: the tables' index is unreadable ({e})") from None
    tables = {}
    for name, files in out.items():
        tables[name] = {}
        for key, (path, dtype, shape) in files.items():
            size = int(np.prod(shape)) * dtype.itemsize
            try:
                if os.path.getsize(path) != size:
                    raise ValueError(f"{os.path.getsize(path)} bytes, expected {size}")
                if mmap and size:
                    arr = np.memmap(path, dtype, "r", shape=shape)
                else:
                    arr = np.fromfile(path, dtype, int(np.prod(shape))).reshape(shape)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{path}: table \"{name}\" array \"{key}\" unreadable "
                                      f"({e})") from None
            tables[name][key] = arr
    return tables


def _start(fn: Callable, *args) -> Future:
    """``fn(*args)`` on a thread of its own; its result or error in the future."""
    job: Future = Future()

    def run() -> None:
        try:
            job.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
            job.set_exception(e)

    threading.Thread(target=run, daemon=True, name="jctr-checkpoint-rows").start()
    return job


def _not_written(pending: str, step: int, cause: BaseException) -> CheckpointError:
    text = str(cause)
    if isinstance(cause, OSError) and cause.strerror:
        what = cause.strerror
    elif "No space left on device" in text or "os_error_code='28'" in text:
        what = "No space left on device"  # TensorStore's wording of ENOSPC
    else:
        what = f"{type(cause).__name__}: {_first_line(cause)}"
    where = getattr(cause, "filename", None) or os.path.dirname(os.path.dirname(pending))
    return CheckpointError(f"{where}: snapshot of iter {step} not written ({what}); the earlier "
                           "checkpoints are kept")


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:400] if text else ""
