"""The training loop: data in, jitted steps, evaluations and snapshots at their intervals.

The loop reads top to bottom in :meth:`Trainer._fit`; what it logs (:mod:`jctr.train.run_log`),
its snapshots (:mod:`jctr.train.run_checkpoints`), evaluation and what validation decides
(:mod:`jctr.train.evaluation`) and its data sets (:mod:`jctr.train.datasets`) live in modules
of their own, and features attach through :class:`jctr.train.hooks.Hook` (streaming
statistics, pass AUC, the Kafka publisher).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.checkpoint.model_files import load_model_files, save_model_files
from jctr.config import ModelConfig, load_config, override_optimizer, override_solver
from jctr.data.batch import Batch, check_batch
from jctr.data.dataset import Dataset
from jctr.data.loader import Prefetcher, ReaderPosition
from jctr.data.tools.synthetic import generate_for_config
from jctr.embedding.sparse_embedding import check_score_functions
from jctr.errors import UserError
from jctr.models.ctr import TrainState, build_model, make_eval_step, with_lr_scale
from jctr.runtime.cpu import describe_cpu_setup
from jctr.runtime.xla_options import step_compiler_options
from jctr.sharding import to_host
from jctr.sharding.distributed import all_processes
from jctr.sharding.placed_model import PlacedModel, dense_bytes
from jctr.train.datasets import RunData
from jctr.train.dense_optimizer import dense_optimizer
from jctr.train.evaluation import Evaluator, ValidationJudge, describe_norms, embedding_norms
from jctr.train.hooks import FitSummary, Hook, config_hooks
from jctr.train.progress import Progress, StepMeter, final_line
from jctr.train.run_checkpoints import RunCheckpoints
from jctr.train.run_log import RunLog
from jctr.train.schedules import learning_rate_schedule
from jctr.train.step import make_train_step
from jctr.train.step_checks import (
    NonFiniteLoss,
    RunTally,
    check_iterations,
    check_overflow,
    nonfinite_error,
)
from jctr.train.step_memory import plan_step_memory

__all__ = ["NonFiniteLoss", "Trainer"]


class Trainer:
    """Trains a model described by a parsed config.

    The contract: :meth:`from_config`, :meth:`fit` (returns a :class:`FitSummary`),
    :meth:`evaluate`, :meth:`predict`, :meth:`network`, :meth:`save_checkpoint`,
    :meth:`restore_checkpoint`, :meth:`save_model_files`, :meth:`load_model_files`;
    ``state`` (the training state, one pytree; yours to replace), ``cfg``, ``specs`` (the
    embedding tables), ``placed`` (where the state lives: ``placements``, ``mesh``),
    ``data`` (the run's data sets), ``history`` (every record logged) and ``hooks``.

    Example::

        trainer = Trainer.from_config("configs/dlrm_synthetic.json", max_iter=200)
        trainer.fit()                # FitSummary(iterations=200, loss=..., validation=...)
        trainer.evaluate()           # {"AUC": ..., "AverageLoss": ...}
        trainer.predict(batch)       # click probabilities, one per sample
    """

    def __init__(self, cfg: ModelConfig, *, log: Callable[[str], None] | None = None,
                 generate_data: bool = True, force: bool = False, hooks: Sequence[Hook] = ()):
        self.cfg = cfg
        self.solver = cfg.solver
        quiet = jax.process_index() != 0  # one process reports for all
        self._default_print = log is None and not quiet
        self._print = log or (lambda s: None if quiet else print(s, file=sys.stderr, flush=True))
        report = lambda line: self._print(line)  # noqa: E731 - during fit: above the bar
        if generate_data:  # process 0 writes; the others wait for the files (or its error)
            all_processes(lambda: generate_for_config(cfg) if jax.process_index() == 0
                          else None, "generate the synthetic data")
        self.step_config, init_model = build_model(cfg)
        check_score_functions(cfg)
        self._dense_tx = dense_optimizer(cfg.optimizer)
        init_state = lambda: init_model(self._dense_tx)  # noqa: E731
        self.specs = self.step_config.specs
        self.placed = PlacedModel(cfg, self.specs, dense_bytes=dense_bytes(init_state))
        self._print(self.placed.describe())
        if jax.default_backend() == "cpu":
            for line in describe_cpu_setup(cfg.solver.compute_dtype):
                self._print(line)
        self.hooks: list[Hook] = [*hooks, *config_hooks(self, report)]
        self._jit_steps()
        # the steps are compiled (and the first call reuses them) before any table exists,
        # so that a step that will not fit is refused with XLA's figures, not killed
        self.memory_plan = plan_step_memory(self.placed, cfg, self.train_step,
                                            self.eval_step, init_state, self._print)
        self.state: TrainState = self.placed.create(init_state)
        self.data = RunData(cfg, cache_reserve=self.memory_plan.transient, report=report)
        self.run_log = RunLog(cfg.solver.log_dir, source=cfg.source, report=report)
        self.checkpoints = RunCheckpoints(cfg, self.step_config, self.placed, force=force,
                                          report=report, record=self.run_log.record)
        self.evaluator = Evaluator(cfg, self.eval_step, self.placed, self.data, report=report,
                                   record=self.run_log.record)
        self.judge = ValidationJudge(cfg, report=report, record=self.run_log.record)
        self._force = force
        self.reader_position: ReaderPosition | None = None  # after the last consumed batch
        self._continues_log = False  # restored from a checkpoint: its log goes on
        self._nonfinite_at: int | None = None  # the state went bad at this iteration
        self._best_copy = None  # host copy of the state at early stopping's best evaluation
        self._restored_best: int | None = None  # the iteration restore_best_weights went to
        self._lr_at = jax.jit(learning_rate_schedule(cfg.optimizer))
        if cfg.solver.dense_model_file or cfg.solver.sparse_model_file:
            self.load_model_files(cfg.solver.dense_model_file, cfg.solver.sparse_model_file)

    # where the state lives (jctr.sharding.placed_model)
    mesh = property(lambda self: self.placed.mesh)
    placements = property(lambda self: self.placed.placements)
    history = property(lambda self: self.run_log.history, doc="the records kept (RunLog)")

    @classmethod
    def from_config(cls, config: str | os.PathLike | dict, *, generate_data: bool = True,
                    force: bool = False, optimizer: dict | None = None,
                    hooks: Sequence[Hook] = (), **solver_overrides) -> Trainer:
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
        return cls(cfg, generate_data=generate_data, force=force, hooks=hooks)

    def _jit_steps(self) -> None:
        """The jitted steps for this placement: on a mesh, small all-to-all send buffers for
        the usual batch and full ones (compiled on first need) for a batch whose keys crowd
        onto a device. Hooks may ask the train step to count predictions (``auc_buckets``)."""
        opts = step_compiler_options(self.solver.compute_dtype)
        placed = self.placed
        buckets = max((h.auc_buckets for h in self.hooks), default=0)
        if any(h.auc_buckets not in (0, buckets) for h in self.hooks):
            raise ValueError("hooks ask for different auc_buckets; give them one count")
        engines = (None,) if placed.mesh is None else (placed.engine, placed.engine_full)
        steps = [placed.jit(make_train_step(self.step_config, self._dense_tx, e, buckets),
                            donate_state=True, returns_state=True, compiler_options=opts)
                 for e in engines]
        self.train_step, self.train_step_full = steps[0], steps[-1]
        self.eval_step = placed.jit(make_eval_step(self.step_config, placed.engine_full),
                                    compiler_options=opts)

    # ---- training -----------------------------------------------------------------------

    def check_before_training(self, max_iter: int | None = None) -> None:
        """Everything that can be checked before the first step: the iteration count, every
        training and evaluation file's header, the log folder, and for snapshots the checkpoint
        directory (owned by this run, writable, room for one snapshot). Every process checks;
        if one fails, all stop. ``fit`` calls this first."""
        check_iterations(self.cfg, int(to_host(self.state.step)), max_iter)

        def check() -> None:
            self.data.check()
            self.run_log.open(continues=self._continues_log, force=self._force)
            if self.solver.snapshot:
                self.checkpoints.prepare()

        all_processes(check, "pass the checks before training")

    def fit(self, max_iter: int | None = None, *, data: Dataset | None = None) -> FitSummary:
        """Train until iteration ``max_iter`` (or the solver's ``max_iter`` / ``num_epochs``;
        a resumed run counts the iterations done before), evaluating the validation set every
        ``eval_interval`` steps or after every epoch, and at the end; early stopping may end
        it sooner and put back the best evaluation's state; then the test sets are scored.
        ``data``: train on this set from its start, from now on (streaming training's pass;
        :func:`jctr.train.datasets.open_training_set` opens one).

        On any exit (an error, Ctrl-C, SIGTERM) a snapshot in flight is finished, or removed
        with a message; the checkpoint directory is released."""
        if self._nonfinite_at is not None:
            raise NonFiniteLoss(f"the state went non-finite at iter {self._nonfinite_at}; "
                                "build a new Trainer (or restore a checkpoint) first")
        if data is not None:
            self.data.use_training_set(data)
            self.reader_position = None
        self.check_before_training(max_iter)
        try:
            return self._fit(max_iter)
        finally:
            self.checkpoints.finish()

    def _fit(self, max_iter: int | None) -> FitSummary:
        s = self.solver
        for hook in self.hooks:
            hook.on_fit_start()
        max_iter = max_iter or s.max_iter
        epochs = None if max_iter else s.num_epochs
        batches = Prefetcher(self.data.reads(epochs, self.reader_position),
                             transform=self._to_step_input)
        done = start = int(to_host(self.state.step))
        epoch = (self.reader_position or ReaderPosition()).epoch
        self._print(f"[jctr] training {', '.join(e.name for e in self.cfg.embeddings)} + "
                    f"{len(self.cfg.layers)} dense layers; batch {s.batchsize}; "
                    f"{'max_iter ' + str(max_iter) if max_iter else str(epochs) + ' epoch(s)'}")
        self.run_log.record("start", iter=done, config=self.cfg.raw, batchsize=s.batchsize,
                            devices=self.placed.num_devices, processes=jax.process_count())
        progress = Progress(self.data.last_iteration(epochs) if epochs else max_iter, done,
                            self._print, bar=None if self._default_print else False)
        meter, tally, printer = StepMeter(s.batchsize, progress), RunTally(), self._print
        self._print = progress.write  # log lines go above the bar
        prev, stop, evaluated_at = None, False, None
        try:
            for batch, position, fits, filled, notes in batches:
                metrics = self._step(batch, fits, tally)
                for hook, note in zip(self.hooks, notes):
                    hook.on_step(done + 1, self.state, metrics, note)
                self.reader_position = position
                if prev is not None:  # one step behind: no stall of the pipeline
                    self._check_step(prev, tally)
                done += 1
                prev = (metrics, done, filled)
                meter.stepped(done, metrics)
                if done % s.display == 0:
                    self._display(done, max_iter, metrics, meter, tally)
                epoch_ended = position.epoch > epoch
                eval_now = (done % s.eval_interval == 0 and not (max_iter and done == max_iter)
                            if not s.eval_every_epoch else epoch_ended)
                snapshot_now = bool(s.snapshot) and done % s.snapshot == 0
                if prev is not None and (eval_now or epoch_ended or snapshot_now):
                    self._check_step(prev, tally)  # the state is sound
                    prev = None
                if epoch_ended:
                    self._end_epoch(epoch, done, tally)
                    epoch = position.epoch
                if eval_now:
                    stop = self._validate(done, epoch=epoch if epoch_ended else None)
                    evaluated_at = done
                if snapshot_now:
                    self.save_checkpoint()
                if stop or (max_iter and done >= max_iter):
                    break
            if prev is not None:
                self._check_step(prev, tally)
            jax.block_until_ready(self.state)
            totals = meter.totals(done - start)
            self.run_log.record("summary", iters=done - start, **totals,
                                routing_fallback_steps=tally.fallback_steps,
                                skipped_nonfinite=tally.skipped)
            self.checkpoints.wait()
            if not stop and evaluated_at != done:
                self._validate(done)
        finally:
            batches.close()
            progress.close()
            self._print = printer
        self._restore_best()
        at, validation = self.run_log.validation(self._restored_best)
        summary = FitSummary(
            iterations=done - start, step=int(to_host(self.state.step)), loss=tally.last_loss,
            validation=validation, stopped_early=stop,
            restored_best=at if at is not None and at == self._restored_best else None,
            routing_fallback_steps=tally.fallback_steps, skipped_nonfinite=tally.skipped,
            **totals)
        for hook in self.hooks:
            hook.on_fit_end(self.state, summary)
        self.evaluator.score_test_sets(self.state)
        self._print(final_line(summary))
        self.run_log.write_report()
        return summary

    def _to_step_input(self, item):
        """A read (batch, position) as the train loop takes it: the batch on the devices, its
        position, whether its keys fit the routing buffers, its share of real samples and
        each hook's note. Runs in the reader's thread; the hooks see the host batch first."""
        batch, position = item
        notes = [hook.on_batch(batch) for hook in self.hooks]
        return (self.placed.to_devices(batch, True), position, self.placed.routing_fits(batch),
                float(np.mean(batch.mask)), notes)

    def _step(self, batch: Batch, fits: bool, tally: RunTally) -> dict[str, jax.Array]:
        """One train step; the state is replaced (its buffers donated)."""
        if jax.process_count() > 1:  # every process must run the same program
            from jax.experimental import multihost_utils

            fits = bool(np.all(multihost_utils.process_allgather(np.array([fits]))))
        if not fits:
            tally.fallback_steps += 1
        step_fn = self.train_step if fits else self.train_step_full
        self.state, metrics = step_fn(self.state, batch)
        if self.memory_plan.steps_in_flight == 1:
            # done before anything else is dispatched (the next step, an evaluation): XLA
            # allocates a computation's temporaries when it is dispatched
            jax.block_until_ready(metrics)
        return metrics

    def _check_step(self, prev: tuple, tally: RunTally) -> None:
        """After a step (its metrics, iteration, share of real samples): a full table or
        (policy ``stop``) a non-finite loss ends the run before anything of the bad state is
        saved; its loss goes to ``tally`` (None: skipped, policy ``skip``)."""
        metrics, step, weight = prev
        check_overflow(metrics, self.specs, self.state)
        if self.step_config.skip_nonfinite and bool(to_host(metrics["skipped"])):
            tally.add(None, weight)
            return
        loss = float(to_host(metrics["loss"]))
        if not np.isfinite(loss):
            self._nonfinite_at = step
            raise nonfinite_error(loss, step, self.checkpoints.latest_step())
        tally.add(loss, weight)

    def _display(self, done: int, max_iter: int | None, metrics, meter: StepMeter,
                 tally: RunTally) -> None:
        loss = float(to_host(metrics["loss"]))
        line, rate, step_ms = meter.display(done, max_iter, loss, tally.skipped)
        self._print(line)
        self.run_log.record("train", iter=done, loss=loss, samples_per_s=rate,
                            step_time_ms=step_ms, lr=self._learning_rate(done),
                            **({"skipped": tally.skipped} if tally.skipped else {}))

    def _end_epoch(self, epoch: int, done: int, tally: RunTally) -> None:
        mean = tally.end_epoch()
        self._print(f"[jctr] epoch {epoch + 1} done at iter {done}"
                    + (f": mean training loss {mean:.5f}" if mean is not None else ""))
        self.run_log.record("epoch", epoch=epoch + 1, iter=done, train_loss=mean)

    def _learning_rate(self, step: int) -> float:
        """The rate of the update after ``step`` updates: the schedule's (warm-up, decay)
        times the plateau factor."""
        return float(self._lr_at(step)) * float(to_host(self.state.lr_scale))

    def _validate(self, step: int, epoch: int | None = None) -> bool:
        """Evaluate the validation set, log it with the tables' norms and the learning rate,
        and apply what it decides (:class:`ValidationJudge`). True: stop training."""
        result = self.evaluate()
        norms = embedding_norms(self.specs, self.state)
        lr = self._learning_rate(step)
        self._print(f"[jctr] eval at iter {step}" + (f" (epoch {epoch})" if epoch else "")
                    + ": " + "  ".join(f"{k} {v:.5f}" for k, v in result.items()) + "  |  "
                    + describe_norms(norms))
        self.run_log.record("eval", iter=step, set="validation", **result,
                            **({"epoch": epoch} if epoch else {}), lr=lr, embedding_norms=norms)
        verdict = self.judge.judge(result, step, lr,
                                   (self.reader_position or ReaderPosition()).last_epoch)
        if verdict.lr_scale is not None:
            self.state = with_lr_scale(self.state, verdict.lr_scale)
        if verdict.best:
            self._best_copy = (step, self.placed.copy_to_host(self.state))
        return verdict.stop

    def _restore_best(self) -> None:
        """Early stopping with restore_best_weights: go back to the best evaluation's state
        (dense, tables, optimizer) unless it is the current one."""
        es = self.judge.early_stopping
        best = self.judge.best_to_restore(int(to_host(self.state.step)))
        if best is None:
            return
        if self._best_copy is not None and self._best_copy[0] == best:
            self.state = self.placed.copy_to_devices(self._best_copy[1])
        else:  # the best came before a resume: its snapshot, if still kept
            try:
                self.state = self.checkpoints.restore_step(self.state, best)
            except UserError as e:
                self._print(f"[jctr] cannot restore the best weights (iter {best}, before the "
                            f"resume): {e}; keeping the last ones")
                return
        self._print(f"[jctr] restored the weights of iter {best} (validation {es.metric} "
                    f"{es.best:.5f})")
        self.run_log.record("restore_best", iter=best, **{es.metric: es.best})
        self._restored_best = best
        self.checkpoints.keep_best(best, es.metric, es.best, self.save_checkpoint)

    # ---- checkpoints and model files -----------------------------------------------------

    def save_checkpoint(self, directory: str | None = None, **to_directory: Any) -> int:
        """Snapshot the whole state plus the BatchNorm JSON beside it: into the solver's
        checkpoint directory (asynchronously; reported once complete on disk), or into
        ``directory`` of its own (streaming training's ``<day>/<pass>/``; complete on return,
        no reader position; ``to_directory``: ``meanwhile``, ``then`` and ``replace`` of
        :meth:`jctr.train.run_checkpoints.RunCheckpoints.save_to`). Returns the step.
        Refuses a state that went non-finite."""
        if self._nonfinite_at is not None:
            raise NonFiniteLoss(f"not saving: the state went non-finite at iter "
                                f"{self._nonfinite_at}")
        monitors = self.judge.state_dict()
        if directory is not None:
            self.checkpoints.save_to(directory, self.state, monitors, **to_directory)
            return int(to_host(self.state.step))
        return self.checkpoints.save(self.state, self.reader_position, monitors)

    def restore_checkpoint(self, step: int | None = None, directory: str | None = None) -> int:
        """Continue from a checkpoint (default: the latest under the solver's directory):
        state, RNG, schedule position and the training reader's position. A checkpoint of a
        config with another model structure is refused, naming the fields that differ."""
        for hook in self.hooks:  # e.g. tables that grew in the saved run grow first
            hook.before_restore(step, directory)
        self.state, self.reader_position, meta = self.checkpoints.restore(self.state, step,
                                                                          directory)
        self.judge.load_state_dict(meta.get("monitors", {}))
        self._best_copy = None
        self._continues_log = True
        self._nonfinite_at = None
        return int(to_host(self.state.step))

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

    def network(self):
        """The dense network as a concrete NNX module (a view of the current state)."""
        return nnx.merge(self.step_config.graphdef, self.state.params, self.state.batch_stats)

    def evaluate(self, num_batches: int | None = None, data: Dataset | str | None = None, *,
                 where: str | None = None) -> dict[str, float]:
        """Metrics of the solver's ``eval_metrics`` over the evaluation set, or ``data`` (a
        :class:`Dataset`, or a path read like the Data layer's eval_source): all of it, or its
        first ``num_batches`` (default: the solver's ``eval_batches``, if set) batches. Padding
        samples never count. ``where`` names ``data`` in errors.

        Example::

            trainer.evaluate(data="data/test/_file_list.txt")   # {"AUC": ..., ...}
        """
        return self.evaluator.evaluate(self.state, num_batches, data, where)

    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities of the batch's real samples (padding dropped). A batch that does
        not match the Data layer (key dtype, slot count, dense width) is a
        :class:`jctr.data.batch.BatchError`."""
        batch = check_batch(batch, self.cfg.data)
        return self.evaluator.predict(self.state, batch)[batch.mask]
