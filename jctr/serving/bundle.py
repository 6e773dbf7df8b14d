"""Inference bundles: everything needed to predict, without the trainer.

Layout of a bundle folder:

* ``manifest.json``: format and jctr versions, the checkpoint step, every embedding's key count
  and vector size, the dense weight count, and the input shapes;
* ``config.json``: the config the model was trained with (parsed again on load into the same
  typed :class:`jctr.config.ModelConfig`; its data sources are not read);
* ``dense.model``, ``non_trainable.json`` and ``sparse/<embedding>.model/{key,emb_vector}``: the
  files of :mod:`jctr.checkpoint.model_files`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.checkpoint.integrity import check_files, file_digests
from jctr.checkpoint.model_files import ModelFileError, load_model_files, write_model_files
from jctr.config import ConfigError, ModelConfig, parse_config
from jctr.data.batch import Batch, BatchError, check_batch, nonfinite_dense
from jctr.data.outputs import describe_contents
from jctr.runtime.xla_options import step_compiler_options
from jctr.sharding.mesh import to_host

BUNDLE_FORMAT = "jctr-inference-bundle"
BUNDLE_VERSION = 2  # 2: config.json (the training config) replaced network.json


def bundle_inputs(cfg: ModelConfig) -> dict[str, Any]:
    """The model's inputs, from the typed Data layer: label and dense widths, and per sparse
    input its slots and keys per sample (what a client must send)."""
    data = cfg.data
    return {"label": {"top": data.label_top, "label_dim": data.label_dim},
            "dense": {"top": data.dense_top, "dense_dim": data.dense_dim},
            "sparse": [{"top": sp.top, "type": sp.type, "slot_num": sp.slot_num,
                        "max_feature_num_per_sample": sp.max_feature_num_per_sample,
                        "max_nnz": sp.max_nnz} for sp in data.sparse]}


def check_bundle_target(output: str) -> None:
    """Raise unless ``output`` may receive a bundle: a new path, an empty folder, or a folder
    holding a previous jctr bundle (which is replaced). Anything else -- a checkpoint
    directory, a working directory, a file -- is never overwritten."""
    if not os.path.exists(output):
        return
    if not os.path.isdir(output):
        raise ModelFileError(f"{output}: exists and is not a folder; export writes a bundle "
                             "folder: give a new or empty folder")
    entries = os.listdir(output)
    if not entries:
        return
    manifest = os.path.join(output, "manifest.json")
    try:
        with open(manifest, encoding="utf-8") as f:
            is_bundle = json.load(f).get("format") == BUNDLE_FORMAT
    except (OSError, ValueError, AttributeError):
        is_bundle = False
    extra = set(entries) - _BUNDLE_ENTRIES
    if not is_bundle or extra:
        raise ModelFileError(f"{output}: holds {describe_contents(sorted(extra or entries))} "
                             "that are not part of a jctr inference bundle; export writes only "
                             "into a new or empty folder, or replaces a previous bundle")


_BUNDLE_ENTRIES = {"manifest.json", "config.json", "dense.model", "non_trainable.json",
                   "sparse"}


def export_bundle(cfg, state, output: str, placements=None, *,
                  keys: list[np.ndarray] | None = None, about: dict | None = None,
                  tables: list | None = None) -> str:
    """Write an inference bundle of a model (its parsed config and :class:`TrainState`; the
    optimizer state is not needed) into ``output``: a new or empty folder, or a previous
    bundle, replaced only once the new one is complete. ``placements`` say how the state's
    tables lie on devices (the trainer's plan; default: one device). ``keys`` (one array per
    embedding) keeps only those keys' rows (streaming training's base and delta models);
    ``about`` joins the manifest (e.g. ``{"kind": "delta", "day": ..., "pass": ...}``);
    ``tables`` (stored-table dicts with ``keys`` and ``values``, or per table a list or
    iterator of such parts, written one after the other) replace the state's tables.

    Example::

        export_bundle(trainer.cfg, trainer.state, "bundles/dlrm", trainer.placements)
    """
    from jctr.version import __version__

    output = os.path.abspath(output)
    if jax.process_index() != 0:  # the tables are gathered from every process; 0 writes
        from jctr.models.ctr import build_model

        step_config = build_model(cfg)[0]
        write_model_files(step_config, state, placements, "", "",
                          [""] * len(step_config.specs), keys=keys, tables=tables)
        return output
    check_bundle_target(output)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.", suffix=".partial", dir=parent)
    try:
        _write_bundle(cfg, state, placements, tmp, __version__, keys, about or {}, tables)
        _replace_folder(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def _replace_folder(new: str, output: str) -> None:
    """Move the finished folder ``new`` to ``output``; a previous bundle there goes only after
    the new one is in place."""
    if not os.path.exists(output):
        os.rename(new, output)
        return
    if not os.listdir(output):
        os.rmdir(output)
        os.rename(new, output)
        return
    old = new[:-len(".partial")] + ".old"
    os.rename(output, old)
    try:
        os.rename(new, output)
    except BaseException:
        os.rename(old, output)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_bundle(cfg, state, placements, tmp: str, version: str, keys, about: dict,
                  tables) -> None:
    from jctr.models.ctr import build_model

    os.makedirs(os.path.join(tmp, "sparse"))
    step_config, _ = build_model(cfg)
    counts = write_model_files(
        step_config, state, placements, os.path.join(tmp, "dense.model"),
        os.path.join(tmp, "non_trainable.json"),
        [os.path.join(tmp, "sparse", f"{spec.name}.model") for spec in step_config.specs],
        slot_ids=False, keys=keys, tables=tables)
    tables = {spec.name: {"keys": n, "embedding_vec_size": spec.dim, "combiner": spec.combiner}
              for spec, n in zip(step_config.specs, counts)}
    if cfg.raw is None:
        raise ModelFileError("the model's config was not parsed from JSON (jctr.config."
                             "parse_config / load_config): a bundle carries that JSON")
    dense_count = int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(state.params)))
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.raw, f, indent=1)
    manifest = {"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "jctr_version": version,
                "jax_version": jax.__version__, "step": int(to_host(state.step)),
                "embeddings": tables, "dense_weights": dense_count,
                "inputs": bundle_inputs(cfg), **about,
                # every other file's size and checksum, checked before it is read back
                "files": file_digests(tmp, skip={"manifest.json"})}
    with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)


class InferenceModel:
    """Predicts click probabilities from an inference bundle (CPU or any JAX device).

    Example::

        model = InferenceModel.load("bundles/dlrm")
        probs = model.predict(batch)      # a jctr Batch, as the readers produce
    """

    def __init__(self, cfg, state, specs, step_fn, manifest: dict):
        self.cfg = cfg
        self.state = state
        self.specs = specs
        self._eval = step_fn
        self.manifest = manifest

    @classmethod
    def load(cls, path: str) -> InferenceModel:
        from jctr.models.ctr import build_model, make_eval_step

        manifest = _read_json(os.path.join(path, "manifest.json"))
        if manifest.get("format") != BUNDLE_FORMAT:
            raise ModelFileError(f"{path}/manifest.json: not a jctr inference bundle")
        if manifest.get("version") != BUNDLE_VERSION:
            raise ModelFileError(f"{path}/manifest.json: bundle format version "
                                 f"{manifest.get('version')}; this jctr reads version "
                                 f"{BUNDLE_VERSION}: export the checkpoint again "
                                 "(python -m jctr.export)")
        # dense.model and the sparse folders are checked by their readers (load_model_files)
        check_files(path, {rel: v for rel, v in (manifest.get("files") or {}).items()
                           if rel != "dense.model" and not rel.startswith("sparse/")},
                    ModelFileError, "bundle")
        config_path = os.path.join(path, "config.json")
        try:
            cfg = parse_config(_read_json(config_path), source=config_path,
                               require_solver=False)
        except ConfigError as e:
            raise ModelFileError(f"{config_path}: the bundle's config does not parse ({e})") \
                from None
        tables = manifest.get("embeddings", {})
        missing = [e.name for e in cfg.embeddings if e.name not in tables]
        if missing:
            raise ModelFileError(f"{path}/manifest.json: no table for embedding(s) "
                                 f"{', '.join(missing)}")
        # tables sized to what the bundle holds: inference never inserts
        step_config, init_state = build_model(
            cfg, capacities={e.name: max(int(tables[e.name]["keys"]), 1)
                             for e in cfg.embeddings})
        # unknown keys have no row: they read as zeros
        state = load_model_files(
            step_config, init_state(), os.path.join(path, "dense.model"),
            tuple(os.path.join(path, "sparse", f"{spec.name}.model")
                  for spec in step_config.specs),
            non_trainable_json=os.path.join(path, "non_trainable.json"))
        eval_step = jax.jit(make_eval_step(step_config),
                           compiler_options=step_compiler_options(cfg.solver.compute_dtype))
        return cls(cfg, state, step_config.specs, eval_step, manifest)

    def predict(self, batch: Batch) -> np.ndarray:
        """Probabilities of the batch's real samples (padding dropped). A batch that does not
        match the bundle's inputs is a :class:`jctr.data.batch.BatchError`, as are what the
        HTTP endpoint refuses too: 64-bit keys narrowed to 32 bits (they would be other
        keys) and non-finite dense features."""
        if self.cfg.solver.input_key_type == "I64":
            for i, keys in enumerate(getattr(batch, "keys", ())):
                dtype = np.asarray(keys).dtype
                if dtype.kind in "iu" and dtype.itemsize < 8:
                    raise BatchError(f"Batch.keys[{i}]: {dtype} keys, but the model's keys are "
                                     "64-bit (input_key_type I64); narrowed keys are other "
                                     "keys: pass int64")
        batch = check_batch(batch, self.cfg.data)
        bad = nonfinite_dense(batch.dense)
        if bad:
            raise BatchError(f"Batch.dense: {bad}")
        _, pred = self._eval(self.state, jax.device_put(batch))
        return np.asarray(pred)[batch.mask]


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path}: cannot read: {e}") from e
