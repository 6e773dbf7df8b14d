"""Orbax checkpoints of the whole training state.

A checkpoint (one folder per step under the checkpoint directory) holds three items:

* ``dense``: step, base RNG key, dense parameters, BatchNorm statistics, dense optimizer state;
* ``tables``: every embedding table by key (:mod:`jctr.checkpoint.tables`), with its optimizer
  rows, so that a different table capacity or device count can load it;
* ``meta``: JSON with the format version, the data reader's position, the config and the tables'
  shapes.

Orbax writes each step to a temporary folder and renames it when complete, so a process killed
in the middle of a save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jctr.checkpoint.tables import export_placed, import_placed
from jctr.embedding.collection import EmbeddingSpec
from jctr.sharding.mesh import to_host
from jctr.train.step import TrainState

FORMAT = "jctr-checkpoint"
VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable; the message names the path."""


def _dense_tree(state: TrainState) -> dict[str, Any]:
    return {"step": state.step, "rng": state.rng, "params": state.params,
            "batch_stats": state.batch_stats, "opt_state": state.opt_state}


class Checkpointer:
    """Saves and restores :class:`TrainState` under ``directory``, keeping the last ``keep``.

    Example::

        ckpt = Checkpointer("runs/dlrm/checkpoints", keep=3)
        ckpt.save(state, specs, meta={"reader": {...}})
        state, meta = ckpt.restore(fresh_state, specs)      # the latest step
    """

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._unsealed: list[int] = []

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, specs: tuple[EmbeddingSpec, ...],
             meta: dict[str, Any] | None = None, placements=None) -> int:
        """Start saving (asynchronously where Orbax allows); returns the step saved.
        ``placements`` (from the sharding plan) says how tables are laid out on devices."""
        step = int(to_host(state.step))
        placements = placements or (None,) * len(specs)
        tables = {s.name: export_placed(e, p)
                  for s, e, p in zip(specs, state.embeddings, placements)}
        info = {"format": FORMAT, "version": VERSION, "step": step,
                "tables": {s.name: {"rows": int(tables[s.name]["keys"].shape[0]), "dim": s.dim,
                                    "capacity": s.capacity} for s in specs},
                **(meta or {})}
        self.wait()  # one save in flight at a time; seals the previous one
        self.manager.save(step, args=ocp.args.Composite(
            dense=ocp.args.StandardSave(_dense_tree(state)),
            tables=ocp.args.StandardSave(tables),
            meta=ocp.args.JsonSave(info)))
        self._unsealed.append(step)
        return step

    def wait(self) -> None:
        """Wait for the save in flight, then record sizes and CRC32s of its files
        (``<step>.integrity.json``) so that later damage is found and named on restore."""
        self.manager.wait_until_finished()
        if jax.process_index() != 0:  # one process seals for all (the folder is shared)
            self._unsealed = []
            return
        done = set(self.manager.all_steps())
        for step in self._unsealed:
            if step in done:
                _atomic_json(self._integrity_path(step), _file_digests(self.step_dir(step)))
        self._unsealed = []
        for name in os.listdir(self.directory):
            if name.endswith(".integrity.json"):
                old = name.split(".", 1)[0]
                if old.isdigit() and int(old) not in done:
                    os.remove(os.path.join(self.directory, name))

    def _integrity_path(self, step: int) -> str:
        return os.path.join(self.directory, f"{step}.integrity.json")

    def verify(self, step: int) -> None:
        """Raise :class:`CheckpointError` naming the first missing or damaged file."""
        path = self._integrity_path(step)
        if not os.path.exists(path):
            return  # written by a process that died before sealing: Orbax's own checks only
        with open(path, encoding="utf-8") as f:
            expected = json.load(f)
        root = self.step_dir(step)
        for rel, (size, crc) in expected.items():
            full = os.path.join(root, rel)
            if not os.path.isfile(full):
                raise CheckpointError(f"{full}: missing from the checkpoint")
            if os.path.getsize(full) != size:
                raise CheckpointError(f"{full}: damaged checkpoint file (size "
                                      f"{os.path.getsize(full)}, expected {size})")
            if _crc32(full) != crc:
                raise CheckpointError(f"{full}: damaged checkpoint file (checksum mismatch)")

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self._pick(step)
        path = os.path.join(self.step_dir(step), "meta", "metadata")
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: checkpoint metadata unreadable: {e}") from e
        if meta.get("format") != FORMAT or meta.get("version", 0) > VERSION:
            raise CheckpointError(f"{path}: not a jctr checkpoint of version <= {VERSION}")
        return meta

    def _pick(self, step: int | None) -> int:
        self.wait()
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"{self.directory}: no complete checkpoint found")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"{self.directory}: no checkpoint for step {step}; "
                                  f"available: {steps}")
        return step

    def restore(self, fresh: TrainState, specs: tuple[EmbeddingSpec, ...],
                step: int | None = None, placements=None) -> tuple[TrainState, dict[str, Any]]:
        """Restore ``step`` (default: the latest complete one) onto a freshly built state.

        Table rows are re-inserted by key; rows never used keep ``fresh``'s initial values,
        which is what an uninterrupted run would have had.
        """
        step = self._pick(step)
        self.verify(step)
        meta = self.read_meta(step)
        where = self.step_dir(step)
        for item in ("dense", "tables"):
            if not os.path.isdir(os.path.join(where, item)):
                raise CheckpointError(f"{os.path.join(where, item)}: missing checkpoint item")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _dense_tree(fresh))
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                dense=ocp.args.StandardRestore(target),
                tables=ocp.args.StandardRestore()))
        except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise many kinds
            raise CheckpointError(f"{where}: checkpoint cannot be restored "
                                  f"({type(e).__name__}: {_first_line(e)})") from e
        dense = restored["dense"]
        tables = restored["tables"]
        embeddings = []
        placements = placements or (None,) * len(specs)
        for spec, es, placement in zip(specs, fresh.embeddings, placements):
            if spec.name not in tables:
                raise CheckpointError(f"{where}/tables: no table \"{spec.name}\"; stored: "
                                      f"{sorted(tables)}")
            stored = {k: np.asarray(v) for k, v in tables[spec.name].items()}
            try:
                embeddings.append(import_placed(spec, es, stored, placement,
                                                source=f"{where}/tables"))
            except ValueError as e:
                raise CheckpointError(str(e)) from e
        state = TrainState(step=dense["step"], rng=dense["rng"], params=dense["params"],
                           batch_stats=dense["batch_stats"], opt_state=dense["opt_state"],
                           embeddings=tuple(embeddings))
        return state, meta

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_digests(root: str) -> dict[str, list[int]]:
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            full = os.path.join(base, name)
            out[os.path.relpath(full, root)] = [os.path.getsize(full), _crc32(full)]
    return out


def _atomic_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:400] if text else ""
