"""Parse a HugeCTR-style JSON config into :class:`ModelConfig`, validating as it goes."""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

from jctr.config.hps import read_kafka_security
from jctr.config.layer_types import LAYER_TYPES, LOSS_TYPES
from jctr.config.reader import ConfigError, ObjectReader, describe, join_path, json_from_text
from jctr.config.schema import (
    COMPUTE_DTYPES,
    DATA_FORMATS,
    EMBEDDING_TYPES,
    EVICTION_POLICIES,
    METRIC_MODES,
    MIXED_PRECISION_SCALERS,
    NAN_POLICIES,
    OPTIMIZER_TYPES,
    ROW_ONLY_OPTIMIZERS,
    SPARSE_INPUT_TYPES,
    SPILL_TYPES,
    UPDATE_TYPES,
    DataConfig,
    EarlyStoppingConfig,
    EmbeddingConfig,
    EvictionConfig,
    KafkaSinkConfig,
    LayerConfig,
    Metric,
    ModelConfig,
    OptimizerConfig,
    PlateauConfig,
    SolverConfig,
    SparseInputConfig,
    SparseSGDRule,
    SyntheticConfig,
    column_ref,
    default_mode,
)
from jctr.config.slots import localized_slot_owners, rows_per_device

_HPARAM_KEYS = {
    "Adam": "adam_hparam",
    "MomentumSGD": "momentum_sgd_hparam",
    "Nesterov": "nesterov_hparam",
    "SGD": "sgd_hparam",
    "AdaGrad": "adagrad_hparam",
}


def load_config(config: str | os.PathLike | dict, *, require_solver: bool = True) -> ModelConfig:
    """Parse and validate a config given as a JSON file path or an already-loaded dict.

    Example::

        cfg = load_config("configs/dlrm.json")
        cfg.solver.batchsize, [e.embedding_vec_size for e in cfg.embeddings]
    """
    source = None
    if isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError("<file>", f"cannot read config: {e.strerror}", source) from e
        raw = json_from_text(text, source)
    else:
        raw = config
    return parse_config(raw, source=source, require_solver=require_solver)


def override_solver(cfg: ModelConfig, changes: dict[str, Any],
                    names: dict[str, str] | None = None) -> ModelConfig:
    """``cfg`` with solver fields replaced, validated exactly like the file.

    ``changes`` maps solver field names to JSON-like values (tuples become lists); ``None``
    removes a field (its default applies). Setting ``max_iter`` drops ``num_epochs`` and the
    other way round, as on HugeCTR's command line. ``names`` maps a field to what the user
    typed (``{"max_iter": "--max-iter"}``) so that an error names that instead of the JSON path.

    Example::

        cfg = override_solver(load_config("configs/dlrm.json"), {"max_iter": 50})
    """
    raw = _raw_copy(cfg)
    solver = raw.setdefault("solver", {})
    if not isinstance(solver, dict):
        raise ConfigError("solver", "expected an object", cfg.source)
    if changes.get("max_iter") is not None and "num_epochs" not in changes:
        solver.pop("num_epochs", None)
    if changes.get("num_epochs") is not None and "max_iter" not in changes:
        solver.pop("max_iter", None)
    if changes.get("eval_batches") is not None:  # replaces HugeCTR 3.x's limits too
        solver.pop("max_eval_batches", None)
        solver.pop("max_eval_samples", None)
    return _reparse(cfg, raw, solver, "solver", changes, names)


def override_optimizer(cfg: ModelConfig, changes: dict[str, Any],
                       names: dict[str, str] | None = None) -> ModelConfig:
    """``cfg`` with fields of the global optimizer's hparam object (``adam_hparam`` for Adam,
    ...) replaced, validated like the file; embeddings with an optimizer of their own keep it.
    ``changes`` and ``names`` work as in :func:`override_solver`.

    Example::

        cfg = override_optimizer(load_config("configs/dlrm.json"), {"learning_rate": 0.05})
    """
    raw = _raw_copy(cfg)
    hkey = _HPARAM_KEYS[cfg.optimizer.type]
    hparam = raw["optimizer"].setdefault(hkey, {})
    return _reparse(cfg, raw, hparam, f"optimizer.{hkey}", changes, names)


def override_embedding_optimizers(cfg: ModelConfig, clause: dict[str, Any], *,
                                  merge_into: str | None = None) -> ModelConfig:
    """``cfg`` with every embedding layer's ``optimizer`` set to ``clause`` (a JSON object,
    e.g. streaming training's ``SparseAdaGradSGDRule``), validated like the file;
    ``merge_into``: only layers whose own optimizer has that type, their clause updated with
    ``clause``'s keys.

    Example::

        cfg = override_embedding_optimizers(cfg, {"type": "SparseAdaGradSGDRule", ...})
    """
    raw = _raw_copy(cfg)
    names = {e.name for e in cfg.embeddings}
    for layer in raw.get("layers", []):
        if not isinstance(layer, dict) or layer.get("name") not in names:
            continue
        own = layer.get("optimizer")
        if merge_into is None:
            layer["optimizer"] = _to_json(clause)
        elif isinstance(own, dict) and own.get("type") == merge_into:
            own.update(_to_json(clause))
    return parse_config(raw, source=cfg.source, require_solver=False)


def _raw_copy(cfg: ModelConfig) -> dict:
    if cfg.raw is None:
        raise TypeError("overriding fields needs a config parsed from JSON (ModelConfig.raw)")
    return copy.deepcopy(cfg.raw)


def _reparse(cfg: ModelConfig, raw: dict, clause: dict, path: str, changes: dict[str, Any],
             names: dict[str, str] | None) -> ModelConfig:
    """Apply ``changes`` to ``clause`` (an object inside ``raw`` at ``path``) and parse
    ``raw`` again; an error about a changed field names the flag that set it."""
    for key, value in changes.items():
        if value is None:
            clause.pop(key, None)
        else:
            clause[key] = _to_json(value)
    try:
        return parse_config(raw, source=cfg.source, require_solver=False)
    except ConfigError as e:
        rest = e.path[len(path) + 1:] if e.path.startswith(path + ".") else ""
        field = rest.split("[", 1)[0].split(".", 1)[0] or None
        if field in changes:
            where = (names or {}).get(field) or f"override {path}.{field}"
            raise ConfigError(where, e.reason) from None
        raise


