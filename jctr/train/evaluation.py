"""Scoring a model on a data set, and what each validation result decides: the solver's AUC
threshold, the learning rate on plateau and early stopping (:mod:`jctr.train.monitors`). The
loop applies the decisions to the state; nothing here holds it.

Example::

    judge = ValidationJudge(cfg, report=print, record=log.record)
    result = evaluate(eval_step, placed, state, data.eval, cfg.solver)
    verdict = judge.judge(result, step=100, lr=0.001)    # Verdict(stop=False, ...)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jctr.config import ModelConfig
from jctr.config.schema import SolverConfig
from jctr.data.batch import Batch
from jctr.data.dataset import Dataset
from jctr.data.records import DataError
from jctr.models.ctr import TrainState
from jctr.sharding.mesh import to_host
from jctr.sharding.placed_model import PlacedModel
from jctr.train.datasets import RunData, open_eval_set
from jctr.train.metrics import EvalTally
from jctr.train.monitors import EarlyStopping, PlateauSchedule


def predict_all(eval_step, placed: PlacedModel, state: TrainState, batch: Batch) -> np.ndarray:
    """Predictions for every sample of a host batch (every process passes the same one)."""
    _, pred = eval_step(state, placed.to_devices(placed.process_share(batch), False))
    return to_host(pred)


def evaluate(eval_step, placed: PlacedModel, state: TrainState, data: Dataset,
             solver: SolverConfig, *, num_batches: int | None = None,
             where: str = "the dataset") -> dict[str, float]:
    """The solver's ``eval_metrics`` over ``data`` (its first ``num_batches`` batches, if
    given); padding samples never count. ``where`` names ``data`` in errors."""
    tally = EvalTally()  # 8 bytes a sample (a set of 100M samples: 0.8 GB, not 6.6)
    for i, batch in enumerate(data.batches(solver.batchsize_eval, epochs=1)):
        if num_batches is not None and i >= num_batches:
            break
        pred = predict_all(eval_step, placed, state, batch)
        m = batch.mask
        tally.add(batch.label[m, 0], pred[m] if pred.ndim == 1 else pred[m, 0])
    if not tally.count:
        raise DataError(f"{where}: no samples to evaluate")
    return {metric.name: tally.auc() if metric.name == "AUC" else tally.log_loss()
            for metric in solver.eval_metrics}


class Evaluator:
    """Scores the state on the run's data sets: the validation set, a given one, the named
    test sets (logged with ``record``)."""

    def __init__(self, cfg: ModelConfig, eval_step, placed: PlacedModel, data: RunData, *,
                 report: Callable[[str], None], record: Callable[..., Any]):
        self.cfg, self.eval_step, self.placed, self.data = cfg, eval_step, placed, data
        self.report, self.record = report, record

    def evaluate(self, state: TrainState, num_batches: int | None = None,
                 data: Dataset | str | None = None, where: str | None = None
                 ) -> dict[str, float]:
        """See :meth:`jctr.train.trainer.Trainer.evaluate`."""
        where = where or "the dataset"
        if data is None:
            data, where = self.data.eval, self.cfg.data.eval_source
        elif not isinstance(data, Dataset):
            where = os.fspath(data)
            data = open_eval_set(self.cfg, where)
        return evaluate(self.eval_step, self.placed, state, data, self.cfg.solver,
                        num_batches=num_batches or self.cfg.solver.eval_batches, where=where)

    def predict(self, state: TrainState, batch: Batch) -> np.ndarray:
        """Predictions for every sample of a checked host batch."""
        return predict_all(self.eval_step, self.placed, state, batch)

    def score_test_sets(self, state: TrainState) -> None:
        """Every ``test_source`` of the Data layer, reported and logged apart."""
        step = int(to_host(state.step))
        for name, source in self.cfg.data.test_sources:
            result = self.evaluate(state, data=self.data.test(name), where=source)
            self.report(f"[jctr] test \"{name}\" at iter {step}: "
                        + "  ".join(f"{k} {v:.5f}" for k, v in result.items()))
            self.record("test", iter=step, set=name, **result)


def _norms(embeddings) -> list[tuple[jax.Array, jax.Array]]:
    """Per table: rows in use and the sum of their L2 norms (a table split over devices
    reduces across them)."""
    out = []
    for es in embeddings:
        used = es.row_slot >= 0
        norms = jnp.sqrt(jnp.sum(jnp.square(es.values), axis=-1))  # [..., rows]
        out.append((jnp.sum(used), jnp.sum(jnp.where(used, norms, 0.0))))
    return out


_norms_jit = jax.jit(_norms)


def embedding_norms(specs, state: TrainState) -> dict[str, dict[str, float]]:
    """Per table: rows in use, their share of the table's capacity (``fill``) and their mean
    L2 norm (logged with every evaluation); for a table that evicts, the keys it evicted and
    refused so far."""
    out = {}
    for spec, es, (rows, total) in zip(specs, state.embeddings, _norms_jit(state.embeddings)):
        rows = int(to_host(rows))
        capacity = int(np.prod(es.row_slot.shape))  # every shard's rows
        out[spec.name] = {"rows": rows, "fill": rows / max(capacity, 1),
                          "mean_norm": float(to_host(total)) / max(rows, 1)}
        if spec.eviction is not None:  # keys evicted, and refused (no row found), so far
            out[spec.name]["evicted"] = int(np.sum(to_host(es.table.evicted)))
            out[spec.name]["refused"] = int(np.sum(to_host(es.table.overflow)))
    return out


def describe_norms(norms: dict[str, dict]) -> str:
    """:func:`embedding_norms` as the evaluation line shows them."""
    return "  ".join(f"{name}: {n['rows']:,} rows, mean |row| {n['mean_norm']:.4f}"
                     + (f", {n['evicted']:,} evicted" if "evicted" in n else "")
                     + (f", {n['refused']:,} refused" if n.get("refused") else "")
                     for name, n in norms.items())


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a validation result decides: stop training; a new learning-rate factor (None:
    unchanged); this state is early stopping's new best (keep a copy of it)."""

    stop: bool = False
    lr_scale: float | None = None
    best: bool = False


