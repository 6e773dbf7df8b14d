"""Tables that grow (``sparse_embedding_hparam.growable``), attached to the loop as a hook:
when a growable table's rows in use and the keys of two more batches would not fit, its
capacity doubles (as often as needed) between steps. The Trainer's placement, steps and
memory plan are then built for the grown config and the rows move over
(:mod:`jctr.sharding.rows`); each growth is one compile of the steps, printed and logged.

Two batches, because the hook reads a step's ``rows_in_use`` one step behind (no stall of the
pipeline): the step in flight and the next one must both fit the table as it is then.

Example::

    trainer.hooks.append(TableGrowth(trainer))   # the Trainer does this for growable tables
"""

from __future__ import annotations

import copy
import time

import numpy as np

from jctr.config.parser import parse_config
from jctr.config.schema import ModelConfig
from jctr.sharding.mesh import to_host
from jctr.sharding.plan import PlanError
from jctr.train.hooks import Hook


def keys_per_step(cfg: ModelConfig, spec) -> int:
    """The most keys one training batch can bring a table (every device part alike: a
    sharded table's part may receive all of them)."""
    return cfg.solver.batchsize * spec.max_features


def capacity_for(capacity: int, in_use: int, per_step: int) -> int:
    """``capacity`` doubled until ``in_use`` and two steps' keys fit."""
    while in_use + 2 * per_step > capacity:
        capacity *= 2
    return capacity


def capacities_to_grow(cfg: ModelConfig, specs, rows: dict[str, int],
                       stuck: set[str] = frozenset()) -> dict[str, int]:
    """The growable tables (by name) that must grow to hold ``rows`` (rows in use of each
    table's fullest device part, or a checkpoint's stored rows) and two more steps, with
    their new capacities; ``stuck``: tables that reached the memory ceiling."""
    growable = {e.name for e in cfg.embeddings if e.growable} - set(stuck)
    out = {}
    for spec in specs:
        if spec.name in growable and spec.name in rows:
            need = capacity_for(spec.capacity, int(rows[spec.name]), keys_per_step(cfg, spec))
            if need > spec.capacity:
                out[spec.name] = need
    return out


def grown_config(cfg: ModelConfig, capacities: dict[str, int]) -> ModelConfig:
    """``cfg`` with the named tables' ``max_vocabulary_size_per_gpu`` set (parsed and
    validated again from its raw form, so that everything derived from it follows)."""
    raw = copy.deepcopy(cfg.raw)
    for layer in raw["layers"]:
        if isinstance(layer, dict) and layer.get("name") in capacities:
            hp = layer.setdefault("sparse_embedding_hparam", {})
            hp.pop("workspace_size_per_gpu_in_mb", None)
            hp["max_vocabulary_size_per_gpu"] = int(capacities[layer["name"]])
    return parse_config(raw, source=cfg.source, require_solver=False)


class TableGrowth(Hook):
    """Grows the trainer's growable tables: before the first step, one step behind every
    step, and before a checkpoint of tables that grew in the saved run is restored."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.stuck: set[str] = set()  # tables at the memory ceiling
        self._last = None  # the previous step's metrics

    def on_fit_start(self) -> None:
        t = self.trainer
        self._last = None
        self.grow({s.name: int(np.max(to_host(es.table.size) - to_host(es.table.free_count)))
                   for s, es in zip(t.specs, t.state.embeddings)})

    def on_step(self, step, state, metrics, note) -> None:
        last, self._last = self._last, metrics
        if last is not None:
            used = to_host(last["rows_in_use"]).tolist()
            self.grow({s.name: n for s, n in zip(self.trainer.specs, used)})

    def before_restore(self, step: int | None, directory: str | None) -> None:
        self.grow(self.trainer.checkpoints.stored_rows(step, directory), required=True)

    def grow(self, rows: dict[str, int], *, required: bool = False) -> None:
        """Grow the tables that need it for ``rows``. A growth whose memory plan does not fit
        leaves them as they are (they stop growing; ``required``: raise)."""

        t = self.trainer
        capacities = capacities_to_grow(t.cfg, t.specs, rows, self.stuck)
        if not capacities:
            return
        t0 = time.perf_counter()
        before = {s.name: s.capacity for s in t.specs}
        try:
            rebuild(t, grown_config(t.cfg, capacities))
        except PlanError as e:
            if required:
                raise
            self.stuck.update(capacities)
            t._print(f"[jctr] {', '.join(capacities)} cannot grow to "
                     f"{', '.join(f'{n:,}' for n in capacities.values())} rows: {e}; they "
                     "keep their rows (a full table stops, or evicts with eviction)")
            return
        for name, n in capacities.items():
            t._print(f"[jctr] table {name} grew from {before[name]:,} to {n:,} rows per "
                     f"device part (steps compiled again; {time.perf_counter() - t0:.1f} s)")
            t.run_log.record("table_growth", iter=int(to_host(t.state.step)), table=name,
                             rows=n, previous=before[name])


def rebuild(trainer, cfg: ModelConfig) -> None:
    """The trainer's placement, steps and memory plan for ``cfg`` (its model with other table
    capacities), its state (and early stopping's kept best) moved into them; on a
    :class:`jctr.sharding.plan.PlanError` nothing changes."""
    from jctr.models.ctr import build_model
    from jctr.sharding.placed_model import PlacedModel, dense_bytes
    from jctr.sharding.rows import export_placed, put_rows
    from jctr.train.step_memory import plan_step_memory

    t = trainer
    step_config, init_model = build_model(cfg)
    init_state = lambda: init_model(t._dense_tx)  # noqa: E731
    placed = PlacedModel(cfg, step_config.specs, dense_bytes=dense_bytes(init_state))
    kept = (t.cfg, t.step_config, t.specs, t.placed, t.train_step, t.train_step_full,
            t.eval_step)
    t.cfg, t.step_config, t.specs, t.placed = cfg, step_config, step_config.specs, placed
    try:
        t._jit_steps()
        t.memory_plan = plan_step_memory(placed, cfg, t.train_step, t.eval_step, init_state,
                                         t._print)
    except BaseException:
        (t.cfg, t.step_config, t.specs, t.placed, t.train_step, t.train_step_full,
         t.eval_step) = kept
        raise
    old_placements = kept[3].placements

    def moved(state):  # the same rows in the grown tables
        fresh = placed.create(init_state).embeddings
        return state._replace(embeddings=tuple(
            put_rows(spec, es, pl, export_placed(old_es, old_pl), replace=True)
            for spec, es, pl, old_es, old_pl in zip(step_config.specs, fresh,
                                                    placed.placements, state.embeddings,
                                                    old_placements)))

    t.state = moved(t.state)
    if t._best_copy is not None:  # early stopping's best, kept for the run's end
        best_step, host = t._best_copy
        t._best_copy = (best_step, placed.copy_to_host(moved(placed.copy_to_devices(host))))
    t.evaluator.eval_step, t.evaluator.placed = t.eval_step, placed
    t.checkpoints.cfg, t.checkpoints.step_config = cfg, step_config
    t.checkpoints.placed = placed
    for hook in t.hooks:
        hook.on_model_rebuilt(step_config, placed.placements)