def _to_json(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def parse_config(raw: Any, *, source: str | None = None,
                 require_solver: bool = True) -> ModelConfig:
    """Parse and validate a config dict (``source`` names it in errors). Relative data and
    snapshot paths stay relative to the working directory, as in HugeCTR."""
    root = ObjectReader(raw, "", source)
    solver = (parse_solver(root.child("solver")) if (root.has("solver") or require_solver)
              else SolverConfig())
    # a network file (HugeCTR's graph_to_json, an HPS model's network_file) has layers only
    optimizer = (parse_optimizer(root.child("optimizer"))
                 if (root.has("optimizer") or require_solver) else OptimizerConfig())
    if root.has("inference"):
        _check_inference_clause(root.child("inference"))
    if optimizer.type in ROW_ONLY_OPTIMIZERS:
        raise root.child("optimizer").error(
            "type", f'"{optimizer.type}" updates embedding rows only; give it in an '
            "embedding's own optimizer clause and keep a dense optimizer here")
    layers_raw = root.list("layers")
    root.finish()
    devices = sum(len(host) for host in solver.gpu)
    data, embeddings, layers = parse_layers(layers_raw, source, devices,
                                            network_only=not require_solver)
    if solver.paths_relative_to == "config" and source is not None:
        solver, data, embeddings = _from_config_folder(
            solver, data, embeddings, os.path.dirname(os.path.abspath(source)))
    cfg = ModelConfig(solver=solver, optimizer=optimizer, data=data, embeddings=embeddings,
                      layers=layers, source=source, raw=raw)
    validate_config(cfg)
    return cfg


def _from_config_folder(solver: SolverConfig, data: DataConfig | None, embeddings, base: str):
    """``solver.paths_relative_to: "config"``: the relative data, model-file, snapshot, log
    and spill paths resolved against the config file's folder (a config written beside its
    data runs from any working directory)."""
    def at(path):
        return path if path is None or os.path.isabs(path) else os.path.join(base, path)

    solver = dataclasses.replace(
        solver, snapshot_prefix=at(solver.snapshot_prefix), log_dir=at(solver.log_dir),
        dense_model_file=at(solver.dense_model_file),
        sparse_model_file=tuple(at(p) for p in solver.sparse_model_file))
    def each(paths):  # a Data layer's list of sources is kept comma-joined
        return ",".join(at(p) if p else p for p in paths.split(","))

    if data is not None:
        data = dataclasses.replace(
            data, source=each(data.source), eval_source=each(data.eval_source),
            test_sources=tuple((name, at(path)) for name, path in data.test_sources))
    embeddings = tuple(
        dataclasses.replace(e, eviction=dataclasses.replace(e.eviction, spill=at(e.eviction.spill)))
        if e.eviction is not None and e.eviction.spill else e for e in embeddings)
    return solver, data, embeddings


# ---- solver -------------------------------------------------------------------------------


def parse_solver(r: ObjectReader) -> SolverConfig:
    lr_policy = r.choice("lr_policy", ("fixed", "plateau"), "fixed")
    display = r.int("display", 200, min_value=1)
    max_iter = r.int("max_iter", None, min_value=1)
    num_epochs = r.int("num_epochs", None, min_value=1)
    gpu = _parse_gpu(r)
    batchsize = r.int("batchsize", 2048, min_value=1)
    batchsize_eval = r.int("batchsize_eval", batchsize, min_value=1)
    snapshot = r.int("snapshot", 0, min_value=0)
    snapshot_prefix = r.str("snapshot_prefix", "./")
    eval_interval = r.int_or_word("eval_interval", 1000, ("epoch",))
    eval_batches = _eval_batches(r, batchsize_eval)
    dense_model_file = r.str("dense model_file", None)
    if dense_model_file is None:
        dense_model_file = r.str("dense_model_file", None)
    sparse_model_file = r.str_or_list("sparse_model_file", ())
    mixed_precision = None
    if r.has("mixed_precision"):
        value = r.raw("mixed_precision")
        if value not in MIXED_PRECISION_SCALERS or isinstance(value, bool):
            raise r.error("mixed_precision",
                          f"expected one of 128, 256, 512, 1024, got {describe(value)}")
        mixed_precision = int(value)
    enable_tf32 = r.bool("enable_tf32_compute", False)
    metrics = _parse_metrics(r)
    input_key_type = r.choice("input_key_type", ("I32", "I64"), "I32")
    compute_dtype = r.choice("compute_dtype", COMPUTE_DTYPES,
                             "float16" if mixed_precision else "float32")
    if mixed_precision and compute_dtype != "float16":
        raise r.error("compute_dtype", "mixed_precision (loss scaling) implies float16; "
                      "drop mixed_precision to use bfloat16")
    seed = r.int("seed", 0, min_value=0)
    log_dir = r.str("log_dir", None)
    nan_policy = r.choice("nan_policy", NAN_POLICIES, "stop")
    snapshot_keep = r.int("snapshot_keep", 3, min_value=1)
    replicate_table_bytes = r.int("replicate_table_bytes", 0, min_value=0)
    all2all_capacity_factor = r.float("all2all_capacity_factor", 2.0, min_value=0.0)
    early_stopping = (_parse_watch(r.child("early_stopping"), EarlyStoppingConfig, metrics)
                      if r.has("early_stopping") else None)
    lr_plateau = None
    if r.has("lr_plateau") and lr_policy != "plateau":
        raise r.error("lr_plateau", "applies with lr_policy \"plateau\"; set that too")
    if lr_policy == "plateau":
        lr_plateau = (_parse_watch(r.child("lr_plateau"), PlateauConfig, metrics)
                      if r.has("lr_plateau") else
                      _parse_watch(ObjectReader({}, join_path(r.path, "lr_plateau"), r.source),
                                   PlateauConfig, metrics))
    kafka_sink = parse_kafka_sink(r.child("kafka_sink")) if r.has("kafka_sink") else None
    # Accepted for HugeCTR compatibility; XLA schedules the step as a whole already.
    r.bool("cuda_graph", True)
    for knob in ("holistic_cuda_graph", "algorithm_search", "async_mlp_wgrad",
                 "enable_overlap", "use_algorithm_search"):  # HugeCTR 3.x GPU scheduling
        r.bool(knob, False)
    r.raw("device_layout", None)
    # HugeCTR 3.3 reads it and its JSON training path never uses it (Model.export_predictions
    # of the Python API writes predictions); jctr: Trainer.predict / evaluate(data=...)
    r.str("export_predictions_prefix", None)
    for key, reason in _REFUSED_SOLVER_KEYS.items():
        if r.has(key):
            raise r.error(key, reason)
    threshold = r.float("auc_threshold", None, positive=True)
    if threshold is not None:  # HugeCTR 3.x CreateSolver: stop once AUC reaches it
        if not 0.0 < threshold <= 1.0:
            raise r.error("auc_threshold", f"expected a number in (0, 1], got {threshold}")
        if not any(m.name == "AUC" and m.threshold is not None for m in metrics):
            metrics = tuple(m for m in metrics if m.name != "AUC") + (Metric("AUC", threshold),)
    paths_relative_to = r.choice("paths_relative_to", ("working_dir", "config"), "working_dir")
    r.finish()
    return SolverConfig(
        paths_relative_to=paths_relative_to, lr_policy=lr_policy, display=display,
        max_iter=max_iter, num_epochs=num_epochs, gpu=gpu,
        batchsize=batchsize, batchsize_eval=batchsize_eval, snapshot=snapshot,
        snapshot_prefix=snapshot_prefix, eval_interval=eval_interval, eval_batches=eval_batches,
        dense_model_file=dense_model_file, sparse_model_file=sparse_model_file,
        mixed_precision=mixed_precision, enable_tf32_compute=enable_tf32, eval_metrics=metrics,
        input_key_type=input_key_type, compute_dtype=compute_dtype, seed=seed, log_dir=log_dir,
        snapshot_keep=snapshot_keep, replicate_table_bytes=replicate_table_bytes,
        all2all_capacity_factor=all2all_capacity_factor, nan_policy=nan_policy,
        early_stopping=early_stopping, lr_plateau=lr_plateau, kafka_sink=kafka_sink)


_REFUSED_SOLVER_KEYS = {
    "dense_opt_states_file": "HugeCTR's optimizer state files are not read; jctr resumes "
    "optimizer state from its own checkpoints (--resume)",
    "sparse_opt_states_file": "HugeCTR's optimizer state files are not read; jctr resumes "
    "optimizer state from its own checkpoints (--resume)",
}


def _eval_batches(r: ObjectReader, batchsize_eval: int) -> int | None:
    """Batches per evaluation: ``eval_batches`` (2.x), ``max_eval_batches`` or
    ``max_eval_samples`` (3.x, ``solver_parser.cpp``; samples are truncated to whole
    batches); at most one of them."""
    given = [k for k in ("eval_batches", "max_eval_batches", "max_eval_samples")
             if r.raw(k, None) is not None]  # null: unset
    if len(given) > 1:
        raise r.error(given[1], f"give one of eval_batches, max_eval_batches, max_eval_samples "
                      f"(also given: {given[0]})")
    if not given:
        return None
    if given[0] == "max_eval_samples":
        samples = r.int("max_eval_samples", min_value=1)
        if samples < batchsize_eval:
            raise r.error("max_eval_samples", f"{samples} is less than one evaluation batch "
                          f"(batchsize_eval {batchsize_eval})")
        return samples // batchsize_eval
    return r.int(given[0], min_value=1)


def _parse_watch(r: ObjectReader, kind: type, metrics: tuple[Metric, ...]):
    """``solver.early_stopping`` or ``solver.lr_plateau``: a validation metric to watch (one of
    eval_metrics), its direction, and the clause's own numbers."""
    names = [m.name for m in metrics]
    metric = r.choice("metric", names, "AUC" if "AUC" in names else names[0])
    mode = r.choice("mode", METRIC_MODES, default_mode(metric))
    patience = r.int("patience", kind().patience, min_value=1)
    min_delta = r.float("min_delta", 0.0, min_value=0.0)
    min_delta_mode = r.choice("min_delta_mode", ("absolute", "relative"), "absolute")
    if kind is EarlyStoppingConfig:
        extra = {"restore_best_weights": r.bool("restore_best_weights", True),
                 "start_from_epoch": r.int("start_from_epoch", 0, min_value=0),
                 "restart_after_lr_drop": r.bool("restart_after_lr_drop", False)}
    else:
        factor = r.float("factor", 0.1, min_value=0.0)
        if not 0.0 < factor < 1.0:
            raise r.error("factor", f"expected a number between 0 and 1 (exclusive), got "
                          f"{describe(factor)}")
        extra = {"factor": factor, "min_lr": r.float("min_lr", 0.0, min_value=0.0)}
    r.finish()
    return kind(metric=metric, mode=mode, patience=patience, min_delta=min_delta,
                min_delta_mode=min_delta_mode, **extra)


def _parse_gpu(r: ObjectReader) -> tuple[tuple[int, ...], ...]:
    value = r.raw("gpu", [0])
    msg = "expected a list of device indices or a list of such lists (one per host)"
    if not isinstance(value, list) or not value:
        raise r.error("gpu", f"{msg}, got {describe(value)}")
    if all(isinstance(v, list) for v in value):
        hosts = value
    elif all(not isinstance(v, list) for v in value):
        hosts = [value]
    else:
        raise r.error("gpu", f"{msg}; do not mix the two")
    out = []
    for h, host in enumerate(hosts):
        if not host:
            raise r.error("gpu", f"host {h} lists no device")
        for v in host:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise r.error("gpu", f"{msg}, got {describe(v)} among them")
        if len(set(host)) != len(host):
            raise r.error("gpu", f"host {h} lists a device twice: {host}")
        out.append(tuple(host))
    return tuple(out)


def _parse_metrics(r: ObjectReader) -> tuple[Metric, ...]:
    value = r.raw("eval_metrics", ["AUC"])
    if not isinstance(value, list):
        raise r.error("eval_metrics", f"expected a list such as [\"AUC:0.8025\", "
                      f"\"AverageLoss\"], got {describe(value)}")
    metrics = []
    for i, item in enumerate(value):
        path = join_path(join_path(r.path, "eval_metrics"), i)
        if not isinstance(item, str):
            raise ConfigError(path, f"expected \"AUC\", \"AUC:<threshold>\", \"AverageLoss\" "
                              f"or \"LogLoss\", got {describe(item)}", r.source)
        name, _, threshold = item.partition(":")
        if name in ("AverageLoss", "LogLoss") and not threshold:
            metrics.append(Metric(name))
        elif name == "AUC":
            t = None
            if threshold:
                try:
                    t = float(threshold)
                except ValueError:
                    t = -1.0
                if not 0.0 < t <= 1.0:
                    raise ConfigError(path, f"AUC threshold must be a number in (0, 1], got "
                                      f"{describe(threshold)}", r.source)
            metrics.append(Metric("AUC", t))
        else:
            raise ConfigError(path, f"expected \"AUC\", \"AUC:<threshold>\", \"AverageLoss\" "
                              f"or \"LogLoss\", got {describe(item)}", r.source)
    return tuple(metrics)


# ---- optimizer ----------------------------------------------------------------------------


def parse_kafka_sink(r: ObjectReader) -> KafkaSinkConfig:
    """``solver.kafka_sink`` (also the streaming config's ``kafka_sink``)."""
    name = r.str("model_name")
    if not name or not all(c.isalnum() or c in "._-" for c in name):
        raise r.error("model_name", f"expected a model name of letters, digits, '.', '_' or "
                      f"'-', got {name!r}")
    brokers = r.str("brokers", "127.0.0.1:9092")
    if not brokers.strip():
        raise r.error("brokers", "expected host:port of at least one broker")
    out = KafkaSinkConfig(model_name=name, brokers=brokers,
                          send_buffer_size=r.int("send_buffer_size", 262144, min_value=4096),
                          every_n_steps=r.int("every_n_steps", 0, min_value=0),
                          max_buffered_mb=r.int("max_buffered_mb", 64, min_value=1),
                          security=read_kafka_security(r))
    r.finish()
    return out


def parse_sparse_sgd_rule(r: ObjectReader) -> SparseSGDRule:
    """One ``embed_sgd_param`` / ``embedx_sgd_param`` object (PaddlePaddle's names)."""
    r.choice("name", ("SparseAdaGradSGDRule",), "SparseAdaGradSGDRule")
    bounds = r.list("weight_bounds", [-10.0, 10.0])
    if (len(bounds) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                    for b in bounds) or not bounds[0] < bounds[1]):
        raise r.error("weight_bounds", f"expected [low, high] with low < high, got "
                      f"{describe(bounds)}")
    rule = SparseSGDRule(learning_rate=r.float("learning_rate", 0.05, min_value=0.0),
                         initial_g2sum=r.float("initial_g2sum", 3.0, positive=True),
                         initial_range=r.float("initial_range", 1e-4, min_value=0.0),
                         weight_bounds=(float(bounds[0]), float(bounds[1])))
    r.finish()
    return rule