class ValidationJudge:
    """The solver's AUC threshold, plateau schedule and early stopping over the validation
    results, with their host state (saved in snapshots: :meth:`state_dict`)."""

    def __init__(self, cfg: ModelConfig, *, report: Callable[[str], None],
                 record: Callable[..., Any]):
        s = cfg.solver
        self.threshold = s.auc_threshold
        self.base_lr = cfg.optimizer.learning_rate
        self.early_stopping = EarlyStopping(s.early_stopping) if s.early_stopping else None
        self.plateau = PlateauSchedule(s.lr_plateau, self.base_lr) if s.lr_plateau else None
        self.report = report
        self.record = record

    def judge(self, result: dict[str, float], step: int, lr: float,
              epoch: int | None = None) -> Verdict:
        """What the validation ``result`` at iteration ``step`` (in 0-based ``epoch``)
        decides."""
        if self.threshold is not None and result.get("AUC", 0.0) >= self.threshold:
            self.report(f"[jctr] AUC {result['AUC']:.5f} reached the threshold "
                        f"{self.threshold}; stopping")
            return Verdict(stop=True)
        scale = None
        if self.plateau is not None and self.plateau.update(result[self.plateau.metric], step):
            scale = self.plateau.scale
            new_lr = self.base_lr * scale
            self.report(f"[jctr] validation {self.plateau.metric} has not improved for "
                        f"{self.plateau.cfg.patience} evaluation(s): learning rate "
                        f"{lr:.3g} -> {new_lr:.3g}")
            self.record("lr", iter=step, lr=new_lr, scale=scale)
        es = self.early_stopping
        if es is None:
            return Verdict(lr_scale=scale)
        if es.update(result[es.metric], step, epoch):
            return Verdict(lr_scale=scale, best=es.cfg.restore_best_weights)
        if scale is not None and es.cfg.restart_after_lr_drop and es.wait:
            es.wait = 0  # the lowered rate gets a patience of its own
            self.report("[jctr] early stopping: patience starts again at the lower rate")
        if es.should_stop:
            self.report(f"[jctr] early stopping at iter {step}: validation {es.metric} has not "
                        f"improved on {es.best:.5f} (iter {es.best_iter}) for {es.wait} "
                        "evaluation(s)")
            self.record("early_stop", iter=step, best_iter=es.best_iter,
                        **{es.metric: es.best})
            return Verdict(stop=True, lr_scale=scale)
        return Verdict(lr_scale=scale)

    def best_to_restore(self, current: int) -> int | None:
        """The iteration whose weights the run should end with (restore_best_weights), if
        it is not ``current``."""
        es = self.early_stopping
        if es is None or not es.cfg.restore_best_weights or es.best_iter in (None, current):
            return None
        return es.best_iter

    def state_dict(self) -> dict[str, Any]:
        return {name: m.state_dict() for name, m in (("early_stopping", self.early_stopping),
                                                     ("plateau", self.plateau)) if m}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for name, monitor in (("early_stopping", self.early_stopping),
                              ("plateau", self.plateau)):
            if monitor is not None:
                monitor.load_state_dict(saved.get(name, {}))
