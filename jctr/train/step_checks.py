"""What the loop checks after each step, one step behind so that the pipeline never stalls: a
table that filled up, and a non-finite loss (``solver.nan_policy``); and the tally of the
losses it checked (the epoch's mean, batches weighted by their share of real samples)."""

from __future__ import annotations

import numpy as np

from jctr.config import ConfigError, ModelConfig
from jctr.embedding.hash_table import TableFullError
from jctr.errors import UserError
from jctr.models.ctr import TrainState
from jctr.sharding.mesh import to_host


class NonFiniteLoss(UserError, FloatingPointError):
    """The training loss became NaN or infinite (solver.nan_policy "stop")."""


def check_iterations(cfg: ModelConfig, done: int, max_iter: int | None) -> None:
    """A :class:`ConfigError` unless the run has iterations to train: ``max_iter`` (or the
    solver's) above ``done`` (a resumed run counts those done before), or epochs."""
    s = cfg.solver
    if not (max_iter or s.max_iter or s.num_epochs):
        raise ConfigError("solver", "set max_iter or num_epochs (or --max-iter)", cfg.source)
    last = max_iter or s.max_iter
    if last and done >= last:
        raise ConfigError("solver.max_iter", f"{last}, but the state is at iteration {done} "
                          "already (resumed from a checkpoint): nothing to train; give a "
                          f"max_iter above {done} (--max-iter)", cfg.source)


def check_overflow(metrics, specs, state: TrainState) -> None:
    """A :class:`TableFullError` naming the tables that met more keys than they hold."""
    if int(to_host(metrics["overflow"])):
        full = [s for s, e in zip(specs, state.embeddings)
                if s.eviction is None and int(np.sum(to_host(e.table.overflow)))]
        names = ", ".join(f"\"{s.name}\" ({s.capacity} rows)" for s in full)
        raise TableFullError(
            f"embedding table full: more distinct keys than max_vocabulary_size_per_gpu "
            f"allows in {names}; raise sparse_embedding_hparam.max_vocabulary_size_per_gpu, or "
            "give the layer an eviction object to replace the lowest-ranked rows")


def nonfinite_error(loss: float, step: int, last_checkpoint: int | None) -> NonFiniteLoss:
    kept = (f"the last checkpoint (iter {last_checkpoint}) is kept"
            if last_checkpoint is not None else "no checkpoint was written")
    return NonFiniteLoss(
        f"training loss is {loss} at iter {step}: the run stopped and saved nothing of this "
        f"state ({kept}); lower the learning rate, check the data, or set solver.nan_policy "
        "to \"skip\" to skip such batches")


class RunTally:
    """Counts of a training run, its last checked loss and the running mean loss of the
    current epoch."""

    def __init__(self):
        self.skipped = self.fallback_steps = 0
        self.last_loss: float | None = None
        self._sum = self._weight = 0.0

    def add(self, loss: float | None, weight: float) -> None:
        if loss is None:
            self.skipped += 1
        else:
            self.last_loss = loss
            self._sum += loss * weight
            self._weight += weight

    def end_epoch(self) -> float | None:
        mean = self._sum / self._weight if self._weight else None
        self._sum = self._weight = 0.0
        return mean