def parse_optimizer(r: ObjectReader) -> OptimizerConfig:
    opt_type = r.choice("type", OPTIMIZER_TYPES)
    update_type = r.choice("update_type", UPDATE_TYPES, "Local")
    if opt_type == "SparseAdaGradSGDRule":
        if update_type != "Local":
            raise r.error("update_type", f'"{update_type}": SparseAdaGradSGDRule updates the '
                          'rows a batch touches ("Local")')
        rules = {key: parse_sparse_sgd_rule(r.child(key)) if r.has(key) else SparseSGDRule()
                 for key in ("embed_sgd_param", "embedx_sgd_param")}
        admission = {"embedx_threshold": r.float("embedx_threshold", 0.0, min_value=0.0),
                     "click_coeff": r.float("click_coeff", 1.0, min_value=0.0),
                     "nonclk_coeff": r.float("nonclk_coeff", 0.1, min_value=0.0)}
        show = r.str("show", "") or None
        if show is not None and column_ref(show) is None:
            raise r.error("show", f'expected "dense[i]" or "label[i]", got {show!r}')
        r.finish()
        # each part has its own rate; the schedule's rate (1.0 here) only scales them, so
        # the plateau factor and a skipped step's zero rate reach these rows too
        return OptimizerConfig(type=opt_type, learning_rate=1.0, **rules, **admission,
                               show=show)
    # Older HugeCTR configs carry a boolean "learning_rate" flag here; it has no effect.
    r.bool("learning_rate", True)
    r.bool("global_update", False)
    kwargs: dict[str, Any] = {}
    hkey = _HPARAM_KEYS[opt_type]
    for other_type, other_key in _HPARAM_KEYS.items():
        if other_type != opt_type and r.has(other_key):
            raise r.error(other_key, f"belongs to optimizer type \"{other_type}\", but type is "
                          f"\"{opt_type}\" (expected \"{hkey}\")")
    if r.has(hkey):
        h = r.child(hkey)
        kwargs["learning_rate"] = h.float("learning_rate", 0.001 if opt_type == "Adam" else 0.01,
                                          positive=True)
        if opt_type == "Adam":
            kwargs["beta1"] = h.float("beta1", 0.9, min_value=0.0, max_value=0.999999)
            kwargs["beta2"] = h.float("beta2", 0.999, min_value=0.0, max_value=0.999999)
            kwargs["epsilon"] = h.float("epsilon", 1e-7, positive=True)
        elif opt_type in ("MomentumSGD", "Nesterov"):
            kwargs["momentum_factor"] = h.float("momentum_factor", 0.0, min_value=0.0,
                                                max_value=0.999999)
        elif opt_type == "AdaGrad":
            kwargs["initial_accu_value"] = h.float("initial_accu_value", 0.0, min_value=0.0)
            kwargs["epsilon"] = h.float("epsilon", 1e-7, positive=True)
        elif opt_type == "SGD":
            h.bool("atomic_update", True)  # HugeCTR GPU detail; updates here are deterministic
        kwargs["warmup_steps"] = h.int("warmup_steps", 0, min_value=0)
        kwargs["decay_start"] = h.int("decay_start", 0, min_value=0)
        kwargs["decay_steps"] = h.int("decay_steps", 0, min_value=0)
        kwargs["decay_power"] = h.float("decay_power", 2.0, positive=True)
        kwargs["end_lr"] = h.float("end_lr", 0.0, min_value=0.0)
        h.finish()
        if kwargs["decay_start"] and not kwargs["decay_steps"]:
            raise h.error("decay_steps", "must be positive when decay_start is set")
    else:
        kwargs["learning_rate"] = 0.001 if opt_type == "Adam" else 0.01
    r.finish()
    return OptimizerConfig(type=opt_type, update_type=update_type, **kwargs)


