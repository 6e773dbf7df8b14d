"""Snapshots of a training run: the :class:`Checkpointer` plus what a run stores with its state
(the config it was trained with, every data reader's position, the BatchNorm JSON beside it),
and the checks on restore (the same model structure; settings that changed are listed).

Example::

    ckpt = Checkpointer(cfg.solver.checkpoint_dir)
    save_snapshot(ckpt, cfg, step_config, state, placements, readers=[{"epoch": 0, ...}])
    state, readers = restore_snapshot(ckpt, cfg, step_config, fresh_state, placements)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax

from jctr.checkpoint.manager import Checkpointer, CheckpointError
from jctr.checkpoint.model_files import host_network, non_trainable
from jctr.config import ConfigError, ModelConfig, load_config
from jctr.config.compare import config_differences
from jctr.models.ctr import StepConfig, TrainState, with_lr_scale
from jctr.sharding.mesh import to_host


def save_snapshot(ckpt: Checkpointer, cfg: ModelConfig, step_config: StepConfig,
                  state: TrainState, placements=None, *, readers: list[dict[str, int]],
                  devices: int = 1, monitors: dict[str, Any] | None = None,
                  tables: dict | None = None) -> int:
    """Start saving ``state`` with the config and the reader positions (one per process, in
    process order); ``non_trainable_<step>.json`` goes beside it. ``monitors`` is the host-side
    state of early stopping and the plateau schedule (JSON); ``tables`` the state's tables
    exported already (:func:`jctr.checkpoint.manager.export_tables`). Every process calls this.
    Returns the step."""
    from jctr.version import __version__

    beside = {}
    step = int(to_host(state.step))
    if jax.process_index() == 0:
        beside[f"non_trainable_{step}.json"] = json.dumps(
            non_trainable(host_network(step_config, state)), indent=1).encode()
    meta = {"reader": readers[0], "readers": readers, "config": cfg.raw,
            "jctr_version": __version__, "devices": devices, "processes": len(readers),
            "lr_scale": float(to_host(state.lr_scale)), "monitors": monitors or {}}
    return ckpt.save(state, step_config.specs, meta=meta, placements=placements, beside=beside,
                     tables=tables)


def check_same_model(where: str, meta: dict[str, Any], cfg: ModelConfig) -> list[str]:
    """Raise unless the checkpoint's stored config builds the same model as ``cfg``; returns
    the other settings that differ (learning rate, batch size, ...), as "field: old -> new"."""
    if not meta.get("config"):
        return []
    try:
        stored = load_config(meta["config"], require_solver=False)
    except ConfigError as e:
        raise CheckpointError(f"{where}: the config stored in the checkpoint does not parse "
                              f"({e})") from None
    structural, other = config_differences(stored, cfg)
    if structural:
        shown = "; ".join(structural[:8]) + ("; ..." if len(structural) > 8 else "")
        raise CheckpointError(f"{where}: the checkpoint was written with another model "
                              f"({len(structural)} field(s) differ, checkpoint -> config): "
                              f"{shown}")
    return other


def restore_snapshot(ckpt: Checkpointer, cfg: ModelConfig, step_config: StepConfig,
                     fresh: TrainState, placements=None, step: int | None = None, *,
                     report: Callable[[str], None] = print,
                     keep_positions: bool = True) -> tuple[TrainState, dict[str, int], dict]:
    """Restore ``step`` (default: the latest) of a run of the same model onto ``fresh``.

    Returns the state, this process's reader position and the checkpoint's metadata. With
    ``keep_positions`` the process count must match the writer's (each process continues its
    own files); without, positions are dropped (a model to export or evaluate)."""
    ckpt.check_not_in_use()
    meta = ckpt.read_meta(step)
    readers = meta.get("readers") or [meta.get("reader", {})]
    if not keep_positions and len(readers) != jax.process_count():
        readers = [{}] * jax.process_count()
    if len(readers) != jax.process_count():
        raise CheckpointError(
            f"{ckpt.directory}: written by {len(readers)} process(es), restored by "
            f"{jax.process_count()}: each process's data position cannot be carried over; "
            "restore with the same process count")
    changed = check_same_model(ckpt.directory, meta, cfg)
    if changed:
        report("[jctr] resuming with changed settings (checkpoint -> config): "
               + "; ".join(changed))
    state, meta = ckpt.restore(fresh, step_config.specs, step, placements)
    state = with_lr_scale(state, meta.get("lr_scale", 1.0))  # older checkpoints: 1
    return state, readers[jax.process_index()], meta
