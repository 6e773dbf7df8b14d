"""Watching the validation metric between evaluations: early stopping and the learning rate on
plateau (``solver.early_stopping``, ``lr_policy: "plateau"``). Host-side bookkeeping only; the
trainer acts on what these say (keeps or restores weights, sets the state's ``lr_scale``).
"""

from __future__ import annotations

import math
from typing import Any

from jctr.config.schema import EarlyStoppingConfig, PlateauConfig


class MetricWatch:
    """The best value of one metric so far and how many evaluations in a row missed it.

    A value improves on the best when it is better by more than ``min_delta`` (larger in mode
    ``max``, smaller in mode ``min``; with ``relative``, by more than ``min_delta`` times the
    best's magnitude); NaN never improves.

    Example::

        w = MetricWatch("AUC", "max", 0.0)
        w.update(0.70, 100), w.update(0.69, 200)   # (True, False); w.wait == 1
    """

    def __init__(self, metric: str, mode: str, min_delta: float, relative: bool = False):
        self.metric, self.mode, self.min_delta = metric, mode, min_delta
        self.relative = relative  # min_delta is a share of the best's magnitude
        self.best: float | None = None
        self.best_iter: int | None = None
        self.wait = 0

    def improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        delta = self.min_delta * abs(self.best) if self.relative else self.min_delta
        if self.mode == "max":
            return value > self.best + delta
        return value < self.best - delta

    def update(self, value: float, iteration: int) -> bool:
        """Record an evaluation; True if it is the new best."""
        if self.improves(value):
            self.best, self.best_iter, self.wait = float(value), int(iteration), 0
            return True
        self.wait += 1
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_iter": self.best_iter, "wait": self.wait}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.best, self.best_iter, self.wait = d.get("best"), d.get("best_iter"), d.get("wait", 0)


class EarlyStopping(MetricWatch):
    """Stop after ``patience`` evaluations in a row without an improvement.

    Example::

        es = EarlyStopping(EarlyStoppingConfig(patience=2))
        for it, auc in [(1, .70), (2, .72), (3, .71), (4, .715)]:
            es.update(auc, it)
        es.should_stop, es.best_iter   # (True, 2)
    """

    def __init__(self, cfg: EarlyStoppingConfig):
        super().__init__(cfg.metric, cfg.mode, cfg.min_delta, cfg.min_delta_mode == "relative")
        self.cfg = cfg

    def update(self, value: float, iteration: int, epoch: int | None = None
               ) -> bool:  # type: ignore[override]
        """Record an evaluation in 0-based ``epoch`` (at its end, or within it); one in the
        warm-up (``epoch < start_from_epoch``) is not watched at all. True if it is the new
        best."""
        if epoch is not None and epoch < self.cfg.start_from_epoch:
            return False
        return super().update(value, iteration)

    @property
    def should_stop(self) -> bool:
        return self.wait >= self.cfg.patience


class PlateauSchedule(MetricWatch):
    """The factor on every learning rate: times ``factor`` after ``patience`` evaluations in a
    row without an improvement (then the count starts again), never taking ``base_lr`` (the
    solver optimizer's rate) below ``min_lr``.

    Example::

        p = PlateauSchedule(PlateauConfig(factor=0.1, patience=1), base_lr=1e-3)
        p.update(0.70, 1); p.update(0.69, 2)   # the second returns True: p.scale == 0.1
    """

    def __init__(self, cfg: PlateauConfig, base_lr: float):
        super().__init__(cfg.metric, cfg.mode, cfg.min_delta, cfg.min_delta_mode == "relative")
        self.cfg = cfg
        self.base_lr = float(base_lr)
        self.scale = 1.0

    def update(self, value: float, iteration: int) -> bool:  # type: ignore[override]
        """Record an evaluation; True if the learning rate was lowered."""
        if super().update(value, iteration) or self.wait < self.cfg.patience:
            return False
        self.wait = 0
        if self.base_lr <= 0.0:
            return False
        lr = max(self.base_lr * self.scale * self.cfg.factor, self.cfg.min_lr)
        if lr >= self.base_lr * self.scale:
            return False  # already at min_lr
        self.scale = lr / self.base_lr
        return True

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "scale": self.scale}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.scale = float(d.get("scale", 1.0))