# ---- layers -------------------------------------------------------------------------------


def parse_layers(layers_raw: list, source: str | None, devices: int = 1, *,
                 network_only: bool = False):
    if not layers_raw:
        raise ConfigError("layers", "expected a non-empty list of layers", source)
    data = None
    embeddings: list[EmbeddingConfig] = []
    dense: list[LayerConfig] = []
    for i, raw in enumerate(layers_raw):
        path = f"layers[{i}]"
        r = ObjectReader(raw, path, source)
        ltype = r.str("type")
        if i == 0 and ltype != "Data":
            raise r.error("type", f"the first layer must be the Data layer, got {describe(ltype)}")
        if ltype == "Data":
            if data is not None:
                raise r.error("type", "a second Data layer; a config has exactly one")
            data = parse_data(r, network_only=network_only)
        elif ltype in EMBEDDING_TYPES:
            if dense:
                raise r.error("type", "embedding layers must precede the dense layers "
                              f"(dense layer \"{dense[0].name}\" comes before)")
            embeddings.append(parse_embedding(r, ltype, devices))
        elif ltype in LAYER_TYPES:
            dense.append(parse_dense_layer(r, ltype))
        else:
            known = ", ".join(["Data", *EMBEDDING_TYPES, *sorted(LAYER_TYPES)])
            raise r.error("type", f"unknown layer type {describe(ltype)}; known: {known}")
    if not embeddings:
        raise ConfigError("layers", "no embedding layer; expected at least one of "
                          + ", ".join(EMBEDDING_TYPES), source)
    return data, tuple(embeddings), tuple(dense)


