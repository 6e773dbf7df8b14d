"""How a feature attaches to the training loop without the loop knowing it: a :class:`Hook`
sees each host batch as it is read (``on_batch``, in the reader's thread), each step after it
is dispatched (``on_step``) and the end of each ``fit`` (``on_fit_end``). ``fit`` returns a
:class:`FitSummary`. Streaming training's show/click statistics and pass AUC and the Kafka
publisher are hooks.

Example::

    class CountKeys(Hook):
        def __init__(self):
            self.keys = 0
        def on_batch(self, batch):
            self.keys += sum(k.size for k in batch.keys)

    trainer = Trainer.from_config("configs/dlrm_synthetic.json", max_iter=20,
                                  hooks=[CountKeys()])
    summary = trainer.fit()          # FitSummary(iterations=20, ...)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jctr.data.batch import Batch
from jctr.models.ctr import TrainState
from jctr.sharding.mesh import to_host


class Hook:
    """The loop's calls; override those you need. ``auc_buckets`` > 0 asks the train
    step to count its predictions in that many buckets per label (``metrics["auc_counts"]``,
    ``[2, buckets]``, summed over every process; fixed when the Trainer is built)."""

    auc_buckets: int = 0

    def on_fit_start(self) -> None:
        """A ``fit`` is about to take its first step."""

    def on_batch(self, batch: Batch) -> Any:
        """A host batch as read, before it goes to the devices (the reader's thread: keep it
        host-side numpy). What it returns comes back with the batch's step, as ``note``."""
        return None

    def on_step(self, step: int, state: TrainState, metrics: dict[str, jax.Array],
                note: Any) -> None:
        """After iteration ``step`` was dispatched: ``state`` and ``metrics`` may still be
        computing (reading them waits for the step)."""

    def on_fit_end(self, state: TrainState, summary: FitSummary) -> None:
        """After ``fit`` trained and evaluated (before the test sets are scored)."""

    def before_restore(self, step: int | None, directory: str | None) -> None:
        """A checkpoint (``Trainer.restore_checkpoint``'s arguments) is about to be
        restored into the state."""

    def on_model_rebuilt(self, step_config, placements) -> None:
        """The model's steps and placement were built again (a table grew: other
        capacities, the same keys): a hook that keeps them takes the new ones."""

    def on_keys_erased(self, table: int, keys: np.ndarray, state: TrainState) -> None:
        """The run deleted ``keys`` from table ``table`` between fits (the streaming shrink):
        a hook that mirrors the tables forgets them."""

    def on_run_end(self) -> None:
        """The run's last ``fit`` is over (a command's end, :func:`end_run`): work still in
        flight is finished, or what is lost is raised as an error."""


def config_hooks(trainer, report) -> list[Hook]:
    """The hooks a trainer's config asks for: growable tables grow
    (:class:`jctr.train.table_growth.TableGrowth`), a Kafka sink publishes
    (:class:`jctr.train.publisher.KafkaPublisher`). Spilling tables start with no spilled
    rows (:func:`jctr.embedding.spill.forget`)."""
    cfg, out = trainer.cfg, []
    spilling = [s for s in trainer.specs if s.eviction is not None and s.eviction.spill]
    if spilling:  # a new run reads back only rows it spilled (or a checkpoint restores)
        from jctr.embedding.spill import forget

        forget(spilling)
    if any(e.growable for e in cfg.embeddings):
        from jctr.train.table_growth import TableGrowth

        out.append(TableGrowth(trainer))
    if cfg.solver.kafka_sink is not None:
        from jctr.train.publisher import KafkaPublisher

        out.append(KafkaPublisher(cfg, trainer.step_config, trainer.placed.placements,
                                  report=report))
    return out


def end_run(hooks) -> None:
    """Every hook's :meth:`Hook.on_run_end`, all of them even when one raises (the first
    error is raised after)."""
    first = None
    for hook in hooks:
        try:
            hook.on_run_end()
        except Exception as e:  # noqa: BLE001 - the others still finish
            first = first or e
    if first is not None:
        raise first


@dataclasses.dataclass(frozen=True)
class FitSummary:
    """What one ``fit`` did: iterations trained, the state's iteration at the end, the last
    checked training loss, throughput (``steady_samples_per_s`` leaves the first step out),
    the last validation metrics (or those of ``restored_best``, the iteration early stopping
    went back to) and whether it stopped early (early stopping, AUC threshold)."""

    iterations: int
    step: int
    loss: float | None
    samples_per_s: float
    steady_samples_per_s: float
    compile_s: float | None
    elapsed_s: float
    validation: dict[str, float]
    stopped_early: bool
    restored_best: int | None = None
    routing_fallback_steps: int = 0
    skipped_nonfinite: int = 0


class PredictionCounts(Hook):
    """The training predictions' counts per bucket since the last :meth:`take` (negatives and
    positives; summed on the devices, no wait for a step): the AUC of everything trained
    since, as streaming training's pass AUC
    (:func:`jctr.train.metrics.bucket_auc` of :meth:`take`)."""

    def __init__(self, buckets: int = 4096):
        self.auc_buckets = buckets
        self._counts = None

    def on_step(self, step, state, metrics, note) -> None:
        if "auc_counts" not in metrics:
            raise ValueError("PredictionCounts: the train step counts no predictions; give "
                             "the hook to the Trainer when building it (hooks=[...])")
        counts = metrics["auc_counts"]
        self._counts = counts if self._counts is None else self._counts + counts

    def take(self) -> np.ndarray:
        """``[2, buckets]`` counts since the last call, which start again from zero."""
        counts, self._counts = self._counts, None
        if counts is None:
            return np.zeros((2, self.auc_buckets), np.int64)
        return np.asarray(to_host(counts), np.int64)
