"""A training run's snapshots in ``solver.checkpoint_dir``: owning the directory (another run's
checkpoints are refused unless resumed or ``--force``), room for one snapshot, saving with
every process's reader position, resuming, and keeping early stopping's best. Snapshots into a
directory of their own (streaming training's ``<day>/<pass>/``) complete before returning.

Example::

    ckpts = RunCheckpoints(cfg, step_config, placed, force=False, report=print,
                           record=log.record)
    ckpts.prepare(resumed=False)
    ckpts.save(state, position, monitors={})
    ckpts.finish()
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jctr.checkpoint.manager import ROWS, Checkpointer, CheckpointError, export_tables, read_rows
from jctr.checkpoint.snapshots import restore_snapshot, save_snapshot
from jctr.config import ModelConfig
from jctr.data.loader import ReaderPosition
from jctr.errors import UserError
from jctr.models.ctr import StepConfig, TrainState
from jctr.sharding.distributed import all_processes
from jctr.sharding.mesh import to_host
from jctr.sharding.placed_model import PlacedModel


class RunCheckpoints:
    """The run's snapshots (see the module docstring). ``record`` logs each sealed one."""

    def __init__(self, cfg: ModelConfig, step_config: StepConfig, placed: PlacedModel, *,
                 force: bool, report: Callable[[str], None], record: Callable[..., Any]):
        self.cfg = cfg
        self.step_config = step_config
        self.placed = placed
        self.force = force  # a fresh run may replace another run's checkpoints
        self.report = report
        self.record = record
        self.resumed = False  # this run continues the directory's checkpoints
        self._ckpt: Checkpointer | None = None
        self._space_checked = False

    @property
    def checkpointer(self) -> Checkpointer:
        if self._ckpt is None:
            s = self.cfg.solver
            self._ckpt = Checkpointer(s.checkpoint_dir, keep=s.snapshot_keep,
                                      on_sealed=self._on_sealed)
        return self._ckpt

    def _on_sealed(self, step: int, path: str) -> None:
        self.report(f"[jctr] snapshot of iter {step} -> {path}")
        self.record("snapshot", iter=step, path=path)

    def prepare(self) -> None:
        """Own the directory (process 0): refuse another run's checkpoints unless this run
        resumed from them or was told to replace them; check room for one snapshot."""
        if jax.process_index() != 0:
            return
        ckpt = self.checkpointer
        ckpt.acquire(report=self.report)
        steps = [step for step in ckpt.steps() if step not in ckpt.sealed]
        if steps and not self.resumed:
            if not self.force:
                ckpt.release()
                raise CheckpointError(
                    f"{ckpt.directory}: holds checkpoints of another run (iters "
                    f"{', '.join(map(str, steps))}); continue that run with --resume, choose "
                    "another snapshot_prefix, or pass --force to replace them (they are "
                    "deleted once this run's first snapshot is written)")
            ckpt.replace_at_first_save(steps)
            self.report(f"[jctr] --force: the {len(steps)} checkpoint(s) in {ckpt.directory} "
                        "will be replaced by this run's first snapshot")
        if not self._space_checked:  # once; later a full disk fails that save cleanly
            ckpt.check_writable(sum(self.placed.plan.device_totals()))
            self._space_checked = True

    def save(self, state: TrainState, position: ReaderPosition | None,
             monitors: dict[str, Any]) -> int:
        """Start a snapshot (asynchronously) with every process's reader position; it is
        reported once complete on disk. Every process calls this. Returns the step."""
        pos = position or ReaderPosition()
        readers = [vars(pos)]
        if jax.process_count() > 1:  # every process reads its own files: keep every position
            from jax.experimental import multihost_utils

            mine = np.array([pos.epoch, pos.file_index, pos.record], np.int64)
            allpos = np.asarray(multihost_utils.process_allgather(mine))
            readers = [dict(zip(("epoch", "file_index", "record"), map(int, row)))
                       for row in allpos.reshape(-1, 3)]
        all_processes(self.prepare, "prepare the checkpoint directory")
        return save_snapshot(self.checkpointer, self.cfg, self.step_config, state,
                             self.placed.placements, readers=readers,
                             devices=self.placed.num_devices, monitors=monitors)

    def save_to(self, directory: str, state: TrainState, monitors: dict[str, Any], *,
                meanwhile: Callable[[dict | None], Any] | None = None,
                then: Callable[[dict | None], Any] | None = None,
                replace: bool = False) -> str:
        """A snapshot in a directory of its own, complete on return (no reader position: the
        caller knows where its data stands); returns the step's folder. ``meanwhile`` runs
        while the snapshot is written (streaming training's base model at a day's end), given
        the tables' rows the snapshot exported (by table name; None with several processes,
        which each export their own); ``then`` runs once the snapshot is sealed, given its
        rows as read-only maps of its files (:func:`jctr.checkpoint.manager.read_rows`; None
        with several processes): a model file of the same bytes becomes a link to them. If
        either fails, the snapshot is removed again. ``replace``: a snapshot of the same step
        in ``directory`` (an attempt the caller never recorded) is replaced, not refused."""
        ckpt = Checkpointer(directory, keep=1)
        if replace:
            ckpt.resumed_from(-1)  # every step there may be written again
        if jax.process_index() == 0:
            ckpt.acquire(report=self.report)
        try:
            # written before this returns, while nothing changes the state: views, no copy
            tables = export_tables(state, self.step_config.specs, self.placed.placements,
                                   copy=False)
            step = save_snapshot(ckpt, self.cfg, self.step_config, state,
                                 self.placed.placements,
                                 readers=[vars(ReaderPosition())] * jax.process_count(),
                                 devices=self.placed.num_devices, monitors=monitors,
                                 tables=tables)
            rows = os.path.join(ckpt.step_dir(step), ROWS)
            try:
                if meanwhile is not None:
                    meanwhile(tables if jax.process_count() == 1 else None)
                ckpt.wait()
                if then is not None:
                    then(read_rows(rows, mmap=True)
                         if jax.process_count() == 1 and os.path.isdir(rows) else None)
            except BaseException:
                with contextlib.suppress(BaseException):
                    ckpt.wait()
                if jax.process_index() == 0:  # this run's: the two go together or not at all
                    shutil.rmtree(ckpt.step_dir(step), ignore_errors=True)
                raise
        finally:
            ckpt.finish(report=self.report)
        return ckpt.step_dir(step)

    def restore(self, fresh: TrainState, step: int | None = None,
                directory: str | None = None) -> tuple[TrainState, ReaderPosition, dict]:
        """A snapshot onto ``fresh``: the solver's directory (the run resumes: later saves
        continue it) or another ``directory`` (its positions dropped)."""
        ckpt = (Checkpointer(directory, keep=self.cfg.solver.snapshot_keep) if directory
                else self.checkpointer)
        state, reader, meta = restore_snapshot(
            ckpt, self.cfg, self.step_config, fresh, self.placed.placements, step,
            report=self.report, keep_positions=directory is None)
        if directory is None:
            self.resumed = True
            ckpt.resumed_from(int(meta.get("step", 0)))
        self.report(f"[jctr] resumed from iter {int(to_host(state.step))} ({ckpt.directory}, "
                    f"written on {meta.get('devices', 1)} device(s), restored on "
                    f"{self.placed.num_devices})")
        return state, ReaderPosition(**reader), meta

    def stored_rows(self, step: int | None = None, directory: str | None = None
                    ) -> dict[str, int]:
        """Each table's stored rows in a snapshot (as :meth:`restore` would pick it), from
        its metadata; empty when it cannot be read (the restore then says why)."""
        ckpt = (Checkpointer(directory, keep=self.cfg.solver.snapshot_keep) if directory
                else self.checkpointer)
        try:
            tables = ckpt.read_meta(step).get("tables", {})
        except UserError:
            return {}
        return {name: int(t["rows"]) for name, t in tables.items()
                if isinstance(t, dict) and isinstance(t.get("rows"), int)}

    def restore_step(self, fresh: TrainState, step: int) -> TrainState:
        """The solver directory's snapshot of ``step`` (positions dropped); a
        :class:`jctr.errors.UserError` if it is not there."""
        state, _, _ = restore_snapshot(self.checkpointer, self.cfg, self.step_config, fresh,
                                       self.placed.placements, step, report=self.report,
                                       keep_positions=False)
        return state

    def keep_best(self, step: int, metric: str, value: float,
                  save: Callable[[], int]) -> None:
        """A run that writes snapshots keeps the restored best as one (``save`` writes it now
        unless a snapshot of that iteration exists) and names it in ``best.json``: export
        takes it by default and the rotation keeps it."""
        if not self.cfg.solver.snapshot and self._ckpt is None:
            return
        ckpt = self.checkpointer
        if jax.process_index() == 0:  # first: the rotation at sealing reads it
            ckpt.mark_best(step, metric=metric, value=value)
        if step not in ckpt.steps():
            save()
            ckpt.wait()
        self.report(f"[jctr] the best weights (iter {step}) are the snapshot "
                    f"{ckpt.step_dir(step)} (best.json names it; export takes it)")

    def latest_step(self) -> int | None:
        """The latest snapshot written, if any (None also when the directory is unreadable)."""
        if self._ckpt is None:
            return None
        with contextlib.suppress(UserError):
            return self._ckpt.latest_step()
        return None

    def wait(self) -> None:
        if self._ckpt is not None:
            self._ckpt.wait()

    def finish(self) -> None:
        """On any exit: finish the snapshot in flight (or remove it and say so), release the
        directory."""
        if self._ckpt is not None:
            self._ckpt.finish(report=self.report)