def parse_data(r: ObjectReader, *, network_only: bool = False) -> DataConfig:
    """The Data layer; ``network_only`` (a network file for inference) makes the sources
    optional."""
    name = r.str("name", "data")
    fmt = r.choice("format", DATA_FORMATS, "Norm")
    # a network file names no data; a training config must
    sources = [r.str_or_list(key, ("",)) if network_only else r.str_or_list(key)
               for key in ("source", "eval_source")]
    source_value, eval_value = sources
    test_sources = _parse_test_sources(r)
    check = r.choice("check", ("Sum", "None"), "None")
    if fmt != "Norm" and check != "None":
        raise r.error("check", f"format {fmt} has no checksum; expected \"None\"")
    label = r.child("label")
    label_top = label.str("top")
    label_dim = label.int("label_dim", 1, min_value=1)
    label.finish()
    dense = r.child("dense")
    dense_top = dense.str("top")
    dense_dim = dense.int("dense_dim", min_value=0)
    dense.finish()
    sparse_raw = r.list("sparse")
    if not sparse_raw:
        raise r.error("sparse", "expected a non-empty list of sparse inputs")
    sparse = []
    for j, s_raw in enumerate(sparse_raw):
        s = ObjectReader(s_raw, join_path(join_path(r.path, "sparse"), j), r.source)
        top = s.str("top")
        slot_num = s.int("slot_num", min_value=1)
        if s.has("nnz_per_slot"):  # HugeCTR 3.x: the most keys of each slot
            # (create_datareader.cpp; parser.hpp get_max_feature_num_per_sample_from_nnz_per_slot)
            for key in ("max_feature_num_per_sample", "max_nnz"):
                if s.has(key):
                    raise s.error(key, "give nnz_per_slot (HugeCTR 3.x) or "
                                  "max_feature_num_per_sample / max_nnz (2.x), not both")
            nnz = _nnz_per_slot(s, slot_num)
            max_feat, max_nnz = sum(nnz), max(nnz)
            # 3.x names no input type: the embedding that reads it places it
            stype = s.choice("type", SPARSE_INPUT_TYPES, "DistributedSlot")
        else:
            stype = s.choice("type", SPARSE_INPUT_TYPES)
            max_feat = s.int("max_feature_num_per_sample", min_value=1)
            max_nnz = s.int("max_nnz", max_feat, min_value=1)
        fixed = s.raw("is_fixed_length", False)  # a GPU reader shortcut: no effect here
        if fixed not in (True, False, 0, 1):
            raise s.error("is_fixed_length", f"expected true or false, got {describe(fixed)}")
        s.finish()
        if fmt in ("Raw", "Parquet"):
            # HugeCTR's Raw and Parquet readers take exactly one key per slot: max_nnz and
            # max_feature_num_per_sample (26, 30, 100 in its samples) are upper bounds
            max_nnz = 1
        if max_feat < slot_num and max_nnz == 1:
            raise s.error("max_feature_num_per_sample",
                          f"one-hot input (max_nnz 1) needs at least slot_num={slot_num}, "
                          f"got {max_feat}")
        sparse.append(SparseInputConfig(top=top, type=stype, max_feature_num_per_sample=max_feat,
                                        slot_num=slot_num, max_nnz=max_nnz))
    num_samples = r.int("num_samples", None, min_value=1)
    eval_num_samples = r.int("eval_num_samples", None, min_value=1)
    slot_size_array = r.int_list("slot_size_array", (), min_value=1)
    float_label_dense = r.bool("float_label_dense", False)
    cache = r.raw("cache_eval_data", 0)
    if isinstance(cache, bool):
        cache = int(cache)
    elif not isinstance(cache, int) or cache < 0:
        raise r.error("cache_eval_data", f"expected true, false or a non-negative count of "
                      f"batches, got {describe(cache)}")
    synthetic = _parse_synthetic(r.child("synthetic")) if r.has("synthetic") else None
    shuffle = r.bool("shuffle", False)
    r.finish()
    if fmt == "FeatureSpec" and any(not s.one_hot for s in sparse):
        raise r.error("sparse", "format FeatureSpec is one-hot: every sparse input needs "
                      "max_nnz 1")
    if fmt == "Raw":
        if num_samples is None:
            raise r.error("num_samples", "required for format Raw (the file has no header)")
        if eval_num_samples is None:
            raise r.error("eval_num_samples", "required for format Raw")
    if fmt in ("Raw", "Parquet") and slot_size_array:
        # with it, slot s holds keys [0, size) and jctr offsets them into one table (HugeCTR's
        # slot_offset); without it (HugeCTR 3.x allows that) keys are used as they are
        total_slots = sum(s.slot_num for s in sparse)
        if len(slot_size_array) != total_slots:
            raise r.error("slot_size_array", f"has {len(slot_size_array)} entries but the sparse "
                          f"inputs have {total_slots} slots in all")
    tops = [label_top, dense_top, *(s.top for s in sparse)]
    dup = {t for t in tops if tops.count(t) > 1}
    if dup:
        raise r.error("sparse", f"top name {describe(sorted(dup)[0])} is used twice")
    return DataConfig(
        name=name, source=",".join(source_value), eval_source=",".join(eval_value),
        label_top=label_top, label_dim=label_dim, dense_top=dense_top, dense_dim=dense_dim,
        sparse=tuple(sparse), format=fmt, check=check, num_samples=num_samples,
        eval_num_samples=eval_num_samples, slot_size_array=slot_size_array,
        float_label_dense=float_label_dense, cache_eval_data=cache, synthetic=synthetic,
        shuffle=shuffle, test_sources=test_sources)


