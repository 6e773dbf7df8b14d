"""Tables that grow (``sparse_embedding_hparam.growable``): when a growable table's rows in
use and the keys of two more batches would not fit, its capacity doubles (as often as needed)
between steps. The Trainer then builds its placement and steps for the grown config and moves
the rows over (:mod:`jctr.sharding.rows`); each growth is one compile of the steps, printed.

Two batches, because the loop checks a step's figures one step behind: the step in flight and
the next one must both fit the table as it is when the check runs.

Example::

    grown = capacities_to_grow(cfg, specs, metrics["rows_in_use"])   # {"emb": 4096}
    cfg = grown_config(cfg, grown)
"""

from __future__ import annotations

import copy

import numpy as np

from jctr.config.parser import parse_config
from jctr.config.schema import ModelConfig


def keys_per_step(cfg: ModelConfig, spec) -> int:
    """The most keys one training batch can bring a table (every device part alike: a
    sharded table's part may receive all of them)."""
    return cfg.solver.batchsize * spec.max_features


def capacity_for(capacity: int, in_use: int, per_step: int) -> int:
    """``capacity`` doubled until ``in_use`` and two steps' keys fit."""
    while in_use + 2 * per_step > capacity:
        capacity *= 2
    return capacity


def capacities_to_grow(cfg: ModelConfig, specs, rows_in_use, stuck: set[str] = frozenset()
                       ) -> dict[str, int]:
    """The growable tables (by name) that must grow now, with their new capacities;
    ``rows_in_use``: each table's fullest device part (the step's ``rows_in_use`` metric);
    ``stuck``: tables that reached the memory ceiling."""
    growable = {e.name for e in cfg.embeddings if e.growable} - set(stuck)
    out = {}
    for spec, used in zip(specs, np.asarray(rows_in_use).tolist()):
        if spec.name in growable:
            need = capacity_for(spec.capacity, int(used), keys_per_step(cfg, spec))
            if need > spec.capacity:
                out[spec.name] = need
    return out


def rows_in_use(state) -> np.ndarray:
    """Each table's rows in use in its fullest device part (what the step's
    ``rows_in_use`` metric holds), read from a state."""
    from jctr.sharding.mesh import to_host

    return np.array([int(np.max(to_host(es.table.size) - to_host(es.table.free_count)))
                     for es in state.embeddings], np.int64)


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


def capacities_for_rows(cfg: ModelConfig, specs, stored_rows: dict[str, int]
                        ) -> dict[str, int]:
    """The growable tables whose stored rows (a checkpoint's, by table name) need more
    capacity than the config gives, with the capacities that hold them."""
    growable = {e.name for e in cfg.embeddings if e.growable}
    out = {}
    for spec in specs:
        rows = stored_rows.get(spec.name)
        if spec.name in growable and rows is not None:
            need = capacity_for(spec.capacity, int(rows), keys_per_step(cfg, spec))
            if need > spec.capacity:
                out[spec.name] = need
    return out
