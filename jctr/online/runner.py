"""Streaming training, pass by pass: ``python -m jctr.online --config online.yaml``.

For each day from ``start_day`` to ``end_day`` and each pass of the day (``split_per_pass``
folders of ``split_interval`` minutes), the runner waits for every folder's ``data_donefile``,
lists the pass's data files (any format the model's Data layer reads), trains one epoch of them
with the model's :class:`jctr.train.trainer.Trainer` (one compiled step for the whole run),
scores the model's validation set, and prints one line per pass: day, pass, files, iterations,
samples/s, loss, pass AUC (of the pass's training predictions, from bucketed counts summed over
every process) and validation metrics, and appends it to ``passes.jsonl``. In a
``jax.distributed`` run (``scripts/launch_local.sh``, or ``JCTR_COORDINATOR`` and friends)
each process reads its share of the pass's files. Every key's show and click are counted as
the batches are read (:mod:`jctr.online.feature_stats`, ``table_parameters``); at the end of
each day the shrink decays them and deletes keys from the statistics and the tables, freeing
their rows. Each checkpoint has ``feature_stats.npz`` beside it and is then named in
``progress.json``; a run started again resumes at the pass after that checkpoint.

Saves, with PaddlePaddle's names: a checkpoint ``<save_model_path>/<day>/<pass>/`` every
``checkpoint_per_pass`` passes; after each day's shrink the batch model ``<next day>/0/`` (a
checkpoint) and the inference base model ``<next day>/base/``; every ``save_delta_frequency``
passes an inference delta model ``<day>/delta-<pass>/``. Base and delta models are jctr
inference bundles (:mod:`jctr.serving.bundle`) holding the dense model and the rows of the keys
the ``table_parameters`` filters keep; the ``converter`` hook is called with each. A
parameter-server file naming a day's base as ``bundle`` and its deltas in order as ``deltas``
serves the trained model (``python -m jctr.serve load`` writes only the deltas a database
lacks).

Example::

    run = OnlineRun(load_online_config("online.yaml"))
    run.run()          # until end_day's last pass
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from jctr.config.online import OnlineConfig, ShowClickEntry
from jctr.config.reader import ConfigError
from jctr.config.schema import column_ref
from jctr.data.records import DataError, write_file_list
from jctr.online.feature_stats import FeatureStats, ScoreRule, ShrinkRule
from jctr.online.schedule import data_files, days, next_day, pass_folders, wait_ready
from jctr.ops.host_sort import take_rows, unique
from jctr.runtime.direct_io import DirectWriter, replace_file, replace_json, replacing
from jctr.runtime.host_memory import room_left
from jctr.sharding.plan import PlanError, format_bytes
from jctr.sharding.rows import drop_keys, export_placed, put_rows, scale_slot
from jctr.train.datasets import open_training_set
from jctr.train.hooks import Hook, PredictionCounts
from jctr.train.metrics import bucket_auc
from jctr.train.publisher import KafkaPublisher

PROGRESS = "progress.json"
PASS_LOG = "passes.jsonl"  # one JSON record per trained pass
STATS_FILE = "feature_stats.npz"  # beside each checkpoint: whole, or the changes since the day's


class OnlineRun:
    """One streaming-training run (see the module docstring)."""

    REPORT_EVERY_S = 600.0  # the run's report.html at most this often (and at each day's end)

    def __init__(self, cfg: OnlineConfig, *, log: Callable[[str], None] | None = None,
                 stop: threading.Event | None = None, force: bool = False):
        self.cfg = cfg
        self.force = force  # take over a sparse_store another run owns (its rows are erased)
        self.log = log or _print
        self.stop = stop or threading.Event()
        try:
            self.passes = pass_folders(cfg.split_interval, cfg.split_per_pass,
                                       hourly=cfg.is_data_hourly_placed)
            self.days = days(cfg.start_day, cfg.end_day)
        except DataError as e:
            raise ConfigError("schedule", str(e), cfg.source) from None
        # what can be wrong is said now, not after a wait for data that will never come
        from jctr.config.parser import load_config

        self.model = load_config(cfg.model)
        if not os.path.isdir(cfg.train_data_dir):
            raise ConfigError("train_data_dir", f"{cfg.train_data_dir}: no such folder (the "
                              "stream's <YYYYMMDD>/<HHMM>/ folders live there; "
                              "`python -m jctr.online.synthetic_stream --config ...` writes an "
                              "example)", cfg.source)
        self.trainer = None
        self.pass_auc = PredictionCounts()  # the pass AUC's counts, from the train steps
        self.passes_trained = 0
        tp = cfg.table_parameters
        self._score = ScoreRule(nonclk_coeff=tp.nonclk_coeff, click_coeff=tp.click_coeff)
        self._shrink = ShrinkRule(show_click_decay_rate=tp.show_click_decay_rate,
                                  delete_threshold=tp.delete_threshold,
                                  delete_after_unseen_days=tp.delete_after_unseen_days)
        self.stats: list[FeatureStats] = []  # per embedding table, once the trainer exists
        # the day's whole statistics (its batch model's file, relative to save_model_path,
        # and each table's rows in it): a pass's checkpoint saves the changes since
        self._stats_base: tuple[str, list[int]] | None = None
        self._converter = _converter(cfg)
        self.store = None  # the row database (sparse_store), once the trainer exists
        self._pulled: list[dict] = []
        self._eval_keys: list[np.ndarray] = []
        # sparse_store, one process: the last pass's rows as written back, and the stored
        # rows of the next pass's other keys, read while this pass trains (_pull_ahead)
        self._written: list[dict] = []
        self._wanted: list = []  # the KeySets of the keys the last pass pulled
        # per table, _last_written's place of each pulled key among _written (found once for
        # the pass's models and the next pull: a find of every written key, ~0.3 s a pass)
        self._written_at: dict[int, np.ndarray] = {}
        self._ahead: Future | None = None
        # the next pass's rows joined from those two on the store thread while this pass's
        # checkpoint is written (_join_ahead)
        self._joined: Future | None = None
        # ... and its write-back, written on the store thread once the next pass has its
        # rows (_deferred, then _behind), with the checkpoint that waits for it to be
        # recorded (_settle)
        self._pool: ThreadPoolExecutor | None = None
        self._deferred: tuple | None = None
        self._behind: Future | None = None
        # a day's last pass: the stored rows of the keys it does not hold, read meanwhile for
        # the day's base model (_read_unheld)
        self._unheld: Future | None = None
        self._ahead_ok = True  # room to read a pass's rows ahead (_plan_store_memory)
        self._store_copies = 0  # host bytes planned for a pass's rows (_plan_store_memory)
        self._unrecorded: tuple | None = None

    # -- where a run stands ---------------------------------------------------------------
    def progress(self) -> dict | None:
        """The last checkpoint's record (day, pass, step, checkpoint), or None."""
        path = os.path.join(self.cfg.save_model_path, PROGRESS)
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
            # relative to the run folder (a moved folder resumes where it is); older records
            # hold absolute paths
            checkpoint = os.path.join(self.cfg.save_model_path, str(record["checkpoint"]))
            return {"day": str(record["day"]), "pass": int(record["pass"]),
                    "step": int(record["step"]), "checkpoint": checkpoint,
                    "day_end": bool(record.get("day_end", False))}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: unreadable progress record ({e}); move it away to start "
                            "over") from None

    def _write_progress(self, day: str, n: int, step: int, checkpoint: str,
                        day_end: bool) -> None:
        replace_json(os.path.join(self.cfg.save_model_path, PROGRESS),
                     {"day": day, "pass": n, "step": step,
                      "checkpoint": os.path.relpath(checkpoint, self.cfg.save_model_path),
                      "day_end": day_end})

    def _record(self, record: dict) -> None:
        """One line of ``<save_model_path>/passes.jsonl`` (process 0)."""
        import jax

        if jax.process_index() != 0:
            return
        def clean(v):  # NaN (e.g. an AUC of one class) is not JSON
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            return None if isinstance(v, float) and not math.isfinite(v) else v

        with open(os.path.join(self.cfg.save_model_path, PASS_LOG), "a", encoding="utf-8") as f:
            f.write(json.dumps(clean(record), allow_nan=False) + "\n")

    def _supersede_records(self, done: dict) -> None:
        """Records of passes after the checkpoint resumed from (trained by a run that stopped
        before their checkpoint) get ``"superseded": true``: the pass is trained again and
        its new record is the one that counts."""
        import jax

        path = os.path.join(self.cfg.save_model_path, PASS_LOG)
        if jax.process_index() != 0 or not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        out, changed = [], 0
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut by a crash: kept as it is, readers skip it
                out.append(line)
                continue
            key = (str(record.get("day")), int(record.get("pass", 0)))
            if key > (done["day"], done["pass"]) and not record.get("superseded"):
                record["superseded"] = True
                changed += 1
                line = json.dumps(record)
            out.append(line)
        if changed:
            replace_file(path, ("\n".join(out) + "\n").encode())
            self.log(f"[jctr] {PASS_LOG}: {changed} record(s) of passes after the checkpoint "
                     "marked superseded (they are trained again)")

    def _todo(self, done: dict | None) -> list[tuple[str, int]]:
        """(day, pass number) still to train, in order."""
        todo = [(d, n) for d in self.days for n in range(1, len(self.passes) + 1)]
        if done is not None:
            todo = [(d, n) for d, n in todo if (d, n) > (done["day"], done["pass"])]
        return todo

    # -- training -------------------------------------------------------------------------
    def _trainer(self):
        """The model's Trainer for one epoch of each pass's files (one compiled step for the
        whole run), with the streaming settings over the model's config."""
        import jax

        from jctr.config import override_embedding_optimizers, override_solver
        from jctr.data.tools.synthetic import generate_for_config
        from jctr.sharding.distributed import all_processes
        from jctr.train.trainer import Trainer

        model = self.model
        tp = self.cfg.table_parameters
        solver = {"max_iter": None, "num_epochs": 1, "snapshot": 0}
        if self.cfg.kafka_sink is not None:  # published after every pass (end of each fit)
            solver["kafka_sink"] = self.cfg.kafka_sink
        model = override_solver(model, solver)
        # a show column: SparseAdaGradSGDRule divides by the pushed shows, as Paddle's
        show = ({"show": tp.show_click_entry.show}
                if isinstance(tp.show_click_entry.show, str) else {})
        if tp.embed_sgd_param is not None:  # every table trains with SparseAdaGradSGDRule
            model = override_embedding_optimizers(model, {
                "type": "SparseAdaGradSGDRule",
                "embed_sgd_param": _rule_json(tp.embed_sgd_param),
                "embedx_sgd_param": _rule_json(tp.embedx_sgd_param),
                "embedx_threshold": tp.embedx_threshold,
                "click_coeff": tp.click_coeff, "nonclk_coeff": tp.nonclk_coeff, **show})
        elif show:
            model = override_embedding_optimizers(model, show,
                                                  merge_into="SparseAdaGradSGDRule")
        for e in model.embeddings:  # Paddle's derived sizes, where the file gives them
            if e.eviction is not None and e.eviction.spill:
                raise ConfigError("model", f"embedding \"{e.name}\" spills evicted rows "
                                  "(eviction.spill), which the core trainer does; streaming "
                                  "training keeps rows beyond memory in sparse_store (its "
                                  "passes pull and push them): drop \"spill\" from the "
                                  "model or use sparse_store", self.cfg.source)
            want = {"embedx_dim": e.embedding_vec_size - 1,
                    "fea_dim": e.embedding_vec_size + 2}
            for key, value in want.items():
                given = getattr(tp, key)
                if given is not None and given != value:
                    raise ConfigError(f"table_parameters.{key}", f"{given}, but embedding "
                                      f"\"{e.name}\" has embedding_vec_size "
                                      f"{e.embedding_vec_size}, which makes it {value}",
                                      self.cfg.source)
        # the validation set, generated as the core trainer does where the model says how
        all_processes(lambda: generate_for_config(model, sets=("eval_source",))
                      if jax.process_index() == 0 else None, "generate the validation data")
        return Trainer(model, log=self.log, generate_data=False, hooks=[self.pass_auc])

    def run(self) -> int:
        """Train every pass still to do; returns the number trained now. The run owns
        ``save_model_path`` meanwhile (its ``LOCK``: another run of it is refused)."""
        import jax

        from jctr.runtime.folder_lock import FolderLock

        lock = FolderLock(self.cfg.save_model_path, hint="or give this one another "
                          "save_model_path")
        try:
            if jax.process_index() == 0:  # one lock for the run's processes
                lock.acquire(report=self.log)
            trained = self._run()
            if self.trainer is not None:
                from jctr.train.hooks import end_run

                self.trainer.run_log.write_report(force=True)  # what came since the last
                end_run(self.trainer.hooks)  # e.g. the Kafka sink's last delivery
            return trained
        finally:
            if self.store is not None:
                self.store.close()
                self.store = None
            for st in self.stats:  # mapped statistics: their files (still readable)
                st.close()
            lock.release()

    def _run(self) -> int:
        if self.cfg.sparse_store:
            self._store_path()  # a store of another process count: refused before compiling
        os.makedirs(self.cfg.save_model_path, exist_ok=True)
        done = self.progress()
        todo = self._todo(done)
        lists = os.path.join(self.cfg.save_model_path, "_passes")
        os.makedirs(lists, exist_ok=True)
        if done is not None:
            self.log(f"[jctr] resuming after day {done['day']} pass {done['pass']} (iter "
                     f"{done['step']}, {done['checkpoint']})")
            self._supersede_records(done)
            if done["pass"] == len(self.passes) and not done["day_end"]:
                # stopped between the day's last checkpoint and its shrink and saves
                self._start(done)
                self._end_day(done["day"])
        if not todo:
            self.log(f"[jctr] nothing to train: every pass up to {self.cfg.end_day} is done")
            return 0
        first = os.path.join(self.cfg.train_data_dir, todo[0][0])
        if not os.path.isdir(first):  # a wrong day or folder: not a wait that never ends
            raise DataError(f"{first}: no such day folder, and the run starts with day "
                            f"{todo[0][0]} pass {todo[0][1]}; only a done-file in an existing "
                            "day folder is waited for at start (later days' folders are "
                            "waited for as they come)")
        pool = _background("jctr-prefetch") if self.cfg.prefetch else None
        # the database's work (write-backs, reads ahead) on a thread of its own, in the order
        # given, so that the next pass's data is read meanwhile: a read ahead of rows waited
        # for the last pass's write-back and then for the data read after it
        store_pool = _background("jctr-store") if self.cfg.prefetch else None
        halt = threading.Event()  # ends a prefetch that waits for data when the run ends
        ahead: Future | None = None
        self._pool = store_pool
        try:
            for i, (day, n) in enumerate(todo):
                if ahead is not None:  # read while the previous pass trained
                    t0 = time.perf_counter()
                    while not ahead.done():
                        if self.stop.wait(0.05):
                            raise InterruptedError(f"stopped while waiting for day {day} pass "
                                                   f"{n}'s data")
                    data = ahead.result()
                    data["rows_ahead"] = self._rows_ahead()
                    data["wait_s"] = time.perf_counter() - t0
                else:
                    data = self._pass_data(lists, day, n, self.stop, read=False)
                if self.trainer is None:
                    self._start(done)
                ahead = None
                if pool is not None and i + 1 < len(todo):
                    ahead = pool.submit(self._pass_data, lists, *todo[i + 1], halt, read=True)
                    # the next pass's stored rows too, after this pass's pull (same day: the
                    # day's end erases and decays rows)
                    if self._pulls_ahead() and todo[i + 1][0] == day:
                        data["next"] = (ahead, halt)
                self._train_pass(day, n, data)
        except BaseException:
            halt.set()
            # a write-back in flight ends before the database closes; its checkpoint is
            # recorded if it succeeded (that pass is complete, whatever stopped this one). One
            # not started whose pass has no checkpoint is dropped: the database stays as the
            # last checkpoint has it
            with contextlib.suppress(BaseException):
                if self._unrecorded is None:
                    self._deferred = None
                self._settle()
            raise
        else:
            self._settle()
        finally:
            halt.set()
            self._pool = None
            for executor in (pool, store_pool):
                if executor is not None:
                    executor.shutdown(wait=False, cancel_futures=True)
            self._rows_ahead()  # a read of the database in flight ends before it closes
            self._take_joined()
            self._take_unheld()
        return self.passes_trained

    def _pass_data(self, lists: str, day: str, n: int, stop: threading.Event, *,
                   read: bool) -> dict:
        """Waits for the pass's done-files, lists its files; with ``read`` (the prefetch,
        once the trainer exists) also reads this process's share into memory."""
        folders = [os.path.join(self.cfg.train_data_dir, day, f) for f in self.passes[n - 1]]
        wait_ready(folders, self.cfg.data_donefile, sleep_s=self.cfg.data_sleep_second,
                   stop=stop, report=self.log)
        t0 = time.perf_counter()
        files = data_files(folders, self.cfg.data_donefile)
        if not files:
            raise DataError(f"{', '.join(folders)}: no data files in the pass's folders")
        file_list = self._file_list(lists, day, n)
        write_file_list(file_list, files)
        dataset = keys = None
        uncached = 0
        if read and self.trainer is not None:
            dataset = open_training_set(self.trainer.cfg, file_list)
            # what does not fit beside the run (the pass training now holds its own data) is
            # read from its files as the pass trains
            units = len(dataset.host_units())
            uncached = units - dataset.cache_all(self._busy_bytes())
            if self.cfg.sparse_store:
                keys = self._working_keys(dataset)
        return {"files": len(files), "list": file_list, "dataset": dataset, "keys": keys,
                "read_s": time.perf_counter() - t0 if dataset is not None else None,
                "wait_s": None, "uncached": uncached}

    @staticmethod
    def _file_list(folder: str, day: str, n: int) -> str:
        """The pass's file list (each process writes its own; the reader takes the
        process's share of the files)."""
        import jax

        mine = f".p{jax.process_index()}" if jax.process_count() > 1 else ""
        return os.path.join(folder, f"{day}_{n:04d}{mine}.txt")

    def _start(self, done: dict | None) -> None:
        """The trainer and statistics, from the last checkpoint."""
        self.trainer = self._trainer()
        for hook in self.trainer.hooks:  # with sparse_store a pass's rows are on the device
            if isinstance(hook, KafkaPublisher):
                hook.partial = self.cfg.sparse_store is not None
        # a pass is a fit: its report (the whole log read) at most every REPORT_EVERY_S, and
        # at each day's end and the run's
        self.trainer.run_log.report_every_s = self.REPORT_EVERY_S
        self._start_statistics()
        if done is not None:
            folder = os.path.dirname(done["checkpoint"])
            self.trainer.restore_checkpoint(directory=folder)
            self._load_statistics(folder, done["day_end"])
        if self.cfg.sparse_store:
            self._open_store(done)

    # -- tables larger than memory (sparse_store) ------------------------------------------
    def _open_store(self, done: dict | None) -> None:
        """The row database; a write-back that its checkpoint never followed is undone. With
        several processes each holds its part of the keys (by key hash) in its own database,
        ``<path>/process-<i>-of-<n>``: every process opens, checks and owns its part, and all
        stop together when one cannot."""
        import jax

        from jctr.sharding.distributed import all_processes

        if jax.process_count() > 1:  # process 0 records the run; the others then read it
            all_processes(lambda: self._run_id() if jax.process_index() == 0 else None,
                          "record the run")
        all_processes(lambda: self._open_own_store(done), "open their part of the "
                      "sparse_store")
        self._eval_keys = [s.keys() for s in self._working_keys(self.trainer.data.eval)]
        all_processes(self._plan_store_memory, "fit a pass's sparse_store rows in memory")

    STATS_IN_MEMORY_SHARE = 0.25
    """The share of the memory left beside the step (at the start) the feature statistics
    of all tables keep in memory; past it, mapped files (:class:`FeatureStats`)."""

    # copies of a pass's rows on the host beside the tables (measured: ~4.4 working sets at
    # the peak with the read ahead, docs/performance.md): with the read ahead the pass's
    # pulled rows kept for its undo, the last pass's written rows, the next pass's rows read
    # ahead and their join; without it the pulled rows and the written ones
    _COPIES_AHEAD, _COPIES = 5, 2

    def _busy_bytes(self) -> int:
        """What data kept in memory on the side (a pass read ahead, a base model's rows) must
        leave room for: the step's peak beyond the state and, with sparse_store, its planned
        copies of a pass's rows (counted whole, though some may be in memory already)."""
        return self.trainer.memory_plan.transient + self._store_copies

    def _plan_store_memory(self) -> None:
        """The host memory a pass's rows take beside the planned step, at most a full table's
        rows a copy (a pass's keys must fit the table), printed and checked: where the copies
        of reading ahead do not fit, passes read their rows when they start; where not even
        those fit, the run is refused with the figures."""
        t = self.trainer
        per_copy = sum(spec.capacity * t.placed.local_devices() * self.store.row_bytes(i)
                       for i, spec in enumerate(t.specs))
        room = room_left(t.memory_plan.transient)
        least = self._COPIES
        copies = self._COPIES_AHEAD if self._pulls_ahead() else least
        if room is not None and copies * per_copy > room:
            if least * per_copy > room:
                raise PlanError(f"sparse_store: a pass's rows need up to {least} x "
                                f"{format_bytes(per_copy)} = {format_bytes(least * per_copy)} "
                                "of host memory beside the training step, and "
                                f"{format_bytes(max(room, 0))} are to spare: lower the tables' "
                                "max_vocabulary_size_per_gpu (a pass's keys must fit them)")
            self._ahead_ok, copies = False, least
            self.log("[jctr] sparse_store: no room to read a pass's rows ahead beside the "
                     "run; each pass reads them when it starts")
        self._store_copies = copies * per_copy
        spare = "" if room is None else f"; {format_bytes(room)} to spare"
        self.log(f"[jctr] sparse_store memory plan: a pass's rows beside the tables, up to "
                 f"{copies} x {format_bytes(per_copy)} (a full table's stored rows) = "
                 f"{format_bytes(copies * per_copy)}{spare}")

    def _store_path(self) -> str:
        """This process's database: the path itself for one process, else its part's folder
        under it; a store written with another number of processes is refused (its keys are
        split another way)."""
        import glob

        import jax

        path, count = self.cfg.sparse_store, jax.process_count()
        parts = sorted(glob.glob(os.path.join(glob.escape(path), "process-*-of-*")))
        other = [p for p in parts if not p.endswith(f"-of-{count}")] if count > 1 else parts
        from jctr.stores.row_file import MARKER

        whole = count > 1 and any(os.path.exists(os.path.join(path, name))
                                  for name in ("CURRENT", MARKER))
        if other or whole:
            found = os.path.basename(other[0]) if other else "one process's database"
            raise ConfigError("sparse_store", f"{path} holds {found}, written by a run of "
                              f"another number of processes than this one's {count}: its "
                              "keys are split another way; run with as many processes as "
                              "wrote it, or give this run another sparse_store path",
                              self.cfg.source)
        if count == 1:
            return path
        return os.path.join(path, f"process-{jax.process_index()}-of-{count}")

    def _open_own_store(self, done: dict | None) -> None:
        from jctr.online.row_store import RowStore

        t = self.trainer
        shapes = [{name: tuple(arr.shape[1:]) for name, arr in es.slots.items()}
                  for es in t.state.embeddings]
        self.store = RowStore(self._store_path(), t.specs, shapes, self.cfg.sparse_store_type)
        self._own_store(done)
        undo_dir = self._undo_dir()
        os.makedirs(undo_dir, exist_ok=True)
        last = (done["day"], done["pass"]) if done is not None else ("", 0)
        for name in sorted(os.listdir(undo_dir)):
            path = os.path.join(undo_dir, name)
            if RowStore.marker_of(path) > last:  # written back after the last checkpoint
                day, n = self.store.undo(path)
                self.log(f"[jctr] sparse_store: put back the rows day {day} pass {n} wrote "
                         "after the last checkpoint")
            os.remove(path)

    def _own_store(self, done: dict | None) -> None:
        """The row database belongs to one run (``run.json`` in its save_model_path names it):
        another run's store is refused, or taken over and emptied with ``force``; a store
        without an owner is this run's when the run resumes, else refused if it holds rows."""
        store, owner = self.store, self.store.owner()
        me = self._run_id()
        if owner is not None and owner.get("run") == me:
            return
        held = sum(store.size(i) for i in range(len(store.names)))
        if owner is None and (held == 0 or done is not None):
            store.set_owner(me, self.cfg.save_model_path)
            return
        whose = (f"the streaming run at {owner.get('save_model_path')}" if owner is not None
                 else "rows of a run that did not record itself")
        if not self.force:
            raise ConfigError("sparse_store", f"{self.cfg.sparse_store} holds {whose} "
                              f"({held:,} rows); a store belongs to one run, and this one "
                              f"({self.cfg.save_model_path}) would train from its rows: give "
                              "it another sparse_store path, or pass --force to empty it and "
                              "take it over", self.cfg.source)
        self.log(f"[jctr] sparse_store: {self.cfg.sparse_store} held {whose}; --force: "
                 f"emptied ({held:,} rows) and taken over")
        store.clear()
        store.set_owner(me, self.cfg.save_model_path)

    def _run_id(self) -> str:
        """This run's id (``<save_model_path>/run.json``, written on first use)."""
        import uuid

        path = os.path.join(self.cfg.save_model_path, "run.json")
        try:
            with open(path, encoding="utf-8") as f:
                return str(json.load(f)["run"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: unreadable run record ({e})") from None
        run = uuid.uuid4().hex
        replace_json(path, {"run": run})
        return run

    def _undo_dir(self) -> str:
        import jax

        mine = f".p{jax.process_index()}" if jax.process_count() > 1 else ""
        return os.path.join(self.cfg.save_model_path, "_store_undo" + mine)

    @staticmethod
    def _mine(keys: np.ndarray) -> np.ndarray:
        """The keys whose rows this process's database holds (all of them for one process)."""
        from jctr.sharding.distributed import process_owns

        owns = process_owns(keys)
        return keys if owns is None else keys[owns]

    @staticmethod
    def _everyones(stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every process's part of some stored rows, ordered by key (so that a table takes
        them in the order one process would: the same rows for the same keys)."""
        from jctr.sharding.distributed import gather_rows

        parts = gather_rows(stored)
        if len(parts) == 1:
            return stored
        whole = {name: np.concatenate([p[name] for p in parts]) for name in stored}
        order = np.argsort(whole["keys"], kind="stable")
        return {name: arr[order] for name, arr in whole.items()}

    def _store_rows(self, i: int, keys: np.ndarray) -> dict[str, np.ndarray]:
        """The stored rows of those of ``keys`` the database holds, from every process's
        part (after the last pass's write-back)."""
        self._written_back()
        return self._everyones(self.store.pull(i, self._mine(np.asarray(keys, np.int64))))

    def _working_keys(self, dataset) -> list:
        """Distinct keys per table of a dataset (this process's share) with the validation
        set's (:class:`jctr.ops.host_index.KeySet`: in the order they come, no sort of
        millions of keys): what a pass pulls, gathered where its data is read."""
        from jctr.ops.host_index import KeySet

        t = self.trainer
        found = [KeySet() for _ in t.specs]
        for batch in dataset.batches(t.solver.batchsize, epochs=1):
            for seen, spec in zip(found, t.specs):
                seen.add(batch.valid_keys(spec.input_index, spec.slot_num))
        for seen, eval_keys in zip(found, self._eval_keys):
            seen.add(eval_keys)
        return found

    def _pulls_ahead(self) -> bool:
        """Whether the next pass's rows may be read while a pass trains: a sparse_store of
        one process (several processes gather rows collectively, on the main thread)."""
        import jax

        return self.store is not None and jax.process_count() == 1 and self._ahead_ok

    def _pull_ahead(self, following: Future, wanted: list,
                    halt: threading.Event) -> dict | None:
        """The stored rows of the following pass's keys that this pass does not hold
        (``wanted``: the KeySets of its pulled keys; its write-back leaves the others as they
        are), read while this pass trains; runs on the store thread, after the following
        pass's data (``following``) is read on the prefetch thread."""
        try:
            upcoming = following.result()["keys"]
        except Exception:  # noqa: BLE001 - the main thread meets the error itself
            return None
        if halt.is_set() or upcoming is None:
            return None
        t0 = time.perf_counter()
        rows, held_at = [], []
        for i, keys in enumerate(s.keys() for s in upcoming):
            held_at.append(wanted[i].positions(keys))
            rows.append(self.store.pull(i, keys[held_at[-1] < 0]))
        return {"rows": rows, "held_at": held_at, "seconds": time.perf_counter() - t0}

    def _rows_ahead(self) -> dict | None:
        """What :meth:`_pull_ahead` read (``rows``; ``held_at``: each following key's place
        among this pass's pulled keys, -1 where absent; and the ``seconds`` it took; None if
        it did not run), once it is done."""
        ahead, self._ahead = self._ahead, None
        return _result_or_none(ahead)  # failed: the pass pulls the usual way

    def _join_ahead(self, following: Future, ahead: Future) -> list | None:
        """The next pass's rows as :meth:`_pulled_rows` gives them, per table, made on the
        store thread while this pass's checkpoint is written (``following``: the next pass's
        data, ``ahead``: :meth:`_pull_ahead`'s read; both done or failed by then). None if
        either failed (the next pass then reads the usual way)."""
        rows = _result_or_none(ahead)
        try:
            upcoming = following.result()["keys"]
        except Exception:  # noqa: BLE001 - the main thread meets the error itself
            return None
        if rows is None or upcoming is None:
            return None
        return [self._pulled_rows(i, keys.keys(), rows["rows"][i], rows["held_at"][i])
                for i, keys in enumerate(upcoming)]

    def _take_joined(self) -> list | None:
        """What :meth:`_join_ahead` made, once done (None if it did not run or failed)."""
        joined, self._joined = self._joined, None
        return _result_or_none(joined)

    def _pulled_rows(self, i: int, want: np.ndarray, ahead: dict, at_held: np.ndarray
                     ) -> dict[str, np.ndarray]:
        """The rows ``store.pull(i, want)`` gives after the last pass's write-back: the rows
        it wrote (``_written``) of ``want``'s keys, those read ahead (the stored rows of the
        keys it did not hold: all wanted, :meth:`_pull_ahead` read them for this very key
        set) and, read now, rows of keys the last pass held but did not write (validation keys
        it never trained). ``at_held``: each key's place among the last pass's pulled keys
        (``_wanted``), -1 where absent (found by the read ahead). The three sets of keys are
        apart, so the parts are laid side by side, each row copied once; in place, not in
        ``want``'s order (a table takes its rows in any order and trains them alike)."""
        last = self._last_written(i)
        if last is None:
            self._written_back()
            return self.store.pull(i, want)
        written, row_of = last
        from_written = row_of[at_held]
        late = self.store.pull(i, want[(at_held >= 0) & (from_written < 0)])
        take = np.zeros(written["keys"].size, bool)
        take[from_written[from_written >= 0]] = True
        take = np.flatnonzero(take)
        out = {}
        for name, rows in written.items():
            parts = [ahead[name], late[name]]
            joined = np.empty((take.size + sum(len(p) for p in parts), *rows.shape[1:]),
                              rows.dtype)
            take_rows(rows, take, joined[:take.size])
            at = take.size
            for p in parts:
                joined[at:at + len(p)] = p
                at += len(p)
            out[name] = joined
        return out

    def _last_written(self, i: int) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
        """The last pass's written rows (``_written``) and, for each of its keys' places in
        ``_wanted`` (one more entry, -1: keys it did not hold), its written row or -1; None
        if it wrote keys it did not hold (not so in practice: a pass's tables hold only its
        keys)."""
        written = self._written[i]
        row_of = self._written_at.get(i)
        if row_of is None:
            was = self._wanted[i].positions(written["keys"])
            if (was < 0).any():
                return None
            row_of = np.full(len(self._wanted[i]) + 1, -1, np.int64)
            row_of[was] = np.arange(was.size)
            self._written_at[i] = row_of
        return written, row_of

    def _read_unheld(self, held: list) -> list[dict[str, np.ndarray]]:
        """Every stored row of the keys the day's last pass does not hold (``held``: its
        pulled keys' KeySets; its write-back leaves those rows as they are), read on the
        store thread while it trains, for the day's base model (:meth:`_model_rows`)."""
        return [self.store.pull_except(i, keys) for i, keys in enumerate(held)]

    def _unheld_fits(self) -> bool:
        """Whether the stored rows (and the base model's joined copy of them) fit in memory
        beside the run, to be read while the day's last pass trains; else the base model reads
        the database a part at a time (:meth:`_streamed_rows`), as a table larger than memory
        must."""
        # (the last pass's write-back may still be on its way in: as many rows as this
        # pass pulls counted as new)
        need = 2 * sum(self.store.stored_bytes(i, more=len(held))
                       for i, held in enumerate(self._wanted))
        room = room_left(self._busy_bytes())
        return room is None or need <= room

    def _streamed_rows(self, i: int, keys: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        """A base model's rows of ``keys`` (chosen by the statistics) a part at a time, by
        one pass over the database once the last pass's write-back is in: never the whole
        table in memory (the same keys and vectors as :meth:`_store_rows`, in another
        order)."""
        self._written_back()
        stats = self.stats[i]
        chosen = _chosen(stats, keys)
        for part in self.store.pull_except_parts(i):
            yield _rows_among({"keys": part["keys"], "values": part["values"]}, stats, chosen)

    def _take_unheld(self) -> list[dict[str, np.ndarray]] | None:
        """What :meth:`_read_unheld` read, once done (None if it did not run or failed: the
        base model then reads the database)."""
        unheld, self._unheld = self._unheld, None
        return _result_or_none(unheld)

    def _model_rows(self, i: int, keys: np.ndarray, unheld: dict[str, np.ndarray] | None
                    ) -> dict[str, np.ndarray] | list[dict[str, np.ndarray]]:
        """A base or delta model's rows of ``keys`` (chosen by the statistics) without
        waiting for the last pass's write-back: the rows it wrote, from memory; those of keys
        it did not hold (which its write-back leaves as they are) given (``unheld``: the day's
        base model, read while its last pass trained) or read now; and, read now, those of
        keys it held but did not write. The same keys and vectors as :meth:`_store_rows`
        gives, in another order (a model file holds no optimizer state), as parts written one
        after the other (not joined: a copy of every row)."""
        last = self._last_written(i)
        if last is None:
            return self._store_rows(i, keys)
        written, row_of = last
        at = self._wanted[i].positions(keys)
        read = (at >= 0) & (row_of[at] < 0)
        if unheld is None:
            read |= at < 0
        parts = [written, self.store.pull(i, keys[read])]
        if unheld is not None:
            parts.append(unheld)
        stats = self.stats[i]
        chosen = _chosen(stats, keys)
        # a model file holds keys and vectors: the optimizer's columns are not copied
        return [_rows_among({"keys": p["keys"], "values": p["values"]}, stats, chosen)
                for p in parts]

    def _pull(self, keys: list, ahead: dict | None = None) -> None:
        """The rows of the pass's and the validation set's keys (``keys``: per table, the
        KeySet :meth:`_working_keys` gives) into the empty tables; ``ahead``: the stored
        rows of the keys the last pass did not hold, read meanwhile (:meth:`_rows_ahead`)."""
        import jax

        t = self.trainer
        after = ahead is not None and len(self._written) == len(t.specs)
        joined = self._take_joined()
        if not after:  # every row read from the database: the last pass's written first
            self._written_back()
            joined = None
        pulled, wanted = [], []
        for i, spec in enumerate(t.specs):
            union = keys[i]
            want = union.keys()
            if jax.process_count() > 1:  # every process's keys: the tables are global
                want = unique(self._everyones({"keys": want})["keys"])
            if want.size > spec.capacity:
                raise DataError(f"sparse_store: a pass's working set of {want.size:,} keys "
                                f"(with the validation set's) does not fit embedding "
                                f'"{spec.name}" ({spec.capacity:,} rows): raise '
                                "max_vocabulary_size_per_gpu or make passes smaller")
            if joined is not None:  # joined on the store thread from these very keys
                own = joined[i]
            elif after:
                own = self._pulled_rows(i, want, ahead["rows"][i], ahead["held_at"][i])
            else:
                own = self.store.pull(i, self._mine(want))
            pulled.append(own)
            wanted.append(union)
            self._set_table(i, put_rows(spec, t.state.embeddings[i], t.placements[i],
                                        self._everyones(own), replace=True, consume=True))
        self._pulled, self._wanted, self._written = pulled, wanted, []
        self._written_at = {}

    def _push(self, day: str, n: int, *, keep: bool = False, behind: bool = False) -> None:
        """The working set back into the database (undoable until the pass's checkpoint);
        the tables are empty again. ``keep``: the rows written are kept for the next pass's
        pull (:meth:`_pulled_rows`) and its models (:meth:`_model_rows`);
        ``behind``: written on the store thread once the next pass has its rows
        (:meth:`_write_behind`; the pass's checkpoint is recorded once they are written:
        :meth:`_settle`)."""
        from jctr.sharding.distributed import process_owns

        self._settle()  # one write-back in flight at a time
        t = self.trainer
        tables = [export_placed(es, pl) for es, pl in zip(t.state.embeddings, t.placements)]
        for j, tb in enumerate(tables):  # each process writes its part
            owns = process_owns(tb["keys"])
            if owns is not None:
                tables[j] = {name: arr[owns] for name, arr in tb.items()}
        write = (self._write_back, os.path.join(self._undo_dir(), f"{day}_{n:04d}.npz"),
                 self._pulled, tables, {"day": day, "pass": n})
        if behind and self._pool is not None:
            self._deferred = write
        else:
            write[0](*write[1:])
        for i, tb in enumerate(tables):  # the exported rows are copies: emptied at once
            self._set_table(i, put_rows(t.specs[i], t.state.embeddings[i], t.placements[i],
                                        {k: v[:0] for k, v in tb.items()}, replace=True,
                                        consume=True))
        self._pulled = []
        # as a pull would give them back (read by the next pass and by this pass's models)
        self._written = [self.store.as_stored(i, tb) for i, tb in enumerate(tables)] \
            if keep else []
        self._written_at = {}

    def _write_back(self, undo: str, pulled: list, tables: list, marker: dict) -> None:
        """What the database held of a pass's keys saved to ``undo`` (with the keys written),
        then the pass's rows written over them."""
        self.store.save_undo(undo, pulled, [tb["keys"] for tb in tables], marker)
        for i, tb in enumerate(tables):
            self.store.push(i, tb)

    def _write_behind(self) -> None:
        """The last pass's write-back onto the store thread (once this pass's tables are
        filled: the two would share the cores), its checkpoint recorded there as soon as it
        is done (a run stopped later resumes after that pass); the thread's read ahead of the
        next pass's other rows follows it."""
        if self._deferred is not None:
            deferred, unrecorded = self._deferred, self._unrecorded
            self._deferred = self._unrecorded = None
            self._behind = self._pool.submit(self._write_and_record, deferred, unrecorded)

    def _write_and_record(self, deferred: tuple, unrecorded: tuple | None) -> None:
        deferred[0](*deferred[1:])
        if unrecorded is not None:
            self._record_checkpoint(*unrecorded)

    def _written_back(self) -> None:
        """The last pass's write-back done (here, if it has not started), or its error
        raised."""
        deferred, self._deferred = self._deferred, None
        behind, self._behind = self._behind, None
        try:
            if deferred is not None:
                deferred[0](*deferred[1:])
        finally:  # one in flight ends before anything else touches the database
            if behind is not None:
                behind.result()

    def _after_write_back(self, change: Callable[[], None]) -> None:
        """``change`` (of the database) made once the last pass's write-back is in and its
        checkpoint recorded: queued behind it on the store thread where it is in flight (the
        day's end builds its models meanwhile), else made now. A write-back that failed
        makes no change (its error is raised by :meth:`_settle`)."""
        behind = self._behind
        if behind is None:
            self._settle()
            change()
            return
        unrecorded, self._unrecorded = self._unrecorded, None

        def then() -> None:
            behind.result()
            if unrecorded is not None:
                self._record_checkpoint(*unrecorded)
            change()

        self._behind = self._pool.submit(then)

    def _settle(self) -> None:
        """The last pass's write-back finished, and the checkpoint that waited for it
        recorded. A write-back that failed raises here: its checkpoint stays unrecorded and
        its undo file in place (a run started again puts the old rows back)."""
        unrecorded, self._unrecorded = self._unrecorded, None
        self._written_back()
        if unrecorded is not None:
            self._record_checkpoint(*unrecorded)

    def _set_table(self, i: int, es) -> None:
        """Embedding table ``i`` of the trainer's state replaced by ``es``."""
        t = self.trainer
        embeddings = list(t.state.embeddings)
        embeddings[i] = es
        t.state = t.state._replace(embeddings=tuple(embeddings))

    # -- feature statistics and the daily shrink -------------------------------------------
    def _start_statistics(self) -> None:
        import jax

        from jctr.embedding.row_optimizers import admits

        t = self.trainer
        # a table larger than memory meets more keys than memory holds statistics of (~45
        # bytes a key): past a share of the memory left beside the step, they move into
        # mapped files beside the run's models, paged as the table's rows are
        room = room_left(t.memory_plan.transient)
        keep = None if room is None else max(int(room * self.STATS_IN_MEMORY_SHARE), 0) \
            // len(t.specs)
        self.stats = [FeatureStats(self._score, gather=jax.process_count() > 1,
                                   expected_keys=spec.capacity * (pl.num_shards
                                                                  if pl.sharded else 1),
                                   files=self.cfg.save_model_path, in_memory_bytes=keep,
                                   report=self.log)
                      for spec, pl in zip(t.specs, t.placements)]
        if keep is not None:
            self.log(f"[jctr] feature statistics: in memory up to {format_bytes(keep)} a table "
                     f"(~{keep // FeatureStats.ROW_BYTES:,} keys), then in mapped files in "
                     f"{self.cfg.save_model_path}")
        entry = self.cfg.table_parameters.show_click_entry
        show_of = _entry_column(entry.show, t.cfg.data, "show", self.cfg.source)
        click_of = _entry_column(entry.click, t.cfg.data, "click", self.cfg.source)
        if entry != ShowClickEntry() and any(admits(s.optimizer) for s in t.specs):
            raise ConfigError("table_parameters.show_click_entry", "admission "
                              "(embedx_threshold) counts one show per key and the first label "
                              "column as its click; leave show_click_entry out with it",
                              self.cfg.source)

        t.hooks.append(_ObserveShowClick(t.specs, self.stats, show_of, click_of))

    def _sync_statistics(self) -> None:
        """Every process's new shows and clicks into every process's statistics (one
        gather per table), so that all take the same shrink and save decisions."""
        from jctr.sharding.distributed import gather_rows

        for st in self.stats:
            if not st.gather:  # one process: observe() added them already
                continue
            keys, show, click = st.take_pending()
            for part in gather_rows({"keys": keys, "show": show, "click": click}):
                st.merge(part["keys"], part["show"], part["click"])

    def _save_statistics(self, folder: str, *, whole: bool = False) -> None:
        """``feature_stats.npz`` beside a checkpoint in ``folder``: a day's batch model
        (``whole``) holds every key's statistics; a pass's checkpoint the rows changed since
        (``"base"`` names that file), unless no such file is known or most rows changed
        (then every key's). A table that lives for months holds many days of keys and meets
        a day's: its passes write a day's keys, not all of them."""
        import numpy as np

        arrays = None
        if not whole and self._stats_base is not None:
            changes = [st.changes() for st in self.stats]
            if 2 * sum(c["positions"].size for c in changes) < sum(map(len, self.stats)):
                arrays = {f"{i}/{k}": v for i, c in enumerate(changes) for k, v in c.items()}
                arrays["base"] = np.array(self._stats_base[0])
                arrays["base_rows"] = np.asarray(self._stats_base[1], np.int64)
        if arrays is None:
            arrays = {f"{i}/{k}": v for i, st in enumerate(self.stats)
                      for k, v in st.state_dict().items()}
        path = os.path.join(folder, STATS_FILE)
        with replacing(path, os.path.join(folder, "feature_stats.tmp.npz")) as tmp, \
                DirectWriter(tmp) as f:  # hundreds of MB a day: past the page cache
            np.savez(f, **arrays)

    def _mark_statistics_base(self, folder: str) -> None:
        """The statistics were saved whole into ``folder`` (a day's batch model): the day's
        pass checkpoints save the changes since."""
        for st in self.stats:
            st.mark_base()
        self._stats_base = (os.path.relpath(os.path.join(folder, STATS_FILE),
                                            self.cfg.save_model_path),
                            [len(st) for st in self.stats])

    def _load_statistics(self, folder: str, day_end: bool) -> None:
        import numpy as np

        path = os.path.join(folder, STATS_FILE)
        base_path = None
        try:
            with np.load(path, allow_pickle=False) as f:
                table = lambda z, i: {k.split("/", 1)[1]: z[k] for k in z.files  # noqa: E731
                                      if k.startswith(f"{i}/")}
                if "base" not in f.files:
                    for i, st in enumerate(self.stats):
                        st.load_state_dict(table(f, i))
                    self._stats_base = None
                    if day_end:
                        self._mark_statistics_base(folder)
                    return
                base, rows = str(f["base"]), [int(x) for x in f["base_rows"]]
                base_path = os.path.join(self.cfg.save_model_path, base)
                with np.load(base_path, allow_pickle=False) as b:
                    if "base" in b.files:
                        raise ValueError(f"its base {base_path} is itself a file of changes")
                    for i, st in enumerate(self.stats):
                        whole = table(b, i)
                        if whole["keys"].size != rows[i]:
                            raise ValueError(f"its base {base_path} holds "
                                             f"{whole['keys'].size:,} keys of table {i}, the "
                                             f"changes were made over {rows[i]:,}")
                        st.apply_changes(whole, table(f, i))
                self._stats_base = (base, rows)
        except (OSError, KeyError, ValueError, IndexError) as e:
            where = f" (changes over {base_path})" if base_path else ""
            raise DataError(f"{path}: feature statistics unreadable{where} ({e})") from None

    def _shrink_day(self, day: str) -> None:
        """The end of a day: statistics decay; deleted keys leave the tables."""
        t = self.trainer
        rate = self.cfg.table_parameters.show_click_decay_rate
        for i, (spec, stats) in enumerate(zip(t.specs, self.stats)):
            decays = "accessor" in t.state.embeddings[i].slots and rate != 1.0
            deleted = stats.shrink(self._shrink)
            for hook in t.hooks:  # a Kafka publisher sends them as erased keys
                hook.on_keys_erased(i, deleted, t.state)
            if self.store is not None:  # behind the last pass's write-back, if in flight
                self._after_write_back(functools.partial(
                    self._shrink_store, i, day, deleted, rate if decays else None))
                rows = None
            else:
                if decays:  # admission's counts decay too
                    self._set_table(i, scale_slot(t.state.embeddings[i], "accessor",
                                                  (rate, rate, 1.0)))
                rows = None
                if deleted.size:
                    es, rows = drop_keys(spec, t.state.embeddings[i], t.placements[i], deleted)
                    self._set_table(i, es)
            self.log(f"[jctr] shrink at the end of day {day}: {spec.name}: {deleted.size:,} "
                     f"key(s) deleted, {len(stats):,} with statistics"
                     + (f", {rows:,} rows in use of {spec.capacity:,}" if rows is not None
                        else ""))

    def _shrink_store(self, i: int, day: str, deleted: np.ndarray, rate: float | None) -> None:
        """The shrink in the row database: deleted keys go; admission counts decay once a day
        (a resumed day end does not decay them again)."""
        self.store.erase(i, deleted)
        if rate is None:
            return
        meta = self.store.db.get_meta(self.store.names[i]) or {}
        if meta.get("decayed_day") != day:
            self.store.scale(i, "accessor", (rate, rate, 1.0))
            self.store.db.set_meta(self.store.names[i], {**meta, "decayed_day": day})

    def _train_pass(self, day: str, n: int, data: dict) -> None:
        t = self.trainer
        dataset = data["dataset"] or open_training_set(t.cfg, data["list"])
        data["dataset"] = None  # the trainer holds it, for this pass only
        rows_s = {}  # sparse_store: seconds reading and writing the pass's rows
        if self.store is not None:
            t0 = time.perf_counter()
            ahead = data.get("rows_ahead")
            self._pull(data["keys"] if data.get("keys") is not None
                       else self._working_keys(dataset), ahead)
            rows_s = {"store_read_s": time.perf_counter() - t0,
                      "store_read_ahead_s": None if ahead is None else ahead["seconds"]}
            self._write_behind()
            if data.get("next") is not None:  # the next pass's other rows, meanwhile
                following, halt = data["next"]
                self._ahead = self._pool.submit(self._pull_ahead, following, self._wanted, halt)
            elif n == len(self.passes) and self._pool is not None and self._pulls_ahead() \
                    and self._unheld_fits():
                # the day's last pass: the base model's rows of the keys it does not hold
                self._unheld = self._pool.submit(self._read_unheld, self._wanted)
        t.run_log.forget()  # the last pass's records stay in memory, the rest in the log file
        summary = t.fit(data=dataset)
        self._sync_statistics()
        if self.store is not None:
            t0 = time.perf_counter()
            behind = self._ahead is not None
            # the day's last pass: its write-back on the store thread at once, while its
            # checkpoint is written (the day's end waits for it before the shrink)
            last = not behind and self._unheld is not None
            self._push(day, n, keep=behind or last, behind=behind or last)
            if last:
                self._write_behind()
            rows_s["store_write_s"] = time.perf_counter() - t0
            if behind and data.get("next") is not None and self._pool is not None and all(
                    self._last_written(i) is not None for i in range(len(t.specs))):
                # the next pass's rows joined meanwhile (the written rows' places found
                # here: the pass's delta reads them too)
                self._joined = self._pool.submit(self._join_ahead, data["next"][0], self._ahead)
            rows_s["store_write_behind"] = behind or last
            rows_s["store_write_overlaps"] = "next_pass" if behind else "checkpoint" if last \
                else None
        iters, validation, loss = summary.iterations, summary.validation, summary.loss
        pass_auc = bucket_auc(self.pass_auc.take())
        # the steady rate leaves the pass's first step out (the compile, on the first pass)
        rate = summary.steady_samples_per_s or summary.samples_per_s
        num_files = data["files"]
        read = ("" if data["read_s"] is None else f", read ahead in {data['read_s']:.2f} s "
                f"(waited {data['wait_s']:.2f} s for it)")
        if data.get("uncached"):
            read += (f", {data['uncached']} file(s) read from disk as it trained (no room to "
                     "keep them in memory beside the run)")
        self.log(f"[jctr] day {day} pass {n}/{len(self.passes)}: {num_files} file(s), {iters} "
                 f"iterations, {rate:,.0f} samples/s"
                 + (f", loss {loss:.5f}" if loss is not None else "")
                 + f", pass AUC {pass_auc:.5f}"
                 + ("; validation " + ", ".join(f"{k} {v:.5f}" for k, v in validation.items())
                    if validation else "") + read + _rows_note(rows_s))
        self._record({"day": day, "pass": n, "files": num_files, "iterations": iters,
                      "samples_per_s": rate, "loss": loss,
                      "pass_auc": pass_auc, "validation": validation,
                      "read_ahead_s": data["read_s"], "read_wait_s": data["wait_s"],
                      "uncached_files": data.get("uncached", 0), **rows_s})
        self.passes_trained += 1
        freq = self.cfg.save_delta_frequency
        if freq and n % freq == 0:
            self._save_inference("delta", day, n)
        if n % self.cfg.checkpoint_per_pass == 0:
            self._checkpoint(os.path.join(self.cfg.save_model_path, day, str(n)), day, n,
                             day_end=False)
        if n == len(self.passes):
            self._end_day(day)

    def _end_day(self, day: str) -> None:
        """Shrink, then the base model and the batch model of the next day (PaddlePaddle
        names both after the day they start); keys age a day as the batch model is saved,
        after the shrink tested their unseen days and the base model chose its keys (Paddle's
        order)."""
        import jax

        # the shrink's deletions and decay follow the last pass's write-back on the store
        # thread; the base model is built from memory meanwhile (_model_rows)
        self._shrink_day(day)
        following = next_day(day)
        folder = os.path.join(self.cfg.save_model_path, following, "0")
        keys = self._inference_keys("base")
        for st in self.stats:
            st.age()
        t = self.trainer
        # a base model of every row holds the batch model's keys and vectors byte for byte:
        # once the snapshot is sealed its files are linked, not written a second time (~350
        # MB of a 4.8M-key day); one that filters rows is written beside the snapshot
        whole = self.store is None and jax.process_count() == 1 and all(
            _every_key(st, k, spec.eviction is not None)
            for spec, st, k in zip(t.specs, self.stats, keys))

        def beside(exported) -> None:  # while the batch model's snapshot is written
            with ThreadPoolExecutor(1) as pool:  # the (aged) statistics go with it
                saved = pool.submit(self._save_statistics, folder, whole=True) \
                    if jax.process_index() == 0 else None
                if not whole:
                    self._save_inference("base", following, None, exported, keys=keys)
                if saved is not None:
                    saved.result()

        def linked(rows) -> None:  # the snapshot's rows, mapped from its files
            self._save_inference("base", following, None, rows, keys=keys)

        self._checkpoint(folder, day, len(self.passes), day_end=True, meanwhile=beside,
                         then=linked if whole else None, statistics=False)
        self._settle()  # the database as the day's end has it, then the end recorded
        self._mark_statistics_base(folder)
        self._written, self._written_at = [], {}  # the day's last rows, kept for its base model
        self._prune_days(following)
        t.run_log.write_report(force=True)

    def _prune_days(self, newest: str) -> None:
        """``checkpoint_keep_days`` N: the pass checkpoints and batch models (``<day>/<n>/``)
        of days more than N days before ``newest`` (the batch model just started) removed,
        but for the checkpoint the progress record names and its day's batch model (its
        statistics' base); ``model_keep_days`` M: the base and
        delta models (``<day>/base/``, ``<day>/delta-<pass>/``) of days more than M days
        before ``newest`` (the base model just written). Days that old were sealed long
        before (a snapshot or model in flight is this day's)."""
        import shutil

        import jax

        keep = {"checkpoint": self.cfg.checkpoint_keep_days,
                "model": self.cfg.model_keep_days}
        if not any(keep.values()) or jax.process_index() != 0:
            return
        cutoff = {kind: next_day(newest, -n) if n else "" for kind, n in keep.items()}
        root = self.cfg.save_model_path
        record = self.progress()
        named = os.path.abspath(record["checkpoint"]) if record else None
        # and its statistics' base: its day's batch model
        kept = () if not named else (named, os.path.dirname(os.path.dirname(named)) + "/0")
        removed = {"checkpoint": 0, "model": 0}
        for day in os.listdir(root):
            if not (len(day) == 8 and day.isdigit() and day < max(cutoff.values())
                    and os.path.isdir(os.path.join(root, day))):
                continue
            for entry in os.listdir(os.path.join(root, day)):
                path = os.path.abspath(os.path.join(root, day, entry))
                if entry.isdigit():
                    kind = "checkpoint"
                    if any(k == path or k.startswith(path + os.sep) for k in kept):
                        continue
                elif entry == "base" or (entry.startswith("delta-") and entry[6:].isdigit()):
                    kind = "model"
                else:
                    continue
                if day < cutoff[kind]:
                    shutil.rmtree(path)
                    removed[kind] += 1
            with contextlib.suppress(OSError):  # a day left with nothing goes too
                os.rmdir(os.path.join(root, day))
        if removed["checkpoint"]:
            self.log(f"[jctr] checkpoint_keep_days {keep['checkpoint']}: "
                     f"{removed['checkpoint']} checkpoint(s) of days before "
                     f"{cutoff['checkpoint']} removed"
                     + ("" if removed["model"] else " (base and delta models kept)"))
        if removed["model"]:
            self.log(f"[jctr] model_keep_days {keep['model']}: {removed['model']} base and "
                     f"delta model(s) of days before {cutoff['model']} removed")

    def _checkpoint(self, folder: str, day: str, n: int, *, day_end: bool,
                    meanwhile=None, then=None, statistics: bool = True) -> None:
        """A snapshot into ``folder`` with the statistics beside it (unless ``meanwhile``
        writes them: ``statistics`` False; ``then`` runs once it is sealed), then the
        progress record naming it."""
        import jax

        # a snapshot there is an attempt at this pass that was never recorded (the run
        # stopped before its write-back was done): replaced
        path = os.path.join(folder, str(self.trainer.save_checkpoint(
            folder, meanwhile=meanwhile, then=then, replace=True)))
        if jax.process_index() == 0 and statistics:
            self._save_statistics(folder)
        if self._deferred is not None or self._behind is not None:
            # recorded once the pass's rows are in the database
            self._unrecorded = (day, n, path, day_end)
        else:
            self._record_checkpoint(day, n, path, day_end)

    def _record_checkpoint(self, day: str, n: int, path: str, day_end: bool) -> None:
        """The progress record names a complete checkpoint (its rows written back)."""
        import jax

        if jax.process_index() == 0:
            self._write_progress(day, n, int(os.path.basename(path)), path, day_end)
        if self.store is not None:  # the database now matches this checkpoint
            for name in os.listdir(self._undo_dir()):
                os.remove(os.path.join(self._undo_dir(), name))
        what = "batch model after" if day_end else "checkpoint of"
        self.log(f"[jctr] {what} day {day} pass {n} -> {path}")

    def _inference_keys(self, kind: str) -> list[np.ndarray]:
        """The keys a base or delta model keeps, by the filters (:meth:`FeatureStats.base_keys`,
        :meth:`FeatureStats.delta_keys`); the chosen keys' delta scores start again."""
        tp = self.cfg.table_parameters
        if kind == "base":
            return [st.base_keys(tp.base_threshold, tp.delta_keep_days) for st in self.stats]
        return [st.delta_keys(tp.base_threshold, tp.delta_threshold, tp.delta_keep_days)
                for st in self.stats]

    def _save_inference(self, kind: str, day: str, n: int | None,
                        exported: dict | None = None,
                        keys: list[np.ndarray] | None = None) -> str:
        """A base (``kind`` "base") or delta inference bundle with the keys the filters keep
        (``keys``, chosen by :meth:`_inference_keys` unless given). ``exported``: every
        table's rows on the host already (the day end's snapshot), the base model's taken
        from them."""
        import jax

        from jctr.serving.bundle import export_bundle

        t = self.trainer
        tables = None
        if keys is None:
            keys = self._inference_keys(kind)
        if kind == "base":
            folder = os.path.join(self.cfg.save_model_path, day, "base")
            if exported is not None and self.store is None:
                tables = [_rows_with(exported[spec.name], st, k, spec.eviction is not None)
                          for spec, st, k in zip(t.specs, self.stats, keys)]
        else:
            folder = os.path.join(self.cfg.save_model_path, day, f"delta-{n}")
        if self.store is not None:  # every row is in the database, or the last pass's in memory
            unheld = self._take_unheld() if kind == "base" else None
            # the last pass's rows kept (perhaps still being written back): from memory
            kept = len(self._written) == len(t.specs)
            if kind == "base" and unheld is None and jax.process_count() == 1:
                # not read while the last pass trained (no room for them, or no prefetch)
                tables = [self._streamed_rows(i, k) for i, k in enumerate(keys)]
                stored = sum(self.store.stored_bytes(i) for i in range(len(keys)))
                self.log(f"[jctr] base model {folder}: the stored rows (~{format_bytes(stored)})"
                         " read from the database a part at a time")
            else:
                tables = [self._model_rows(i, k, None if unheld is None else unheld[i])
                          if kept else self._store_rows(i, k) for i, k in enumerate(keys)]
        path = export_bundle(t.cfg, t.state, folder, t.placements, keys=keys,
                             about={"kind": kind, "day": day, "pass": n}, tables=tables)
        self.log(f"[jctr] {kind} model -> {path} ("
                 + ", ".join(f"{spec.name}: {k.size:,} keys" for spec, k in zip(t.specs, keys))
                 + ")")
        if self._converter is not None and jax.process_index() == 0:
            try:
                self._converter(path, kind, day, n)
            except Exception as e:  # the user's code: its failure is theirs to read, not ours
                hook = self.cfg.table_parameters.converter
                raise ConfigError("table_parameters.converter", f"{hook} failed on the {kind} "
                                  f"model {path}: {type(e).__name__}: {e}",
                                  self.cfg.source) from e
        return path


def _background(name: str) -> ThreadPoolExecutor:
    """One thread, below the training step's priority, running what it is given in order."""
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_yield_to_training)


def _yield_to_training() -> None:
    """The prefetch and store threads run at a lower priority than the training step's
    threads: their reads and write-backs fill the step's gaps instead of taking cores from
    it (where the system lets a thread lower its own priority)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _result_or_none(future: Future | None):
    """A read done on the store thread, once done; None if there was none or it failed
    (its caller then reads the usual way)."""
    if future is None:
        return None
    try:
        return future.result()
    except Exception:  # noqa: BLE001
        return None


def _every_key(stats: FeatureStats, keys: np.ndarray, evicts: bool) -> bool:
    """Whether ``keys`` (chosen by the statistics) are every key of a table that never
    evicts: every key with statistics was trained, so is in such a table."""
    return not evicts and keys.size == len(stats)


def _rows_with(table: dict[str, np.ndarray], stats: FeatureStats, keys: np.ndarray,
               evicts: bool = False) -> dict[str, np.ndarray]:
    """The rows of an exported table whose keys are among ``keys`` (a set the statistics
    chose, so found through their index: no sort of the whole table)."""
    if _every_key(stats, keys, evicts) and keys.size == table["keys"].size:
        # as many table keys are the same set: every row is kept
        return table
    return _rows_among(table, stats, _chosen(stats, keys))


def _chosen(stats: FeatureStats, keys: np.ndarray) -> np.ndarray:
    """Which of the statistics' rows hold ``keys`` (one more entry, False: keys without
    statistics)."""
    chosen = np.zeros(len(stats) + 1, bool)
    chosen[stats.rows_of(keys)] = True
    chosen[-1] = False
    return chosen


def _rows_among(table: dict[str, np.ndarray], stats: FeatureStats,
                chosen: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of a table whose keys are :func:`_chosen`."""
    keep = chosen[stats.rows_of(table["keys"])]
    if keep.all():  # a base model often holds every row: no copy
        return table
    return {name: arr[keep] for name, arr in table.items()}


class _ObserveShowClick(Hook):
    """Each key of a sample gets the sample's show and click, as the batches are read."""

    def __init__(self, specs, stats: list[FeatureStats], show_of, click_of):
        self.specs, self.stats, self.show_of, self.click_of = specs, stats, show_of, click_of

    def on_batch(self, batch) -> None:
        show, click = self.show_of(batch), self.click_of(batch)
        for spec, stats in zip(self.specs, self.stats):
            keys, sample = batch.sample_keys(spec.input_index, spec.slot_num)
            stats.observe(keys, show[sample], click[sample])


def _entry_column(source: float | str, data, name: str, where: str | None):
    """A batch -> per-sample values function for a show/click source: a constant, or a
    label or dense column (a label column counts as 1 where it is above 0.5)."""
    if isinstance(source, float):
        return lambda batch: np.full(batch.label.shape[0], source)
    kind, index = column_ref(source)
    width = data.label_dim if kind == "label" else data.dense_dim
    if index >= width:
        raise ConfigError(f"table_parameters.show_click_entry.{name}",
                          f'"{source}", but the model has {width} {kind} column(s)', where)
    if kind == "label":
        return lambda batch: (batch.label.reshape(batch.label.shape[0], -1)[:, index]
                              > 0.5).astype(np.float64)
    return lambda batch: batch.dense.reshape(batch.dense.shape[0], -1)[:, index].astype(
        np.float64)


def _rows_note(rows_s: dict) -> str:
    """The pass line's account of its sparse_store reads and writes ("" without one)."""
    if not rows_s:
        return ""
    ahead = rows_s["store_read_ahead_s"]
    return (f"; sparse_store rows read in {rows_s['store_read_s']:.2f} s"
            + ("" if ahead is None else f" (+{ahead:.2f} s read ahead, while the last pass "
               "trained)") + f", written back in {rows_s['store_write_s']:.2f} s"
            + {"next_pass": " (handed to the store thread: written while the next pass "
                            "trains)",
               "checkpoint": " (handed to the store thread: written while the pass's "
                             "checkpoint is)"}.get(rows_s["store_write_overlaps"], ""))


def _print(line: str) -> None:
    import jax

    if jax.process_index() == 0:  # one process reports for all
        print(line, flush=True)


def _rule_json(rule) -> dict:
    """A SparseSGDRule as its JSON object (to write it into the model's config)."""
    out = dataclasses.asdict(rule)
    out["weight_bounds"] = list(rule.weight_bounds)
    return out


def _converter(cfg: OnlineConfig) -> Callable | None:
    """The ``table_parameters.converter`` function, imported now (a bad name fails at once)."""
    name = cfg.table_parameters.converter
    if not name:
        return None
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError("table_parameters.converter", f"cannot import {name!r}: {e}",
                          cfg.source) from None
    if not callable(fn):
        raise ConfigError("table_parameters.converter", f"{name!r} is not callable",
                          cfg.source)
    return fn