def _check_inference_clause(r: ObjectReader) -> None:
    """The ``inference`` clause HugeCTR's ``graph_to_json`` writes into a network file: its
    numbers are read from the parameter server's model entry (ps.json) when serving, so here
    they are only checked."""
    r.int("max_batchsize", None, min_value=1)
    r.float("hit_rate_threshold", None, min_value=0.0, max_value=1.0)
    r.str("dense_model_file", None)
    r.str_or_list("sparse_model_file", ())
    for flag in ("use_gpu_embedding_cache", "use_mixed_precision", "i64_input_key"):
        r.bool(flag, False)
    r.float("cache_size_percentage", None, min_value=0.0, max_value=1.0)
    r.int("device_id", None, min_value=0)
    r.finish()


def _nnz_per_slot(s: ObjectReader, slot_num: int) -> list[int]:
    value = s.raw("nnz_per_slot")
    if isinstance(value, list):
        nnz = list(s.int_list("nnz_per_slot", min_value=1))
        if len(nnz) != slot_num:
            raise s.error("nnz_per_slot", f"has {len(nnz)} entries for slot_num {slot_num}")
        return nnz
    return [s.int("nnz_per_slot", min_value=1)] * slot_num


def _parse_test_sources(r: ObjectReader) -> tuple[tuple[str, str], ...]:
    """``test_source``: a source (named "test"), a list of sources ("test1", "test2", ...) or
    an object of name: source."""
    value = r.raw("test_source", None)
    if value is None:
        return ()
    if isinstance(value, dict) and value:
        sub = ObjectReader(value, join_path(r.path, "test_source"), r.source)
        out = tuple((name, ",".join(sub.str_or_list(name))) for name in value)
        sub.finish()
        return out
    sources = r.str_or_list("test_source")
    if len(sources) == 1:
        return (("test", sources[0]),)
    return tuple((f"test{i + 1}", src) for i, src in enumerate(sources))


def _parse_synthetic(r: ObjectReader) -> SyntheticConfig:
    out = SyntheticConfig(
        num_samples=r.int("num_samples", min_value=1),
        eval_num_samples=r.int("eval_num_samples", min_value=1),
        vocabulary_size=r.int("vocabulary_size", 100_000, min_value=1),
        alpha=r.float("alpha", 1.2, positive=True),
        num_files=r.int("num_files", 4, min_value=1),
        seed=r.int("seed", 0, min_value=0),
        signal=r.float("signal", 1.0, min_value=0.0),
    )
    r.finish()
    return out


