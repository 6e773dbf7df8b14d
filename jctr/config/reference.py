"""The config reference, generated from the typed dataclasses: every JSON key of a training
config and of a parameter-server file with its type, default and meaning.

Meanings are the fields' attribute docstrings (the string right below each field in
:mod:`jctr.config.schema`, :mod:`jctr.config.layer_types` and :mod:`jctr.config.hps`); a test
fails when a field has none (:func:`undocumented_fields`). The docs' "Config reference" page
holds :func:`config_reference_markdown` below its marker line, written by
``python -m jctr.config.reference --write docs/config-reference.md``; a test fails when the
page is not what the code generates.

Example::

    from jctr.config.reference import config_reference_markdown
    print(config_reference_markdown()[:300])
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
from dataclasses import dataclass, field
from functools import cache
from types import ModuleType

from jctr.config import hps, layer_types, schema
from jctr.config.layer_types import LAYER_TYPES, NoParam

DOCUMENTED_MODULES: tuple[ModuleType, ...] = (schema, layer_types, hps)


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass: field name -> the string literal right below
    the field (PEP 257's attribute docstrings, which Sphinx and mkdocstrings also read)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def config_dataclasses() -> list[type]:
    """Every dataclass defined in the config modules."""
    out = []
    for module in DOCUMENTED_MODULES:
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                out.append(obj)
    return out


def undocumented_fields() -> list[str]:
    """``module.Class.field`` for every config field without a docstring, and
    ``LAYER_TYPES[name]`` for every layer type without a description."""
    missing = []
    for cls in config_dataclasses():
        docs = field_docs(cls)
        missing += [f"{cls.__module__}.{cls.__qualname__}.{f.name}"
                    for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]
    missing += [f"LAYER_TYPES[{name!r}]" for name, spec in LAYER_TYPES.items()
                if not spec.doc.strip()]
    return missing


# ---- what each JSON object holds ----------------------------------------------------------


@dataclass(frozen=True)
class Clause:
    """One JSON object of a config file and the dataclass it becomes."""

    title: str
    path: str  # where it sits, e.g. "solver" or "layers[0].sparse[j]"
    cls: type
    intro: str = ""
    keys: dict[str, str | None] = field(default_factory=dict)  # field -> JSON key; None: hidden
    types: dict[str, str] = field(default_factory=dict)  # field -> JSON type, where it differs
    defaults: dict[str, str] = field(default_factory=dict)  # field -> default, where derived
    # JSON keys with no field of their own: (key, type, default, meaning)
    extra: tuple[tuple[str, str, str, str], ...] = ()


_HPARAM = "<type>_hparam"
_EMB_HPARAM = "sparse_embedding_hparam"

TRAINING_CLAUSES = (
    Clause("solver", "solver", schema.SolverConfig,
           "How training runs. Unknown keys are errors that list the known ones.",
           types={"gpu": "list of integers, or one list per host",
                  "eval_interval": 'integer or "epoch"',
                  "eval_metrics": "list of strings",
                  "early_stopping": "object", "lr_plateau": "object"},
           defaults={"batchsize_eval": "`batchsize`", "eval_metrics": '`["AUC"]`',
                     "gpu": "`[0]`",
                     "compute_dtype": '"float32" ("float16" with `mixed_precision`)'},
           extra=(("cuda_graph", "boolean", "true",
                   "Accepted for HugeCTR configs; no effect (XLA compiles the whole step)."),
                  ("max_eval_batches", "integer", "unset",
                   "HugeCTR 3.x's name of `eval_batches` (give one of the two, or "
                   "`max_eval_samples`)."),
                  ("max_eval_samples", "integer", "unset",
                   "HugeCTR 3.x: evaluation samples, truncated to whole `batchsize_eval` "
                   "batches."),
                  ("auc_threshold", "number", "unset",
                   "HugeCTR 3.x: stop once validation AUC reaches it (as `\"AUC:<t>\"` in "
                   "`eval_metrics`)."),
                  ("holistic_cuda_graph, algorithm_search, async_mlp_wgrad, enable_overlap, "
                   "device_layout, export_predictions_prefix", "as HugeCTR", "unset",
                   "HugeCTR 3.x GPU switches and a key its JSON training path does not use: "
                   "accepted, no effect."),
                  ("dense_opt_states_file, sparse_opt_states_file", "string", "unset",
                   "Refused: HugeCTR's optimizer state files are not read (resume from "
                   "jctr's checkpoints)."))),
    Clause("solver.early_stopping", "solver.early_stopping", schema.EarlyStoppingConfig,
           "jctr: Keras' EarlyStopping on a validation metric.",
           defaults={"metric": '"AUC" if listed, else the first of `eval_metrics`',
                     "mode": '"max" for AUC, else "min"'}),
    Clause("solver.lr_plateau", "solver.lr_plateau", schema.PlateauConfig,
           'jctr: Keras\' ReduceLROnPlateau, with `"lr_policy": "plateau"`.',
           defaults={"metric": '"AUC" if listed, else the first of `eval_metrics`',
                     "mode": '"max" for AUC, else "min"'}),
    Clause("solver.kafka_sink", "solver.kafka_sink", schema.KafkaSinkConfig,
           "jctr (HugeCTR's KafkaMessageSink): publish what training changes for serving to "
           "follow (docs/serving.md, \"Online updates\"); the streaming config's `kafka_sink` "
           "takes the same object.", types={"security": "object"}),
    Clause("optimizer", "optimizer", schema.OptimizerConfig,
           "The dense network's optimizer and every embedding's without its own. `type` and "
           "`update_type` sit in the object itself, the numbers in the hparam object of the "
           "type (`adam_hparam`, `momentum_sgd_hparam`, `nesterov_hparam`, `sgd_hparam`, "
           "`adagrad_hparam`); a hparam object of another type is an error.",
           keys={name: f"{_HPARAM}.{name}" for name in (
               "learning_rate", "beta1", "beta2", "epsilon", "momentum_factor",
               "initial_accu_value", "warmup_steps", "decay_start", "decay_steps",
               "decay_power", "end_lr")},
           types={"embed_sgd_param": "object", "embedx_sgd_param": "object"},
           defaults={"learning_rate": "0.001 (Adam), 0.01 (others)",
                     "embed_sgd_param": "the defaults below",
                     "embedx_sgd_param": "the defaults below"},
           extra=(("learning_rate", "boolean", "true",
                   "A flag of older HugeCTR configs in the optimizer object itself; no "
                   "effect."),
                  ("global_update", "boolean", "false", "Older HugeCTR flag; no effect."),
                  ("sgd_hparam.atomic_update", "boolean", "true",
                   "HugeCTR GPU detail; updates here are deterministic."))),
    Clause("SparseAdaGradSGDRule", "optimizer.embed_sgd_param, optimizer.embedx_sgd_param",
           schema.SparseSGDRule,
           'jctr (PaddlePaddle\'s rule): an embedding\'s own `"type": "SparseAdaGradSGDRule"` '
           "optimizer takes one object for the first dimension of each row "
           "(`embed_sgd_param`) and one for the others (`embedx_sgd_param`); the streaming "
           "config's `table_parameters` sets them for every table.",
           types={"weight_bounds": "[low, high]"},
           extra=(("name", "string", '"SparseAdaGradSGDRule"', "The only rule there is."),)),
    Clause("Data layer", "layers[0]", schema.DataConfig,
           'The first layer, `"type": "Data"`: where samples come from and how each sample '
           "splits into label, dense features and sparse inputs.",
           keys={"label_top": "label.top", "label_dim": "label.label_dim",
                 "dense_top": "dense.top", "dense_dim": "dense.dense_dim",
                 "test_sources": "test_source"},
           types={"source": "string or list of strings", "eval_source":
                  "string or list of strings", "sparse": "list of objects",
                  "test_sources": "string, list or object", "cache_eval_data":
                  "boolean or integer", "synthetic": "object"},
           defaults={"name": '"data"'}),
    Clause("Sparse inputs", "layers[0].sparse[j]", schema.SparseInputConfig,
           defaults={"max_nnz": "`max_feature_num_per_sample`"},
           extra=(("is_fixed_length", "boolean", "false",
                   "Accepted for HugeCTR configs; no effect (rows are padded to `max_nnz`)."),
                  ("nnz_per_slot", "integer or list of integers", "unset",
                   "HugeCTR 3.x, instead of `max_feature_num_per_sample` and `max_nnz`: the "
                   "most keys of each slot (one number for all); their sum bounds a sample, "
                   "the largest is `max_nnz`. `type` may then be left out."),)),
    Clause("Synthetic data", "layers[0].synthetic", schema.SyntheticConfig,
           "jctr: the dataset `python -m jctr.train` generates (Norm files and file lists at "
           "`source` and `eval_source`) when they do not exist yet."),
    Clause("Embedding layers", "layers[1..k]", schema.EmbeddingConfig,
           "One hash table over the slots of one sparse input, with dynamic insertion of "
           "64-bit keys. Embedding layers follow the Data layer and precede the dense layers.",
           keys={name: f"{_EMB_HPARAM}.{name}" for name in (
               "max_vocabulary_size_per_gpu", "embedding_vec_size", "combiner", "init_range",
               "replicated", "l2_lambda", "l1_lambda", "l2_rows", "growable", "slot_size_array")},
           types={"combiner": '0, 1, "sum" or "mean"', "optimizer": "object",
                  "slot_size_array": "list of integers", "eviction": "object"},
           defaults={"init_range": "1/sqrt(`embedding_vec_size`)",
                     "replicated": "the planner decides",
                     "max_vocabulary_size_per_gpu": "required unless "
                     "`workspace_size_per_gpu_in_mb` or `slot_size_array` sizes the table"},
           extra=((f"{_EMB_HPARAM}.load_factor", "integer", "1",
                   "Accepted for HugeCTR configs; no effect (capacity is exact)."),
                  (f"{_EMB_HPARAM}.workspace_size_per_gpu_in_mb", "integer", "unset",
                   "HugeCTR 3.x, instead of `max_vocabulary_size_per_gpu`: MB of float "
                   "vectors per device, rows = MB x 2^20 / (4 x `embedding_vec_size`)."))),
    Clause("Eviction", "layers[1..k].eviction", schema.EvictionConfig,
           "jctr: what a full table does instead of stopping with `TableFullError`: each new "
           "key of a step that finds no free row takes the row of a key the policy ranks "
           "lowest (its vector and optimizer rows start again); evictions are counted in the "
           "evaluation log line, `metrics.jsonl` and TensorBoard (`tables/<name>/evicted`)."),
    Clause("Dense layers", "layers[k+1..]", schema.LayerConfig,
           "The network after the embeddings; `bottom` names tops of earlier layers or of the "
           "Data layer. The last layer is the loss, whose second bottom is the label.",
           keys={"bottoms": "bottom", "tops": "top", "params": None, "path": None},
           types={"bottoms": "string or list", "tops": "string or list"}),
)

_MODEL_KEYS = {name: key for key, name in hps.MODEL_JSON_KEYS.items()}

SERVING_CLAUSES = (
    Clause("Top level", "(the file's object)", hps.ParameterServerConfig,
           "The JSON file `python -m jctr.serve --config` reads (HugeCTR's Triton "
           "parameter-server file).",
           keys={"source": None},
           types={"models": "list of objects", "volatile_db": "object",
                  "persistent_db": "object", "update_source": "object"}),
    Clause("models[i]", "models[i]", hps.InferenceParams,
           "One served model; the Python object is `InferenceParams` (its field name in "
           "parentheses where the JSON key differs). Relative paths are taken from the file's "
           "folder.",
           # fields the file sets elsewhere (the databases, supportlonglong) are hidden
           keys={f.name: _MODEL_KEYS.get(f.name) for f in dataclasses.fields(hps.InferenceParams)},
           types={"sparse_model_files": "list of strings"},
           defaults={"default_value_for_each_table": "0 per table",
                     "embedding_table_names": '"sparse_embedding1", ...'},
           extra=(("bundle", "string", "unset",
                   "jctr: an exported inference bundle folder; fills `network_file`, "
                   "`dense_file`, `sparse_files` and `non_trainable_file`."),)),
    Clause("volatile_db", "volatile_db", hps.VolatileDatabaseParams,
           types={"num_partitions": "integer"},
           defaults={"num_partitions": "min(cores, 16); Redis: 8",
                     "overflow_margin": "no limit (2^64 - 1)"}),
    Clause("persistent_db", "persistent_db", hps.PersistentDatabaseParams),
    Clause("update_source", "update_source", hps.UpdateSourceParams),
)

_SCALAR_TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}


def json_type(annotation: str) -> str:
    """A field annotation (a string, the modules use postponed annotations) in JSON words."""
    parts = [p.strip() for p in annotation.split("|") if p.strip() != "None"]
    words = []
    for part in parts:
        m = re.fullmatch(r"tuple\[(\w+), \.\.\.\]", part)
        if part in _SCALAR_TYPES:
            words.append(_SCALAR_TYPES[part])
        elif m and m.group(1) in _SCALAR_TYPES:
            words.append(f"list of {_SCALAR_TYPES[m.group(1)]}s")
        elif re.fullmatch(r"tuple\[int, int\]", part):
            words.append("list of 2 integers")
        elif re.fullmatch(r"tuple\[tuple\[int, int\], \.\.\.\]", part):
            words.append("list of [begin, end] pairs")
        else:
            words.append("object")
    return " or ".join(words)


def _default(f: dataclasses.Field, derived: dict[str, str]) -> str:
    if f.name in derived:
        return derived[f.name]
    if f.default is not dataclasses.MISSING:
        if f.default == () and str(f.type) == "tuple[tuple[str, str], ...]":  # a JSON object
            return "`{}`"
        return "unset" if f.default is None else f"`{json.dumps(f.default)}`"
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "defaults" if dataclasses.is_dataclass(value) else f"`{json.dumps(value)}`"
    return "required"


def _markdown(text: str) -> str:
    """A docstring as one Markdown table cell: reST literals become code spans."""
    text = " ".join(text.split()).replace("``", "`")
    return text.replace("|", "\\|")


def _without_key(doc: str, key: str) -> str:
    """A docstring that starts by naming where its field sits in JSON (``label.top``: ...)
    without that lead, which the key column already shows."""
    for lead in (key, key.rpartition(".")[0]):
        if lead:
            m = re.match(rf"``{re.escape(lead)}``( \(jctr\))?: ", doc)
            if m:
                rest = doc[m.end():]
                rest = rest[:1].upper() + rest[1:]
                return ("jctr: " if m.group(1) else "") + rest
    return doc


def clause_rows(clause: Clause) -> list[tuple[str, str, str, str]]:
    """(JSON key, type, default, meaning) for every key of one clause."""
    docs = field_docs(clause.cls)
    rows = []
    for f in dataclasses.fields(clause.cls):
        key = clause.keys.get(f.name, f.name)
        if key is None:
            continue
        if key != f.name and clause.cls is hps.InferenceParams:
            key = f"{key} ({f.name})"
        typ = clause.types.get(f.name) or json_type(f.type)
        rows.append((key, typ, _default(f, clause.defaults), _without_key(docs[f.name], key)))
    rows += [(key, typ, default, meaning) for key, typ, default, meaning in clause.extra]
    return rows


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_markdown(cell) for cell in row) + " |" for row in rows]
    return lines


def _clause_markdown(clause: Clause, level: str = "###") -> list[str]:
    out = [f"{level} {clause.title}", "", f"Path: `{clause.path}`."]
    if clause.intro:
        out[-1] += " " + clause.intro
    out += [""]
    rows = [(" ".join(f"`{k}`" if i == 0 else f"(`{k[1:-1]}`)"
                      for i, k in enumerate(key.split(" "))), typ, default, meaning)
            for key, typ, default, meaning in clause_rows(clause)]
    out += _table(("key", "type", "default", "meaning"), rows) + [""]
    return out


def _count(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo} to {hi}"


def _layer_markdown() -> list[str]:
    out = ["### Dense layer types", "",
           "Each type with the bottoms and tops it takes and what it computes.", ""]
    rows = []
    for name, spec in LAYER_TYPES.items():
        tops = ("one per range" if spec.tops is None else "2 or more" if spec.tops == -1
                else str(spec.tops))
        rows.append((f"`{name}`", _count(*spec.bottoms), tops, spec.doc))
    out += _table(("type", "bottoms", "tops", "computes"), rows) + [""]
    out += ["### Dense layer parameters", "",
            "The keys each type adds to its layer object (types not listed take none).", ""]
    rows = []
    seen = set()
    for spec in LAYER_TYPES.values():
        cls = spec.params
        if cls is NoParam or cls in seen:
            continue
        seen.add(cls)
        users = [n for n, s in LAYER_TYPES.items() if s.params is cls]
        nest = getattr(cls, "json_object", None)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            key = f.name.rstrip("_")
            key = f"{nest}.{key}" if nest else key
            default = _default(f, {"lambda_": "0.0 (1e-4 with `regularizer`)"}
                               if cls is layer_types.LossParam else {})
            doc = _without_key(docs[f.name], key)
            rows.append((", ".join(f"`{u}`" for u in users), f"`{key}`", json_type(f.type),
                         default, doc))
    out += _table(("types", "key", "type", "default", "meaning"), rows) + [""]
    return out


def config_reference_markdown() -> str:
    """The whole config reference as Markdown (the docs site's "Config reference" page body).

    Example::

        text = config_reference_markdown()
        assert "max_vocabulary_size_per_gpu" in text
    """
    out = ["## Training config", "",
           "A JSON object with `solver`, `optimizer` and `layers` (any order): the Data layer, "
           "then the embedding layers, then the dense layers ending in the loss. HugeCTR's "
           "keys keep their names, nesting and defaults; keys marked jctr are additions.", ""]
    for clause in TRAINING_CLAUSES:
        out += _clause_markdown(clause)
    out += _layer_markdown()
    out += ["## Parameter-server file", ""]
    for clause in SERVING_CLAUSES:
        out += _clause_markdown(clause)
    return "\n".join(out)


MARKER = "<!-- generated below by: python -m jctr.config.reference --write " \
    "docs/config-reference.md -->"


def page_with_reference(page: str, where: str = "the page") -> str:
    """``page`` (the docs page's Markdown) with everything below its marker line generated
    afresh."""
    if MARKER not in page:
        raise ValueError(f"{where}: the marker line {MARKER!r} is missing")
    return page[:page.index(MARKER) + len(MARKER)] + "\n\n" + config_reference_markdown() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jctr.config.reference",
                                 description="Regenerate (or check) the config reference page "
                                             "below its marker line.")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="PAGE", help="rewrite the page below the marker")
    mode.add_argument("--check", metavar="PAGE", help="exit 1 if the page is out of date")
    args = ap.parse_args(argv)
    path = args.write or args.check
    with open(path, encoding="utf-8") as f:
        page = f.read()
    try:
        fresh = page_with_reference(page, path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if fresh != page:
            print(f"{path} is out of date: run python -m jctr.config.reference --write {path}",
                  file=sys.stderr)
            return 1
        return 0
    if fresh != page:
        with open(path, "w", encoding="utf-8") as f:
            f.write(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
