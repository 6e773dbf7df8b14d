"""A training run's log: every record (start, train, eval, epoch, snapshot, summary, ...) in
memory and, with ``solver.log_dir``, in ``metrics.jsonl`` and a TensorBoard event file, and the
HTML report written at the end. Process 0 writes; the others only remember.

Example::

    log = RunLog(cfg.solver.log_dir, source=cfg.source, report=print)
    log.open(continues=False, force=False)      # refuses another run's log
    log.record("train", iter=100, loss=0.45)
    log.write_report()
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax

from jctr.config import ConfigError
from jctr.errors import UserError
from jctr.train.report import write_report
from jctr.train.tensorboard import TensorBoardLog

_RUN_LOG_FILES = ("metrics.jsonl", "report.html", "report_files", "tensorboard")


class RunLog:
    """The records of one run (see the module docstring). ``log_dir`` None: in memory only."""

    def __init__(self, log_dir: str | None, *, source: str | None,
                 report: Callable[[str], None]):
        self.log_dir = log_dir
        self.source = source
        self.report = report
        # every record, but display records past the last KEPT_DISPLAYS (metrics.jsonl keeps
        # them) and those before a forget() (a streaming run's earlier passes)
        self.history: list[dict[str, Any]] = []
        self._displays = 0  # train records in history
        self._file = None
        self._board: TensorBoardLog | None = None
        self._writes = bool(log_dir) and jax.process_index() == 0
        # None: a report at the end of every fit. A number of seconds: at most that often
        # (a streaming run, one fit a pass for months: each report reads the whole log), the
        # TensorBoard event file kept open across fits; write_report(force=True) at once
        self.report_every_s: float | None = None
        self._reported_at: float | None = None
        self._unreported = 0  # records since the last report

    def open(self, *, continues: bool, force: bool) -> None:
        """Open ``<log_dir>/metrics.jsonl`` for appending. A log of another run is refused
        unless this run ``continues`` it (resumed) or may move it aside (``force``); a
        log_dir that cannot be written is a config error, found before training."""
        if not self._writes or self._file is not None:
            return
        path = os.path.join(self.log_dir, "metrics.jsonl")
        if os.path.exists(self.log_dir) and not os.path.isdir(self.log_dir):
            raise ConfigError("solver.log_dir", f"{self.log_dir} exists and is not a folder",
                              self.source)
        if os.path.isfile(path) and os.path.getsize(path) and not continues:
            # another run's log: appending would draw two runs as one line
            if not force:
                raise ConfigError("solver.log_dir", f"{path} holds another run's log; "
                                  "continue that run with --resume, give another --log-dir, "
                                  "or pass --force to start a new log there (the old run's "
                                  "files are moved into previous-<n>/)", self.source)
            moved = _move_previous_run(self.log_dir)
            self.report(f"[jctr] --force: the previous run's log files are in {moved}")
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        except OSError as e:
            raise ConfigError("solver.log_dir", f"cannot write {path}: {e.strerror}",
                              self.source) from e

    def record(self, kind: str, **fields) -> dict[str, Any]:
        """Append one record (``kind``, the time, ``fields``); returns it."""
        entry = {"kind": kind, "time": round(time.time(), 3), **fields}
        self.history.append(entry)
        self._unreported += 1
        if kind == "train":
            self._displays += 1
            if self._displays > 2 * self.KEPT_DISPLAYS:
                self._drop_old_displays()
        if self._writes:
            if self._file is None:
                self.open(continues=True, force=False)
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()
            if self._board is None:
                self._board = TensorBoardLog(self.log_dir)
            self._board.write(entry)
        return entry

    # display records kept in memory at most (a record every display of a run of days: a
    # dict each, ~1 KB); the older ones are in metrics.jsonl only
    KEPT_DISPLAYS = 100_000

    def _drop_old_displays(self) -> None:
        """The oldest ``train`` records past the last :attr:`KEPT_DISPLAYS` leave memory (in
        one pass once the history doubles: amortized O(1) a record); every other kind stays."""
        drop = self._displays - self.KEPT_DISPLAYS
        self._displays = self.KEPT_DISPLAYS
        kept = []
        for h in self.history:
            if drop and h["kind"] == "train":
                drop -= 1
                continue
            kept.append(h)
        self.history[:] = kept

    def forget(self) -> None:
        """Drop the records kept in memory (``metrics.jsonl`` keeps them): a streaming run,
        one fit a pass for months, calls it before each pass (a record a display: millions)."""
        self.history.clear()
        self._displays = 0

    def validation(self, at: int | None = None) -> tuple[int | None, dict[str, float]]:
        """(iteration, metrics) of the validation at iteration ``at`` if logged, else of the
        last ((None, {}) without one)."""
        evals = [h for h in self.history if h["kind"] == "eval"]
        best = [h for h in evals if h.get("iter") == at]
        shown = best[-1] if best else (evals[-1] if evals else {})
        return shown.get("iter"), {k: v for k, v in shown.items()
                                   if isinstance(v, float) and k not in ("time", "lr")}

    def write_report(self, *, force: bool = False) -> None:
        """report.html of the log folder; a failure is reported, never fatal: the model is
        trained and saved by now. With :attr:`report_every_s`, only if that long has passed
        since the last one (or ``force``, where records came since)."""
        if not self._writes:
            return
        now = time.monotonic()
        if self.report_every_s is not None:
            if not self._unreported or (not force and self._reported_at is not None
                                        and now - self._reported_at < self.report_every_s):
                return
        elif self._board is not None:  # the event file is complete; a later fit opens another
            self._board.close()
            self._board = None
        self._reported_at, self._unreported = now, 0
        try:
            self.report(f"[jctr] report: {write_report(self.log_dir)}")
        except (UserError, OSError) as e:
            self.report(f"[jctr] report not written: {e}")


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