def parse_embedding(r: ObjectReader, etype: str, devices: int = 1) -> EmbeddingConfig:
    """One embedding layer; ``devices`` (all of ``solver.gpu``) sizes a table given by its
    ``slot_size_array``."""
    name = r.str("name")
    bottom = r.str("bottom")
    top = r.str("top")
    plan_file = _parse_plan_file(r)
    h = r.child("sparse_embedding_hparam")
    sizes = h.int_list("slot_size_array", (), min_value=1)
    spread = sizes and not etype.startswith("LocalizedSlot")
    if etype == "LocalizedSlotSparseEmbeddingOneHot" and not sizes:
        raise h.error("slot_size_array", "required for LocalizedSlotSparseEmbeddingOneHot "
                      "(its table holds each slot's keys [0, size) side by side)")
    vec = h.int("embedding_vec_size", min_value=1)
    if h.has("workspace_size_per_gpu_in_mb") and h.has("max_vocabulary_size_per_gpu"):
        raise h.error("workspace_size_per_gpu_in_mb", "give it (HugeCTR 3.x) or "
                      "max_vocabulary_size_per_gpu (2.x), not both")
    workspace = h.int("workspace_size_per_gpu_in_mb", None, min_value=1)
    if spread:
        # HugeCTR 3.x reads slot_size_array here and passes none to a DistributedSlot table
        # (create_embedding.cpp); jctr sizes the table from it only when nothing else does:
        # keys spread by hash, so a device holds its share and a margin
        if workspace is None and not h.has("max_vocabulary_size_per_gpu"):
            vocab = sum(sizes) if devices == 1 else int(sum(sizes) / devices * 1.05) + 1024
        else:
            vocab = ((workspace << 20) // (4 * vec) if workspace is not None
                     else h.int("max_vocabulary_size_per_gpu", min_value=1))
        sizes = ()
    elif sizes:
        # HugeCTR sizes such tables from the slots and ignores max_vocabulary_size_per_gpu
        h.int("max_vocabulary_size_per_gpu", None, min_value=1)
        replicate = h.raw("replicated", None) is True
        owners = localized_slot_owners(sizes, len(sizes), 1 if replicate else devices)
        vocab = rows_per_device(sizes, owners, 1 if replicate else devices)
    elif workspace is not None:
        # HugeCTR 3.x create_embedding.cpp: the MB of float vectors a device holds
        vocab = (workspace << 20) // (4 * vec)
        if vocab < 1:
            raise h.error("workspace_size_per_gpu_in_mb", f"{workspace} MB holds no vector of "
                          f"embedding_vec_size {vec}")
    else:
        vocab = h.int("max_vocabulary_size_per_gpu", min_value=1)
    combiner_raw = h.raw("combiner", 0)
    combiner = {0: "sum", 1: "mean", "sum": "sum", "mean": "mean"}.get(
        combiner_raw if not isinstance(combiner_raw, bool) else None)
    if combiner is None:
        raise h.error("combiner", f"expected 0 (sum) or 1 (mean), got {describe(combiner_raw)}")
    h.int("load_factor", 1)  # legacy field, capacity here is exact
    init_range = h.float("init_range", None, positive=True)
    replicated = h.bool("replicated", None)
    l2_lambda = h.float("l2_lambda", 0.0, min_value=0.0)
    l1_lambda = h.float("l1_lambda", 0.0, min_value=0.0)
    l2_rows = h.choice("l2_rows", ("touched", "all"), "touched")
    growable = h.bool("growable", False)
    if growable and sizes and not spread:
        raise h.error("growable", "a LocalizedSlot table sized by slot_size_array holds every "
                      "key of its slots already: it has nothing to grow for")
    if l2_rows == "all" and not l2_lambda:
        raise h.error("l2_rows", '"all" regularizes with l2_lambda, which is 0 here: give '
                      "l2_lambda too")
    h.finish()
    optimizer = parse_optimizer(r.child("optimizer")) if r.has("optimizer") else None
    eviction = _parse_eviction(r.child("eviction")) if r.has("eviction") else None
    r.finish()
    return EmbeddingConfig(name=name, type=etype, bottom=bottom, top=top,
                           max_vocabulary_size_per_gpu=vocab, embedding_vec_size=vec,
                           combiner=combiner, optimizer=optimizer, plan_file=plan_file,
                           init_range=init_range, replicated=replicated,
                           l2_lambda=l2_lambda, l1_lambda=l1_lambda, slot_size_array=sizes,
                           eviction=eviction, l2_rows=l2_rows, growable=growable)


def _parse_eviction(r: ObjectReader) -> EvictionConfig:
    """An embedding layer's ``eviction`` object."""
    policy = r.choice("policy", EVICTION_POLICIES)
    epoch_steps = r.int("epoch_steps", 1000, min_value=1)
    if epoch_steps > 1 << 28:  # the table's clock goes back by whole epochs past 2**30
        raise r.error("epoch_steps", f"expected at most {1 << 28:,} steps an epoch, got "
                      f"{epoch_steps:,}")
    if r.has("epoch_steps") and not policy.startswith("epoch_"):
        raise r.error("epoch_steps", f'only the epoch_* policies have epochs, not "{policy}"')
    samples = r.int("samples", 8, min_value=1)
    if samples > 64:
        raise r.error("samples", f"expected at most 64 slots ranked per new key, got {samples}")
    spill = r.str("spill", None)
    if spill is not None and not spill.strip():
        raise r.error("spill", "expected a folder for the database of evicted rows")
    spill_type = r.choice("spill_type", SPILL_TYPES, "rocks_db")
    if r.has("spill_type") and spill is None:
        raise r.error("spill_type", 'says where "spill" keeps evicted rows: give "spill" (a '
                      "folder) too")
    score_fn = r.str("score_fn", None)
    if policy == "score":  # (its form and function checked when a trainer is made)
        if score_fn is None:
            raise r.error("score_fn", 'the "score" policy takes its scores from a function: '
                          'expected "module:function" (keys, step -> int32 scores)')
    elif score_fn is not None:
        raise r.error("score_fn", f'only the "score" policy takes scores, not "{policy}"')
    r.finish()
    return EvictionConfig(policy, epoch_steps, samples, spill, score_fn, spill_type)


