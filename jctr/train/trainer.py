"""The training loop: data in, jitted steps, progress on the terminal and JSON-lines logs."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.checkpoint.model_files import load_model_files, save_model_files
from jctr.checkpoint.snapshots import restore_snapshot, save_snapshot
from jctr.checkpoint.tables import export_placed, import_placed
from jctr.config import (
    ConfigError,
    ModelConfig,
    load_config,
    override_optimizer,
    override_solver,
)
from jctr.data.batch import Batch, check_batch
from jctr.data.dataset import Dataset
from jctr.data.loader import Prefetcher, ReaderPosition, open_dataset
from jctr.data.records import DataError
from jctr.data.synthetic import generate_for_config
from jctr.embedding.hash_table import TableFullError
from jctr.embedding.sparse_embedding import init_embedding
from jctr.errors import UserError
from jctr.models.ctr import build_model, make_eval_step, with_lr_scale
from jctr.runtime.cpu import has_bf16_matmul
from jctr.runtime.host_memory import describe_malloc_tuning
from jctr.runtime.xla_options import step_compiler_options
from jctr.sharding import to_host
from jctr.sharding.distributed import all_processes
from jctr.sharding.placed_model import PlacedModel
from jctr.train.dense_optimizer import dense_optimizer
from jctr.train.metrics import auc, log_loss
from jctr.train.monitors import EarlyStopping, PlateauSchedule
from jctr.train.progress import Progress, format_seconds
from jctr.train.report import write_report
from jctr.train.schedules import learning_rate_schedule
from jctr.train.step import make_train_step
from jctr.train.step_memory import plan_step_memory
from jctr.train.tensorboard import TensorBoardLog


class NonFiniteLoss(UserError, FloatingPointError):
    """The training loss became NaN or infinite (solver.nan_policy "stop")."""


def _embedding_norms(embeddings) -> list[tuple[jax.Array, jax.Array]]:
    """Per table: rows in use and the sum of their L2 norms (jitted; a table split over
    devices reduces across them)."""
    out = []
    for es in embeddings:
        used = es.row_slot >= 0
        norms = jnp.sqrt(jnp.sum(jnp.square(es.values), axis=-1))  # [..., rows]
        out.append((jnp.sum(used), jnp.sum(jnp.where(used, norms, 0.0))))
    return out


def _dense_bytes(init_state) -> int:
    """Bytes of the dense parameters plus the dense optimizer state (one copy)."""
    shapes = jax.eval_shape(lambda: (lambda st: (st.params, st.batch_stats, st.opt_state))(
        init_state()))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


class _RunTally:
    """Counts of a training run and the running mean loss of the current epoch (batches
    weighted by their share of real samples)."""

    def __init__(self):
        self.skipped = self.fallback_steps = 0
        self._sum = self._weight = 0.0

    def add(self, loss: float | None, weight: float) -> None:
        if loss is None:
            self.skipped += 1
        else:
            self._sum += loss * weight
            self._weight += weight

    def end_epoch(self) -> float | None:
        mean = self._sum / self._weight if self._weight else None
        self._sum = self._weight = 0.0
        return mean


class Trainer:
    """Trains a model described by a parsed config.

    Example::

        trainer = Trainer.from_config("configs/dlrm_synthetic.json", max_iter=200)
        trainer.fit()
        trainer.evaluate()           # {"AUC": ..., "AverageLoss": ...}
        trainer.predict(batch)       # click probabilities, one per sample
    """

    def __init__(self, cfg: ModelConfig, *, log: Callable[[str], None] | None = None,
                 generate_data: bool = True, force: bool = False):
        self.cfg = cfg
        self.solver = cfg.solver
        self.force = force  # a fresh run may replace another run's checkpoints
        quiet = jax.process_index() != 0  # one process reports for all
        self._default_print = log is None and not quiet
        self._print = log or (lambda s: None if quiet else print(s, file=sys.stderr, flush=True))
        if generate_data:  # process 0 writes; the others wait for the files (or its error)
            all_processes(lambda: generate_for_config(cfg) if jax.process_index() == 0
                          else None, "generate the synthetic data")
        self.step_config, init_model = build_model(cfg)
        self.dense_tx = dense_optimizer(cfg.optimizer)
        init_state = lambda: init_model(self.dense_tx)  # noqa: E731
        self.specs = self.step_config.specs
        self.placed = PlacedModel(cfg, self.specs, dense_bytes=_dense_bytes(init_state))
        self._print(self.placed.describe())
        if jax.default_backend() == "cpu":
            self._print(describe_malloc_tuning())
            if cfg.solver.compute_dtype == "bfloat16" and not has_bf16_matmul():
                self._print("[jctr] warning: compute_dtype bfloat16 on a CPU without "
                            "AVX512-BF16 or AMX: XLA emulates bfloat16 here, slower than "
                            "float32 (docs/performance.md); use float32 on this machine")
        self.batch_hooks: list[Callable[[Batch], None]] = []  # see _to_step_input
        self.auc_buckets = 0  # see count_predictions
        self._auc_counts = None
        self._sink = None  # see sink
        self._touched: list[list[np.ndarray]] = [[] for _ in self.specs]
        self._published = [np.zeros(0, np.int64) for _ in self.specs]  # keys ever sent
        self._jit_steps()
        # the steps are compiled (and the first call reuses them) before any table exists,
        # so that a step that will not fit is refused with XLA's figures, not killed
        self.memory_plan = plan_step_memory(self.placed, cfg, self.train_step,
                                            self.eval_step, init_state, self._print)
        self.state = self.placed.create(init_state)
        self._train_data: Dataset | None = None
        self._eval_data: Dataset | None = None
        self.history: list[dict[str, Any]] = []
        self._log_file = None
        self._board: TensorBoardLog | None = None
        self.reader_position: ReaderPosition | None = None  # after the last consumed batch
        self._checkpointer = None
        self._resumed = False  # restored from the solver's checkpoint directory
        self._continues_log = False  # restored from any checkpoint: its log goes on
        self._nonfinite_at: int | None = None  # the state went bad at this iteration
        self._space_checked = False  # the checkpoint disk was checked for one snapshot
        self._train_records = 0  # one epoch of this process's training data (the ETA)
        s = cfg.solver
        self.early_stopping = EarlyStopping(s.early_stopping) if s.early_stopping else None
        self.plateau = (PlateauSchedule(s.lr_plateau, cfg.optimizer.learning_rate)
                        if s.lr_plateau else None)
        self._best_copy = None  # host copy of the state at early stopping's best evaluation
        self._restored_best: int | None = None  # the iteration restore_best_weights went to
        self._test_data: dict[str, Dataset] = {}
        self._norms = jax.jit(_embedding_norms)
        self._lr_at = jax.jit(learning_rate_schedule(cfg.optimizer))
        if cfg.solver.dense_model_file or cfg.solver.sparse_model_file:
            self.load_model_files(cfg.solver.dense_model_file, cfg.solver.sparse_model_file)

    # where the state lives (jctr.sharding.placed_model)
    mesh = property(lambda self: self.placed.mesh)
    placements = property(lambda self: self.placed.placements)
    num_devices = property(lambda self: self.placed.num_devices)

    @classmethod
    def from_config(cls, config: str | os.PathLike | dict, *, generate_data: bool = True,
                    force: bool = False, optimizer: dict | None = None,
                    **solver_overrides) -> Trainer:
        """Build from a JSON path or dict; keyword arguments override solver fields, and
        ``optimizer`` fields of the global optimizer's hparam object, validated like the file
        (``max_iter=0`` is a :class:`ConfigError`).

        Example::

            t = Trainer.from_config("configs/dlrm_synthetic.json", max_iter=200,
                                    optimizer={"learning_rate": 0.01})
        """
        cfg = load_config(config, require_solver=False)
        if optimizer:
            cfg = override_optimizer(cfg, optimizer)
        if solver_overrides:
            cfg = override_solver(cfg, solver_overrides)
        return cls(cfg, generate_data=generate_data, force=force)

    def _jit_steps(self) -> None:
        """The jitted steps for this placement: on a mesh, small all-to-all send buffers for
        the usual batch and full ones (compiled on first need) for a batch whose keys crowd
        onto a device."""
        opts = step_compiler_options(self.solver.compute_dtype)
        placed = self.placed
        engines = (None,) if placed.mesh is None else (placed.engine, placed.engine_full)
        steps = [placed.jit(make_train_step(self.step_config, self.dense_tx, e,
                                            self.auc_buckets),
                            donate_state=True, returns_state=True, compiler_options=opts)
                 for e in engines]
        self.train_step, self.train_step_full = steps[0], steps[-1]
        self.eval_step = placed.jit(make_eval_step(self.step_config, placed.engine_full),
                                    compiler_options=opts)

    # ---- online updates (solver.kafka_sink) -------------------------------------------------

    @property
    def sink(self):
        """The Kafka message sink of ``solver.kafka_sink`` (None without one)."""
        ks = self.solver.kafka_sink
        if ks is None:
            return None
        if self._sink is None:
            if jax.process_count() > 1:
                raise ConfigError("solver.kafka_sink", "publishing updates from a "
                                  "multi-process run is not supported in this version",
                                  self.cfg.source)
            from jctr.stores.kafka import KafkaMessageSink

            self._sink = KafkaMessageSink(ks.brokers, ks.model_name,
                                          send_buffer_size=ks.send_buffer_size,
                                          max_buffered_bytes=ks.max_buffered_mb << 20,
                                          report=self._print)
        return self._sink

    def _note_updates(self, touched: list[np.ndarray], step: int) -> None:
        for seen, keys in zip(self._touched, touched):
            seen.append(keys)
        every = self.solver.kafka_sink.every_n_steps
        if every and step % every == 0:
            self.publish_updates()

    def publish_updates(self) -> int:
        """Send the rows of every key trained since the last call, and the dense weights, to
        the sink (the messages queue; nothing waits for the broker); returns rows sent."""
        sink = self.sink
        if sink is None:
            return 0
        from jctr.checkpoint.model_files import dense_weights, host_network, non_trainable
        from jctr.checkpoint.tables import export_keys

        step = int(to_host(self.state.step))
        rows = 0
        resend = sink.broker_restarted()  # it lost what it had: everything trained so far
        for i, spec in enumerate(self.specs):
            keys = (np.unique(np.concatenate(self._touched[i])) if self._touched[i]
                    else np.zeros(0, np.int64))
            self._touched[i] = []
            self._published[i] = np.union1d(self._published[i], keys)
            if resend:
                keys = self._published[i]
            if not keys.size:
                continue
            stored = export_keys(self.state.embeddings[i], keys, self.placements[i])
            sink.publish_rows(spec.name, step, stored["keys"], stored["values"])
            rows += int(stored["keys"].size)
        net = host_network(self.step_config, self.state)
        sink.publish_dense(step, dense_weights(net).astype("<f4").tobytes(),
                           json.dumps(non_trainable(net)))
        return rows

    def count_predictions(self, buckets: int = 4096) -> None:
        """From now on count the training batches' predictions per bucket, negatives and
        positives (on the devices, summed over every process), for :meth:`take_auc_counts`:
        the AUC of everything trained since (streaming training's pass AUC)."""
        self.auc_buckets = buckets
        self._jit_steps()

    def take_auc_counts(self) -> np.ndarray:
        """``[2, buckets]`` counts since the last call (see :meth:`count_predictions`), which
        start again from zero."""
        counts = self._auc_counts
        self._auc_counts = None
        if counts is None:
            return np.zeros((2, self.auc_buckets), np.int64)
        return np.asarray(to_host(counts), np.int64)

    # ---- data ---------------------------------------------------------------------------

    @property
    def _label_rule(self) -> str:
        return "class" if self.cfg.loss.type == "CrossEntropyLoss" else "probability"

    @property
    def train_data(self) -> Dataset:
        if self._train_data is None:
            self._train_data = self.open_training_data(self.cfg.data.source)
        return self._train_data

    def open_training_data(self, source: str) -> Dataset:
        """``source`` opened as the training set is (this process's share, shuffled as the
        Data layer says); streaming training reads the next pass with it ahead of time."""
        return open_dataset(source, self.cfg.data, self.solver.input_key_type,
                            seed=self.solver.seed if self.cfg.data.shuffle else None,
                            process_index=jax.process_index(),
                            process_count=jax.process_count(), labels=self._label_rule)

    @property
    def eval_data(self) -> Dataset:
        if self._eval_data is None:
            self._eval_data = self._open_eval(self.cfg.data.eval_source)
            if self.cfg.data.cache_eval_data:  # keep the parsed evaluation set in memory
                self._eval_data.cache_all()
        return self._eval_data

    def _open_eval(self, source: str) -> Dataset:
        """A set read like the Data layer's eval_source (whole, in order)."""
        return open_dataset(source, self.cfg.data, self.solver.input_key_type, eval=True,
                            labels=self._label_rule)

    def test_data(self, name: str) -> Dataset:
        """The Data layer's test set ``name`` (``test_source``)."""
        if name not in self._test_data:
            source = dict(self.cfg.data.test_sources)[name]
            self._test_data[name] = self._open_eval(source)
        return self._test_data[name]

    # ---- logging ------------------------------------------------------------------------

    def _open_log(self) -> None:
        """Open ``<log_dir>/metrics.jsonl`` for appending (process 0); a log_dir that cannot be
        written is a config error, found before training."""
        if not self.solver.log_dir or jax.process_index() != 0 or self._log_file is not None:
            return
        path = os.path.join(self.solver.log_dir, "metrics.jsonl")
        if os.path.exists(self.solver.log_dir) and not os.path.isdir(self.solver.log_dir):
            raise ConfigError("solver.log_dir", f"{self.solver.log_dir} exists and is not a "
                              "folder", self.cfg.source)
        if os.path.isfile(path) and os.path.getsize(path) and not self._continues_log:
            # another run's log: appending would draw two runs as one line
            if not self.force:
                raise ConfigError("solver.log_dir", f"{path} holds another run's log; "
                                  "continue that run with --resume, give another --log-dir, "
                                  "or pass --force to start a new log there (the old run's "
                                  "files are moved into previous-<n>/)", self.cfg.source)
            moved = _move_previous_run(self.solver.log_dir)
            self._print(f"[jctr] --force: the previous run's log files are in {moved}")
        try:
            os.makedirs(self.solver.log_dir, exist_ok=True)
            self._log_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        except OSError as e:
            raise ConfigError("solver.log_dir", f"cannot write {path}: {e.strerror}",
                              self.cfg.source) from e

    def _record(self, kind: str, **fields) -> None:
        entry = {"kind": kind, "time": round(time.time(), 3), **fields}
        self.history.append(entry)
        if self.solver.log_dir and jax.process_index() == 0:
            self._open_log()
            self._log_file.write(json.dumps(entry) + "\n")
            self._log_file.flush()
            if self._board is None:
                self._board = TensorBoardLog(self.solver.log_dir)
            self._board.write(entry)

    def _write_report(self) -> None:
        """report.html of the run's log folder (process 0); a failure is reported, never
        fatal: the model is trained and saved by now."""
        if not self.solver.log_dir or jax.process_index() != 0:
            return
        if self._board is not None:  # the event file is complete; a later fit opens another
            self._board.close()
            self._board = None
        try:
            self._print(f"[jctr] report: {write_report(self.solver.log_dir)}")
        except (UserError, OSError) as e:
            self._print(f"[jctr] report not written: {e}")

    # ---- checks before training ----------------------------------------------------------

    def check_before_training(self, max_iter: int | None = None) -> None:
        """Everything that can be checked before the first step: the iteration count, every
        training and evaluation file's header, the log folder, and for snapshots the checkpoint
        directory (owned by this run, writable, room for one snapshot). Every process checks;
        if one fails, all stop. ``fit`` calls this first."""
        s = self.solver
        if not (max_iter or s.max_iter or s.num_epochs):
            raise ConfigError("solver", "set max_iter or num_epochs (or --max-iter)",
                              self.cfg.source)
        done = int(to_host(self.state.step))
        last = max_iter or s.max_iter
        if last and done >= last:  # a resumed run counts the iterations done before
            raise ConfigError("solver.max_iter", f"{last}, but the state is at iteration "
                              f"{done} already (resumed from a checkpoint): nothing to train; "
                              f"give a max_iter above {done} (--max-iter)", self.cfg.source)

        def check() -> None:
            self._train_records = self.train_data.check_units()
            self.eval_data.check_units()
            for name, _ in self.cfg.data.test_sources:
                self.test_data(name).check_units()
            self._open_log()
            if s.snapshot:
                self._prepare_checkpoints()

        all_processes(check, "pass the checks before training")

    def _prepare_checkpoints(self) -> None:
        """Own the checkpoint directory for snapshots (process 0); refuse another run's
        checkpoints unless this run resumed from them or was told to replace them."""
        from jctr.checkpoint.manager import CheckpointError

        if jax.process_index() != 0:
            return
        ckpt = self.checkpointer
        ckpt.acquire(report=self._print)
        steps = [step for step in ckpt.steps() if step not in ckpt.sealed]
        if steps and not self._resumed:
            if not self.force:
                ckpt.release()
                raise CheckpointError(
                    f"{ckpt.directory}: holds checkpoints of another run (iters "
                    f"{', '.join(map(str, steps))}); continue that run with --resume, choose "
                    "another snapshot_prefix, or pass --force to replace them (they are "
                    "deleted once this run's first snapshot is written)")
            ckpt.replace_at_first_save(steps)
            self._print(f"[jctr] --force: the {len(steps)} checkpoint(s) in {ckpt.directory} "
                        "will be replaced by this run's first snapshot")
        if not self._space_checked:  # once; later a full disk fails that save cleanly
            ckpt.check_writable(sum(self.placed.plan.device_totals()))
            self._space_checked = True

    # ---- training -----------------------------------------------------------------------

    def _check_overflow(self, metrics) -> None:
        if int(to_host(metrics["overflow"])):
            full = [s for s, e in zip(self.specs, self.state.embeddings)
                    if int(np.sum(to_host(e.table.overflow)))]
            names = ", ".join(f"\"{s.name}\" ({s.capacity} rows)" for s in full)
            raise TableFullError(
                f"embedding table full: more distinct keys than max_vocabulary_size_per_gpu "
                f"allows in {names}; raise sparse_embedding_hparam.max_vocabulary_size_per_gpu")

    def _check_step(self, metrics, step: int) -> float | None:
        """After step ``step``: a full table or (policy ``stop``) a non-finite loss ends the run
        before anything of the bad state is saved. Returns the step's loss, or None if the
        step was skipped (policy ``skip``)."""
        self._check_overflow(metrics)
        if self.step_config.skip_nonfinite and bool(to_host(metrics["skipped"])):
            return None
        loss = float(to_host(metrics["loss"]))
        if not np.isfinite(loss):
            self._nonfinite_at = step
            last = None
            if self._checkpointer is not None:
                with contextlib.suppress(UserError):
                    last = self._checkpointer.latest_step()
            kept = (f"the last checkpoint (iter {last}) is kept" if last is not None
                    else "no checkpoint was written")
            raise NonFiniteLoss(
                f"training loss is {loss} at iter {step}: the run stopped and saved nothing "
                f"of this state ({kept}); lower the learning rate, check the data, or set "
                "solver.nan_policy to \"skip\" to skip such batches")
        return loss

    def fit(self, max_iter: int | None = None) -> list[dict[str, Any]]:
        """Train until iteration ``max_iter`` (or the solver's ``max_iter`` / ``num_epochs``;
        a resumed run counts the iterations done before), evaluating the validation set every
        ``eval_interval`` steps or after every epoch, and at the end; early stopping may end
        it sooner and put back the best evaluation's state; then the test sets are scored.
        Returns the recorded history.

        On any exit (an error, Ctrl-C, SIGTERM) a snapshot in flight is finished, or removed
        with a message; the checkpoint directory is released."""
        if self._nonfinite_at is not None:
            raise NonFiniteLoss(f"the state went non-finite at iter {self._nonfinite_at}; "
                                "build a new Trainer (or restore a checkpoint) first")
        self.check_before_training(max_iter)
        try:
            return self._fit(max_iter)
        finally:
            if self._checkpointer is not None:
                self._checkpointer.finish(report=self._print)

    def _fit(self, max_iter: int | None) -> list[dict[str, Any]]:
        s = self.solver
        if s.kafka_sink is not None:
            _ = self.sink  # a broker that does not answer is reported before the first step
        max_iter = max_iter or s.max_iter
        epochs = None if max_iter else s.num_epochs
        # evaluating after each epoch: epochs end on a (padded) batch of their own
        reader_epochs = epochs or (1 << 40 if s.eval_every_epoch else None)
        local_batch = s.batchsize // jax.process_count()
        reads = self.train_data.batches_with_position(local_batch, epochs=reader_epochs,
                                                      start=self.reader_position)
        if jax.process_count() > 1 and reader_epochs is not None:
            reads = self._even_epochs(reads, local_batch)
        batches = Prefetcher(reads, transform=self._to_step_input)
        self._print(f"[jctr] training {', '.join(e.name for e in self.cfg.embeddings)} + "
                    f"{len(self.cfg.layers)} dense layers; batch {s.batchsize}; "
                    f"{'max_iter ' + str(max_iter) if max_iter else str(epochs) + ' epoch(s)'}")
        done = int(to_host(self.state.step))
        start_step = done
        epoch = (self.reader_position or ReaderPosition()).epoch
        self._record("start", iter=done, config=self.cfg.raw, batchsize=s.batchsize,
                     devices=self.num_devices, processes=jax.process_count())
        t0 = time.perf_counter()
        window_t, window_n = t0, 0
        run = _RunTally()
        prev = None
        stop = False
        evaluated_at = None  # the last evaluation's iteration: the final one is not repeated
        # a bar on a terminal (the default printer only); log lines go above it
        printer = self._print
        last_iter = max_iter
        if epochs:  # for the ETA; each epoch ends on a (padded) batch of its own
            last_iter = epochs * -(-self._train_records // local_batch) or None
        progress = Progress(last_iter, done, printer, bar=None if self._default_print else False)
        one_in_flight = self.memory_plan.steps_in_flight == 1
        self._print = progress.write
        try:
            for batch, position, fits, filled, touched in batches:
                if jax.process_count() > 1:  # every process must run the same program
                    from jax.experimental import multihost_utils

                    fits = bool(np.all(multihost_utils.process_allgather(np.array([fits]))))
                if not fits:
                    run.fallback_steps += 1
                step_fn = self.train_step if fits else self.train_step_full
                self.state, metrics = step_fn(self.state, batch)
                if one_in_flight:
                    # done before anything else is dispatched (the next step, an evaluation):
                    # XLA allocates a computation's temporaries when it is dispatched
                    jax.block_until_ready(metrics)
                if touched is not None:  # the step number from the loop: no device sync
                    self._note_updates(touched, done + 1)
                if self.auc_buckets:  # stays on the devices: no wait for the step
                    counts = metrics["auc_counts"]
                    self._auc_counts = (counts if self._auc_counts is None
                                        else self._auc_counts + counts)
                self.reader_position = position
                if prev is not None:  # one step behind: no stall of the pipeline
                    run.add(self._check_step(*prev[:2]), prev[2])
                done += 1
                prev = (metrics, done, filled)
                window_n += s.batchsize
                if progress.compile_s is None:  # the first step compiles: timed apart
                    jax.block_until_ready(metrics)
                    progress.first_step_done(time.perf_counter() - t0)
                    self._print(f"[jctr] first step (its first batch read and placed) "
                                f"{progress.compile_s:.1f} s")
                    window_t, window_n = time.perf_counter(), 0
                else:
                    progress.tick(done)
                if done % s.display == 0:
                    loss = float(to_host(metrics["loss"]))
                    now = time.perf_counter()
                    steps = max(window_n // s.batchsize, 1)
                    rate = window_n / max(now - window_t, 1e-9)
                    step_ms = 1e3 * (now - window_t) / steps
                    window_t, window_n = now, 0
                    lr = self._learning_rate(done)
                    progress.update(done, loss, rate)
                    self._print(f"[jctr] iter {done}"
                                + (f"/{max_iter}" if max_iter else "")
                                + f"  loss {loss:.5f}  {rate:,.0f} samples/s"
                                + (f"  ({run.skipped} non-finite batches skipped)"
                                   if run.skipped else "") + progress.suffix(done))
                    self._record("train", iter=done, loss=loss, samples_per_s=rate,
                                 step_time_ms=step_ms, lr=lr,
                                 **({"skipped": run.skipped} if run.skipped else {}))
                epoch_ended = position.epoch > epoch
                eval_now = (done % s.eval_interval == 0 and not (max_iter and done == max_iter)
                            if not s.eval_every_epoch else epoch_ended)
                if prev is not None and (eval_now or epoch_ended
                                         or (s.snapshot and done % s.snapshot == 0)):
                    run.add(self._check_step(*prev[:2]), prev[2])  # the state is sound
                    prev = None
                if epoch_ended:
                    mean = run.end_epoch()
                    self._print(f"[jctr] epoch {epoch + 1} done at iter {done}"
                                + (f": mean training loss {mean:.5f}" if mean is not None
                                   else ""))
                    self._record("epoch", epoch=epoch + 1, iter=done, train_loss=mean)
                    epoch = position.epoch
                if eval_now:
                    stop = self._eval_and_report(done, epoch=epoch if epoch_ended else None)
                    evaluated_at = done
                if s.snapshot and done % s.snapshot == 0:
                    self.save_checkpoint()
                if stop or (max_iter and done >= max_iter):
                    break
            if prev is not None:
                run.add(self._check_step(*prev[:2]), prev[2])
            jax.block_until_ready(self.state)
            elapsed = time.perf_counter() - t0
            trained = done - start_step
            steady = elapsed - (progress.compile_s or 0.0)
            steady_rate = (max(trained - 1, 0) * s.batchsize / steady if steady > 0 else 0.0)
            self._record("summary", iters=trained,
                         samples_per_s=trained * s.batchsize / max(elapsed, 1e-9),
                         steady_samples_per_s=steady_rate, compile_s=progress.compile_s,
                         elapsed_s=elapsed, routing_fallback_steps=run.fallback_steps,
                         skipped_nonfinite=run.skipped)
            if self._checkpointer is not None:
                self._checkpointer.wait()
            if not stop and evaluated_at != done:
                self._eval_and_report(done)
        finally:
            batches.close()
            progress.close()
            self._print = printer
        self._restore_best()
        if self.solver.kafka_sink is not None:
            self.publish_updates()  # what the last steps changed, and the final dense weights
            left = self.sink.flush(10.0 if self.sink.reachable else 0.0)
            if left:
                self._print(f"[jctr] warning: kafka_sink: {left} update message(s) not "
                            f"delivered yet ({self.sink.stats()['dropped']} dropped)")
        self._evaluate_test_sets()
        self._print(self._final_line(trained, elapsed, progress.compile_s, steady_rate))
        self._write_report()
        return self.history

    def _learning_rate(self, step: int) -> float:
        """The rate of the update after ``step`` updates: the schedule's (warm-up, decay)
        times the plateau factor."""
        return float(self._lr_at(step)) * float(to_host(self.state.lr_scale))

    def _final_line(self, trained: int, elapsed: float, compile_s: float | None,
                    rate: float) -> str:
        line = (f"[jctr] done: {trained} iterations in {format_seconds(elapsed)}"
                + (f" (first step {compile_s:.1f} s)" if compile_s is not None else "")
                + f", {rate:,.0f} samples/s after it")
        evals = [h for h in self.history if h["kind"] == "eval"]
        best = [h for h in evals if h.get("iter") == self._restored_best]
        if best:  # the model the run ends with is the restored best: its figures
            shown, label = best[-1], f"; restored best (iter {self._restored_best}): validation "
        elif evals:
            shown, label = evals[-1], "; validation "
        else:
            return line
        return line + label + ", ".join(f"{k} {v:.5f}" for k, v in shown.items()
                                        if isinstance(v, float) and k not in ("time", "lr"))

    def _eval_and_report(self, step: int, epoch: int | None = None) -> bool:
        """Evaluate the validation set, log it with the tables' norms and the learning rate,
        and let early stopping and the plateau schedule act. True: stop training."""
        result = self.evaluate()
        norms = self.embedding_norms()
        lr = self._learning_rate(step)
        parts = [f"{k} {v:.5f}" for k, v in result.items()]
        self._print(f"[jctr] eval at iter {step}" + (f" (epoch {epoch})" if epoch else "")
                    + ": " + "  ".join(parts) + "  |  " + "  ".join(
                        f"{name}: {n['rows']:,} rows, mean |row| {n['mean_norm']:.4f}"
                        for name, n in norms.items()))
        self._record("eval", iter=step, set="validation", **result,
                     **({"epoch": epoch} if epoch else {}), lr=lr, embedding_norms=norms)
        threshold = self.solver.auc_threshold
        if threshold is not None and result.get("AUC", 0.0) >= threshold:
            self._print(f"[jctr] AUC {result['AUC']:.5f} reached the threshold {threshold}; "
                        "stopping")
            return True
        if self.plateau is not None and self.plateau.update(result[self.plateau.metric],
                                                            step):
            self.state = with_lr_scale(self.state, self.plateau.scale)
            new_lr = self.cfg.optimizer.learning_rate * self.plateau.scale
            self._print(f"[jctr] validation {self.plateau.metric} has not improved for "
                        f"{self.plateau.cfg.patience} evaluation(s): learning rate "
                        f"{lr:.3g} -> {new_lr:.3g}")
            self._record("lr", iter=step, lr=new_lr, scale=self.plateau.scale)
        es = self.early_stopping
        if es is None:
            return False
        if es.update(result[es.metric], step):
            if es.cfg.restore_best_weights:
                self._best_copy = (step, self.placed.copy_to_host(self.state))
            return False
        if es.should_stop:
            self._print(f"[jctr] early stopping at iter {step}: validation {es.metric} has not "
                        f"improved on {es.best:.5f} (iter {es.best_iter}) for {es.wait} "
                        "evaluation(s)")
            self._record("early_stop", iter=step, best_iter=es.best_iter,
                         **{es.metric: es.best})
            return True
        return False

    def _restore_best(self) -> None:
        """Early stopping with restore_best_weights: go back to the best evaluation's state
        (dense, tables, optimizer) unless it is the current one."""
        es = self.early_stopping
        if es is None or not es.cfg.restore_best_weights or es.best_iter is None:
            return
        current = int(to_host(self.state.step))
        if es.best_iter == current:
            return
        if self._best_copy is not None and self._best_copy[0] == es.best_iter:
            self.state = self.placed.copy_to_devices(self._best_copy[1])
        else:  # the best came before a resume: its snapshot, if still kept
            try:
                self.state, _, _ = restore_snapshot(
                    self.checkpointer, self.cfg, self.step_config, self.state, self.placements,
                    es.best_iter, report=self._print, keep_positions=False)
            except UserError as e:
                self._print(f"[jctr] cannot restore the best weights (iter {es.best_iter}, "
                            f"before the resume): {e}; keeping the last ones")
                return
        self._print(f"[jctr] restored the weights of iter {es.best_iter} (validation "
                    f"{es.metric} {es.best:.5f})")
        self._record("restore_best", iter=es.best_iter, **{es.metric: es.best})
        self._restored_best = es.best_iter
        self._save_best(es)

    def _save_best(self, es) -> None:
        """A run that writes snapshots keeps the restored best as one (written now unless a
        snapshot of that iteration exists) and names it in ``best.json``: export takes it
        by default and the rotation keeps it."""
        if not self.solver.snapshot and self._checkpointer is None:
            return
        ckpt = self.checkpointer
        if jax.process_index() == 0:  # first: the rotation at sealing reads it
            ckpt.mark_best(es.best_iter, metric=es.metric, value=es.best)
        if es.best_iter not in ckpt.steps():
            self.save_checkpoint()
            ckpt.wait()
        self._print(f"[jctr] the best weights (iter {es.best_iter}) are the snapshot "
                    f"{ckpt.step_dir(es.best_iter)} (best.json names it; export takes it)")

    def _evaluate_test_sets(self) -> None:
        step = int(to_host(self.state.step))
        for name, source in self.cfg.data.test_sources:
            result = self.evaluate(data=self.test_data(name), where=source)
            self._print(f"[jctr] test \"{name}\" at iter {step}: "
                        + "  ".join(f"{k} {v:.5f}" for k, v in result.items()))
            self._record("test", iter=step, set=name, **result)

    def embedding_norms(self) -> dict[str, dict[str, float]]:
        """Per table: rows in use, their share of the table's capacity (``fill``) and their
        mean L2 norm (logged with every evaluation)."""
        out = {}
        for spec, es, (rows, total) in zip(self.specs, self.state.embeddings,
                                           self._norms(self.state.embeddings)):
            rows = int(to_host(rows))
            capacity = int(np.prod(es.row_slot.shape))  # every shard's rows
            out[spec.name] = {"rows": rows, "fill": rows / max(capacity, 1),
                              "mean_norm": float(to_host(total)) / max(rows, 1)}
        return out

    def _monitors(self) -> dict[str, Any]:
        return {name: m.state_dict() for name, m in (("early_stopping", self.early_stopping),
                                                     ("plateau", self.plateau)) if m}


    # ---- checkpoints and model files -----------------------------------------------------

    @property
    def checkpointer(self):
        if self._checkpointer is None:
            from jctr.checkpoint.manager import Checkpointer

            self._checkpointer = Checkpointer(self.solver.checkpoint_dir,
                                              keep=self.solver.snapshot_keep,
                                              on_sealed=self._on_sealed)
        return self._checkpointer

    def _on_sealed(self, step: int, path: str) -> None:
        self._print(f"[jctr] snapshot of iter {step} -> {path}")
        self._record("snapshot", iter=step, path=path)

    def network(self):
        """The dense network as a concrete NNX module (a view of the current state)."""
        return nnx.merge(self.step_config.graphdef, self.state.params, self.state.batch_stats)

    def _to_step_input(self, item):
        """A read (batch, position) as the train loop takes it: the batch on the devices, its
        position, whether its keys fit the routing buffers, and its share of real samples.
        Runs in the reader's thread; :attr:`batch_hooks` (streaming statistics) see the host
        batch first."""
        batch, position = item
        for hook in self.batch_hooks:
            hook(batch)
        touched = None
        if self.solver.kafka_sink is not None:  # the keys this step updates, per table
            b = batch.label.shape[0]
            touched = [np.unique(batch.keys[s.input_index][batch.segments[s.input_index]
                                                           < b * s.slot_num])
                       for s in self.specs]
        return (self.placed.to_devices(batch, True), position, self.placed.routing_fits(batch),
                float(np.mean(batch.mask)), touched)

    def _even_epochs(self, reads, local_batch: int):
        """Every process the same number of steps per epoch (the processes step together):
        one whose share of the files is smaller ends each epoch with batches of padding only.
        An epoch entered part way (a resumed run) is not padded."""
        from jax.experimental import multihost_utils

        mine = -(-self._train_records // local_batch)  # this process's batches per epoch
        most = int(np.max(multihost_utils.process_allgather(np.array([mine], np.int64))))
        start = self.reader_position
        counting = start is None or (start.file_index == 0 and start.record == 0)
        count, empty = 0, None
        for batch, position in reads:
            yield batch, position
            count += 1
            if empty is None:
                empty = _padding_batch(batch, self.cfg.data)
            if position.file_index == 0 and position.record == 0:  # the epoch ended here
                while counting and count < most:
                    yield empty, position
                    count += 1
                count, counting = 0, True

    def drop_keys(self, table: int, keys: np.ndarray) -> int:
        """Delete ``keys`` from embedding ``table`` and free their rows (streaming training's
        shrink): the kept keys, values and optimizer rows are re-inserted into a fresh table,
        whose free rows hold initial values again. Returns the rows in use afterwards."""
        stored = export_placed(self.state.embeddings[table], self.placements[table])
        keep = ~np.isin(stored["keys"], np.asarray(keys, np.int64))
        self.put_rows(table, {k: v[keep] for k, v in stored.items()}, replace=True)
        return int(keep.sum())

    def put_rows(self, table: int, stored: dict[str, np.ndarray], *,
                 replace: bool = False) -> None:
        """Insert stored rows (keys, values, optimizer rows, slot ids: a
        :mod:`jctr.checkpoint.tables` dict) into embedding ``table``; ``replace``: into an
        empty table instead (every other key leaves). Streaming training moves its working
        set between a database and the device table with this."""
        spec, placement = self.specs[table], self.placements[table]
        current = self.state.embeddings[table]
        base = current
        if replace:  # a key's row gets its initial vector when inserted: no reset needed
            base = init_embedding(spec)
            if placement is not None and placement.sharded:
                base = jax.tree.map(lambda x: jnp.broadcast_to(x, (placement.num_shards,)
                                                               + x.shape), base)
        filled = import_placed(spec, base, stored, placement, source=f"rows of {spec.name}")
        filled = jax.device_put(filled, jax.tree.map(lambda x: x.sharding, current))
        embeddings = list(self.state.embeddings)
        embeddings[table] = filled
        self.state = self.state._replace(embeddings=tuple(embeddings))

    def scale_slot(self, table: int, name: str, factors: tuple[float, ...]) -> None:
        """Multiply the columns of optimizer slot ``name`` of embedding ``table`` by
        ``factors`` (streaming training's daily decay of the admission counts)."""
        embeddings = list(self.state.embeddings)
        es = embeddings[table]
        scaled = _scale(es.slots[name], jnp.asarray(factors, jnp.float32))
        embeddings[table] = es._replace(slots={**es.slots, name: scaled})
        self.state = self.state._replace(embeddings=tuple(embeddings))

    def use_training_data(self, source: str, dataset: Dataset | None = None) -> None:
        """Train on another file list from now on (streaming training: each pass its own
        files); the reader starts at its beginning. ``dataset``: ``source`` already opened
        (:meth:`open_training_data`, e.g. read into memory meanwhile). Nothing is compiled
        again."""
        self.cfg = dataclasses.replace(self.cfg, data=dataclasses.replace(self.cfg.data,
                                                                          source=source))
        self._train_data = dataset
        self.reader_position = None

    def save_checkpoint_to(self, directory: str) -> str:
        """Snapshot the state into a checkpoint directory of its own (streaming training's
        ``<save_model_path>/<day>/<pass>/``), complete on return; returns the step's
        folder."""
        from jctr.checkpoint.manager import Checkpointer

        if self._nonfinite_at is not None:
            raise NonFiniteLoss(f"not saving: the state went non-finite at iter "
                                f"{self._nonfinite_at}")
        ckpt = Checkpointer(directory, keep=1)
        if jax.process_index() == 0:
            ckpt.acquire(report=self._print)
        try:
            step = save_snapshot(ckpt, self.cfg, self.step_config, self.state, self.placements,
                                 readers=[vars(ReaderPosition())] * jax.process_count(),
                                 devices=self.num_devices, monitors=self._monitors())
            ckpt.wait()
        finally:
            ckpt.finish(report=self._print)
        return ckpt.step_dir(step)

    def save_checkpoint(self) -> int:
        """Snapshot the whole state (asynchronously) plus the BatchNorm JSON beside it; the
        snapshot is reported once it is complete on disk. Refuses a state that went
        non-finite."""
        if self._nonfinite_at is not None:
            raise NonFiniteLoss(f"not saving: the state went non-finite at iter "
                                f"{self._nonfinite_at}")
        pos = self.reader_position or ReaderPosition()
        readers = [vars(pos)]
        if jax.process_count() > 1:  # every process reads its own files: keep every position
            from jax.experimental import multihost_utils

            mine = np.array([pos.epoch, pos.file_index, pos.record], np.int64)
            allpos = np.asarray(multihost_utils.process_allgather(mine))
            readers = [dict(zip(("epoch", "file_index", "record"), map(int, row)))
                       for row in allpos.reshape(-1, 3)]
        all_processes(self._prepare_checkpoints, "prepare the checkpoint directory")
        return save_snapshot(self.checkpointer, self.cfg, self.step_config, self.state,
                             self.placements, readers=readers, devices=self.num_devices,
                             monitors=self._monitors())

    def restore_checkpoint(self, step: int | None = None, directory: str | None = None) -> int:
        """Continue from a checkpoint (default: the latest under the solver's directory):
        state, RNG, schedule position and the training reader's position. A checkpoint of a
        config with another model structure is refused, naming the fields that differ."""
        from jctr.checkpoint.manager import Checkpointer

        ckpt = Checkpointer(directory, keep=self.solver.snapshot_keep) if directory \
            else self.checkpointer
        self.state, reader, meta = restore_snapshot(
            ckpt, self.cfg, self.step_config, self.state, self.placements, step,
            report=self._print, keep_positions=directory is None)
        self.reader_position = ReaderPosition(**reader)
        for name, monitor in (("early_stopping", self.early_stopping),
                              ("plateau", self.plateau)):
            if monitor is not None:
                monitor.load_state_dict(meta.get("monitors", {}).get(name, {}))
        self._best_copy = None
        self._resumed = directory is None
        self._continues_log = True
        if self._resumed:
            ckpt.resumed_from(int(meta.get("step", 0)))
        self._nonfinite_at = None
        step = int(to_host(self.state.step))
        self._print(f"[jctr] resumed from iter {step} ({ckpt.directory}, written on "
                    f"{meta.get('devices', 1)} device(s), restored on {self.num_devices})")
        return step

    def save_model_files(self, prefix: str) -> list[str]:
        """HugeCTR-style files: ``<prefix>dense_<iter>.model``, one
        ``<prefix><embedding>_sparse_<iter>.model`` folder per embedding and
        ``<prefix>non_trainable_<iter>.json``
        (:func:`jctr.checkpoint.model_files.save_model_files`)."""
        return save_model_files(prefix, self.step_config, self.state, self.placements)

    def load_model_files(self, dense: str | None, sparse: tuple[str, ...] = ()) -> None:
        """Warm start from HugeCTR-style model files (optimizer state starts fresh)."""
        self.state = load_model_files(self.step_config, self.state, dense, sparse,
                                      self.placements, self.placed.put_replicated)

    # ---- evaluation and prediction ------------------------------------------------------

    def evaluate(self, num_batches: int | None = None, data: Dataset | str | None = None, *,
                 where: str | None = None) -> dict[str, float]:
        """Metrics of the solver's ``eval_metrics`` over the evaluation set, or ``data`` (a
        :class:`Dataset`, or a path read like the Data layer's eval_source): all of it, or its
        first ``num_batches`` (default: the solver's ``eval_batches``, if set) batches. Padding
        samples never count. ``where`` names ``data`` in errors.

        Example::

            trainer.evaluate(data="data/test/_file_list.txt")   # {"AUC": ..., ...}
        """
        s = self.solver
        num_batches = num_batches or s.eval_batches
        where = where or "the dataset"
        if data is None:
            data, where = self.eval_data, self.cfg.data.eval_source
        elif not isinstance(data, Dataset):
            where = os.fspath(data)
            data = self._open_eval(where)
        labels, preds = [], []
        for i, batch in enumerate(data.batches(s.batchsize_eval, epochs=1)):
            if num_batches is not None and i >= num_batches:
                break
            pred = self._predict_all(batch)
            m = batch.mask
            labels.append(batch.label[m, 0])
            preds.append(pred[m] if pred.ndim == 1 else pred[m, 0])
        if not labels:
            raise DataError(f"{where}: no samples to evaluate")
        y = np.concatenate(labels)
        p = np.concatenate(preds)
        out: dict[str, float] = {}
        for metric in s.eval_metrics:
            out[metric.name] = auc(y, p) if metric.name == "AUC" else log_loss(y, p)
        return out

    def _predict_all(self, batch: Batch) -> np.ndarray:
        """Predictions for every sample of a host batch (every process passes the same one)."""
        _, pred = self.eval_step(self.state,
                                 self.placed.to_devices(self.placed.process_share(batch), False))
        return to_host(pred)

    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities of the batch's real samples (padding dropped). A batch that does
        not match the Data layer (key dtype, slot count, dense width) is a
        :class:`jctr.data.batch.BatchError`."""
        batch = check_batch(batch, self.cfg.data)
        return self._predict_all(batch)[batch.mask]


_scale = jax.jit(lambda x, f: x * f)


def _padding_batch(like: Batch, data) -> Batch:
    """A batch shaped like ``like`` with no sample in it (every key is padding)."""
    b = like.label.shape[0]
    return Batch(np.zeros_like(like.label), np.zeros_like(like.dense),
                 tuple(np.zeros_like(k) for k in like.keys),
                 tuple(np.full_like(seg, b * sp.slot_num)
                       for seg, sp in zip(like.segments, data.sparse)),
                 np.zeros_like(like.mask))


_RUN_LOG_FILES = ("metrics.jsonl", "report.html", "report_files", "tensorboard")


def _move_previous_run(log_dir: str) -> str:
    """Move a previous run's log files (only those a run writes) into ``previous-<n>/``."""
    n = 1
    while os.path.exists(os.path.join(log_dir, f"previous-{n}")):
        n += 1
    target = os.path.join(log_dir, f"previous-{n}")
    os.makedirs(target)
    for name in _RUN_LOG_FILES:
        if os.path.exists(os.path.join(log_dir, name)):
            os.rename(os.path.join(log_dir, name), os.path.join(target, name))
    return target