def _parse_plan_file(r: ObjectReader) -> str | None:
    """``plan_file``: HugeCTR's all-to-all plan for its NCCL/gossip routing, one path or a
    list of one per node; jctr plans placement itself and reads neither."""
    value = r.raw("plan_file", None)
    if value is None:
        return None
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return ",".join(value)
    return r.str("plan_file")




def parse_dense_layer(r: ObjectReader, ltype: str) -> LayerConfig:
    spec = LAYER_TYPES[ltype]
    (lo, hi), n_tops = spec.bottoms, spec.tops
    r.has("type")
    name = r.str("name")
    bottoms = r.str_or_list("bottom")
    tops = r.str_or_list("top")
    params = spec.parse(r)
    r.finish()
    if not lo <= len(bottoms) <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise r.error("bottom", f"{ltype} takes {want} bottom(s), got {len(bottoms)}")
    if n_tops is None:
        n_tops = len(params.ranges)  # Slice: one top per range
    if n_tops == -1:
        if len(tops) < 2:
            raise r.error("top", f"{ltype} needs at least 2 tops, got {len(tops)}")
    elif len(tops) != n_tops:
        raise r.error("top", f"{ltype} produces {n_tops} top(s), got {len(tops)}")
    return LayerConfig(name=name, type=ltype, bottoms=bottoms, tops=tops, params=params,
                       path=r.path)


# ---- whole-config checks ------------------------------------------------------------------


def validate_config(cfg: ModelConfig) -> None:
    """Cross-field checks: names resolve to earlier tops, exactly one loss, last."""
    src = cfg.source
    sparse_tops = {s.top for s in cfg.data.sparse}
    available = {cfg.data.label_top, cfg.data.dense_top, *sparse_tops}
    names = set()
    spill_types: dict[str, str] = {}  # a spill folder holds one kind of store
    for i, emb in enumerate(cfg.embeddings):
        path = f"layers[{1 + i}]"
        if emb.name in names:
            raise ConfigError(f"{path}.name", f"duplicate layer name \"{emb.name}\"", src)
        names.add(emb.name)
        ev = emb.eviction
        if ev is not None and ev.spill:
            kind = spill_types.setdefault(os.path.abspath(ev.spill), ev.spill_type)
            if kind != ev.spill_type:
                raise ConfigError(f"{path}.eviction.spill_type", f'"{ev.spill_type}", but an '
                                  f"earlier table spills to {ev.spill} as \"{kind}\": give "
                                  "each kind its own folder", src)
        if emb.bottom not in sparse_tops:
            raise ConfigError(f"{path}.bottom", f"\"{emb.bottom}\" is not a sparse input of the "
                              f"Data layer; expected one of {sorted(sparse_tops)}", src)
        if emb.top in available:
            raise ConfigError(f"{path}.top", f"\"{emb.top}\" is already defined", src)
        sp = cfg.data.sparse_input(emb.bottom)
        show = emb.optimizer.show if emb.optimizer is not None else None
        if show is not None:
            kind, index = column_ref(show)
            width = cfg.data.label_dim if kind == "label" else cfg.data.dense_dim
            if index >= width:
                raise ConfigError(f"{path}.optimizer.show", f'"{show}", but the Data layer has '
                                  f"{width} {kind} column(s)", src)
        if emb.slot_size_array and len(emb.slot_size_array) != sp.slot_num:
            raise ConfigError(f"{path}.sparse_embedding_hparam.slot_size_array",
                              f"has {len(emb.slot_size_array)} entries but input \"{sp.top}\" "
                              f"has slot_num {sp.slot_num}", src)
        if emb.type == "LocalizedSlotSparseEmbeddingOneHot":
            if not sp.one_hot:
                raise ConfigError(f"{path}.type", "LocalizedSlotSparseEmbeddingOneHot needs a "
                                  f"one-hot input (max_nnz 1); \"{sp.top}\" has max_nnz "
                                  f"{sp.max_nnz}", src)
        available.add(emb.top)
    losses = [layer for layer in cfg.layers if layer.type in LOSS_TYPES]
    if len(losses) != 1:
        raise ConfigError("layers", f"expected exactly one loss layer ({', '.join(LOSS_TYPES)}), "
                          f"found {len(losses)}", src)
    for layer in cfg.layers:
        if layer.name in names:
            raise ConfigError(f"{layer.path}.name", f"duplicate layer name \"{layer.name}\"", src)
        names.add(layer.name)
        for b in layer.bottoms:
            if b not in available:
                raise ConfigError(f"{layer.path}.bottom", f"\"{b}\" is not the top of any earlier "
                                  "layer or input", src)
        for t in layer.tops:
            if t in available:
                raise ConfigError(f"{layer.path}.top", f"\"{t}\" is already defined", src)
            available.add(t)
    if cfg.layers[-1].type not in LOSS_TYPES:
        raise ConfigError(f"{cfg.layers[-1].path}.type", "the loss layer must be the last layer",
                          src)
    loss = losses[0]
    if loss.bottoms[1] != cfg.data.label_top:
        raise ConfigError(f"{loss.path}.bottom", f"the second bottom of the loss must be the "
                          f"label \"{cfg.data.label_top}\", got \"{loss.bottoms[1]}\"", src)
    for sp in cfg.data.sparse:  # key positions and segment ids of a batch are int32
        width = sp.key_positions
        for name in ("batchsize", "batchsize_eval"):
            size = getattr(cfg.solver, name)
            if size * max(width, sp.slot_num) >= 2**31:
                raise ConfigError(f"solver.{name}", f"{size:,} samples x {width} key positions "
                                  f"of sparse input \"{sp.top}\" (max_feature_num_per_sample, "
                                  "or slot_num when one-hot) pass 2^31 keys in one batch; use "
                                  "a smaller batch", src)
    n_sparse_model = len(cfg.solver.sparse_model_file)
    if n_sparse_model and n_sparse_model != len(cfg.embeddings):
        raise ConfigError("solver.sparse_model_file", f"lists {n_sparse_model} files for "
                          f"{len(cfg.embeddings)} embeddings", src)
