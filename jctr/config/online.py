"""Streaming-training config (``python -m jctr.online --config online.yaml``): the model (a
jctr/HugeCTR training config it names) and PaddlePaddle's streaming keys, with their names.

Example (YAML; JSON works the same)::

    model: dlrm.json                 # training config: network, optimizer, validation set
    train_data_dir: data/stream      # <train_data_dir>/<YYYYMMDD>/<HHMM>/ folders
    split_interval: 5                # minutes per folder
    split_per_pass: 2                # folders per pass
    start_day: "20190720"
    end_day: "20190721"
    data_donefile: to.hadoop.done    # a folder is complete once this file is in it
    data_sleep_second: 30
    prefetch: true                   # read the next pass while this one trains
    save_model_path: runs/online     # <save_model_path>/<day>/<pass>/ checkpoints
    checkpoint_per_pass: 1
    save_delta_frequency: 2          # <day>/delta-<pass>/ inference deltas every 2 passes
    table_parameters:
      delete_after_unseen_days: 7
      base_threshold: 0.5
      embedx_sgd_param: {learning_rate: 0.05}

Relative paths are taken from the config file's folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from jctr.config.parser import parse_sparse_sgd_rule
from jctr.config.reader import ConfigError, ObjectReader, json_from_text, yaml_from_text
from jctr.config.schema import SparseSGDRule, column_ref


@dataclass(frozen=True)
class ShowClickEntry:
    """Where a sample's show and click come from (PaddlePaddle's ``ShowClickEntry``): a
    number (the same for every sample) or a column of the sample, ``"label[i]"`` or
    ``"dense[i]"``. Each key of the sample gets them."""

    show: float | str = 1.0
    """A sample's shows: 1 (the default), or a column such as ``"dense[0]"``."""
    click: float | str = "label[0]"
    """A sample's clicks: the first label column (default), or another column."""


@dataclass(frozen=True)
class TableParameters:
    """Per-key show/click statistics and the shrink at the end of each day (PaddlePaddle's
    ``table_parameters`` accessor keys and defaults). A sample is one show of each of its
    keys and a click when its label is 1."""

    click_coeff: float = 1.0
    """Score weight of a click: ``score = click_coeff * click + nonclk_coeff * (show -
    click)``."""
    nonclk_coeff: float = 0.1
    """Score weight of a show that was not clicked."""
    show_click_decay_rate: float = 1.0
    """At each day's shrink, show and click are multiplied by this (in [0, 1])."""
    delete_threshold: float = 0.0
    """At each day's shrink, keys whose score is below this are deleted (rows freed)."""
    delete_after_unseen_days: int = 30
    """At each day's shrink, keys unseen for more than this many days are deleted."""
    show_click_entry: ShowClickEntry = field(default_factory=ShowClickEntry)
    """Which inputs are a sample's show and click (object below)."""
    embedx_threshold: float = 0.0
    """Admission: above 0 a new key's row trains its first dimension only until its score
    (counted by the table as it trains) reaches this; then its other ``embedx_dim``
    dimensions get their initial values and train too. Needs (and turns on)
    ``SparseAdaGradSGDRule``."""
    embedx_dim: int | None = None
    """PaddlePaddle's ``embedx_dim``: the embedding size minus 1 (checked against the model
    when given)."""
    fea_dim: int | None = None
    """PaddlePaddle's ``fea_dim``: ``embedx_dim + 3`` (show, click, first dimension; checked
    when given)."""
    base_threshold: float = 0.0
    """A day's base model holds the keys whose score is at least this."""
    delta_threshold: float = 0.0
    """A delta model holds the keys seen since the previous delta (or base) whose score is at
    least this ..."""
    delta_keep_days: int = 16
    """... and that were unseen for at most this many days."""
    converter: str = ""
    """``package.module:function`` called as ``function(path, kind, day, pass_id)`` after each
    base (``kind`` "base", ``pass_id`` None) or delta model is written, e.g. to copy it into an
    online key-value store; an exception stops the run (it resumes at the pass)."""
    embed_sgd_param: SparseSGDRule | None = None
    """With this, ``embedx_sgd_param`` or ``embedx_threshold`` every embedding trains with
    ``SparseAdaGradSGDRule``: this object for the first dimension of each row (default: the
    rule's defaults; absent all three: the model's own optimizers)."""
    embedx_sgd_param: SparseSGDRule | None = None
    """The rule for the other dimensions of each row."""


@dataclass(frozen=True)
class OnlineConfig:
    """A parsed streaming-training config (see the module docstring)."""

    model: str
    """The training config (JSON) of the model: its network, optimizer, solver and Data layer
    (format and shapes; its ``source`` is replaced by each pass's files, its ``eval_source``
    is the validation set scored after every pass)."""
    train_data_dir: str
    """The folder holding ``<YYYYMMDD>/<HHMM>/`` data folders."""
    split_interval: int
    """Minutes of data per folder (``HHMM`` steps by this; it must divide a day)."""
    split_per_pass: int
    """Folders per pass."""
    start_day: str
    """The first day, ``YYYYMMDD``."""
    end_day: str
    """The last day, ``YYYYMMDD`` (included)."""
    save_model_path: str
    """Checkpoints go to ``<save_model_path>/<day>/<pass>/``; ``progress.json`` there names
    the last one (a stopped run resumes at the pass after it)."""
    is_data_hourly_placed: bool = False
    """Paddle's hourly layout: data folders are ``<YYYYMMDD>/<HH>/`` (``split_interval`` a
    multiple of 60) instead of ``<YYYYMMDD>/<HHMM>/``."""
    data_donefile: str = ""
    """A folder is read once this file exists in it (empty: at once)."""
    data_sleep_second: float = 30.0
    """Seconds between two looks for a missing done-file."""
    prefetch: bool = True
    """Read the next pass's files into memory while the current pass trains (it waits for
    their done-files in the background too)."""
    checkpoint_per_pass: int = 1
    """A checkpoint every this many passes; after a day's last pass and its shrink the batch
    model ``<save_model_path>/<next day>/0/`` is the checkpoint."""
    checkpoint_keep_days: int = 0
    """0 (the default, PaddlePaddle's way): every checkpoint stays. N: at each day's end the
    pass checkpoints and batch models of days more than N days before the new batch model's
    are removed (base and delta models stay, and so does the checkpoint a run would resume
    from): a run that lives for months keeps a bounded disk."""
    model_keep_days: int = 0
    """0 (the default, PaddlePaddle's way): every base and delta model stays. N: at each
    day's end the base and delta models of days more than N days before the new base model's
    are removed (with N = 1, those before the day that just ended: a server still on that
    day's chain keeps it until it takes the new base)."""
    save_delta_frequency: int = 0
    """An inference delta model ``<save_model_path>/<day>/delta-<pass>/`` every this many
    passes (0: none). The base model ``<next day>/base/`` is written after every day's
    shrink."""
    kafka_sink: dict | None = None
    """Online updates for serving (the training config's ``solver.kafka_sink`` object:
    ``model_name``, ``brokers``, ``send_buffer_size``, ...): the rows each pass changed and
    the dense weights are published after every pass (``every_n_steps`` adds more)."""
    sparse_store: str | None = None
    """A folder for a database holding every embedding row (the file's ``sparse_store:
    {type: rocks_db | row_file, path: ...}``): tables larger than memory. Each pass pulls
    the rows of its keys (and the validation set's) into the device table, trains, and writes
    them back; ``max_vocabulary_size_per_gpu`` then only needs to hold one pass's keys.
    Needs ``checkpoint_per_pass: 1``; with several processes each keeps its part of the keys
    in ``<path>/process-<i>-of-<n>``."""
    sparse_store_type: str = "rocks_db"
    """``rocks_db`` (the default): a RocksDB database. ``row_file``: the rows in plain
    memory-mapped files, one folder per table, read and written at memory speed while they
    fit the page cache (:mod:`jctr.stores.row_file`)."""
    table_parameters: TableParameters = field(default_factory=TableParameters)
    """Feature statistics and the daily shrink, for every embedding table (object below)."""
    source: str | None = None
    """Not in the file: where the config came from."""


def parse_online_config(raw: Any, source: str | None = None) -> OnlineConfig:
    """Parse an already-loaded streaming config; relative paths from ``source``'s folder."""
    r = ObjectReader(raw, "", source)
    base = os.path.dirname(os.path.abspath(source)) if source else os.getcwd()

    def path(key: str) -> str:
        value = r.str(key)
        if not value:
            raise r.error(key, "expected a non-empty path")
        return os.path.normpath(os.path.join(base, value))

    def day(key: str) -> str:
        value = r.raw(key)
        text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) \
            else ""
        if len(text) != 8 or not text.isdigit():
            raise r.error(key, f"expected a day as \"YYYYMMDD\", got {value!r}")
        return text

    store, store_type = _sparse_store(r, base)
    cfg = OnlineConfig(
        model=path("model"), train_data_dir=path("train_data_dir"),
        split_interval=r.int("split_interval", min_value=1),
        split_per_pass=r.int("split_per_pass", min_value=1),
        start_day=day("start_day"), end_day=day("end_day"),
        save_model_path=path("save_model_path"),
        is_data_hourly_placed=r.bool("is_data_hourly_placed", False),
        data_donefile=r.str("data_donefile", ""),
        data_sleep_second=r.float("data_sleep_second", 30.0, min_value=0.0),
        prefetch=r.bool("prefetch", True),
        checkpoint_per_pass=r.int("checkpoint_per_pass", 1, min_value=1),
        checkpoint_keep_days=r.int("checkpoint_keep_days", 0, min_value=0),
        model_keep_days=r.int("model_keep_days", 0, min_value=0),
        save_delta_frequency=r.int("save_delta_frequency", 0, min_value=0),
        kafka_sink=_kafka_sink(r),
        sparse_store=store, sparse_store_type=store_type,
        table_parameters=_table_parameters(r), source=source)
    for key, why in _NOT_BUILT.items():
        if r.has(key):
            raise r.error(key, why)
    if cfg.sparse_store and cfg.checkpoint_per_pass != 1:
        raise r.error("checkpoint_per_pass", f"{cfg.checkpoint_per_pass}, but with "
                      "sparse_store every pass is checkpointed (the database is written after "
                      "each pass, and a run resumes from the checkpoint it matches): use 1")
    r.finish()
    return cfg


# PaddlePaddle streaming settings jctr refuses, with the reason (not silently ignored)
_NOT_BUILT = {
    "global_shuffle": "not supported: each process reads a disjoint share of a pass's files "
                      "and shuffles it (the model's Data layer \"shuffle\"); records do not "
                      "move between processes, as Paddle's dataset.global_shuffle moves them",
    "dump_fields": "not supported: jctr does not dump intermediate layers per sample; score a "
                   "pass's files with Trainer.predict, or export the model and serve it",
    "dump_fields_path": "not supported (see dump_fields)",
    "dump_param": "not supported: the base and delta models hold every saved parameter "
                  "(jctr.serving.bundle), and checkpoints the whole state",
}


def _kafka_sink(r: ObjectReader) -> dict | None:
    """Checked as the training config's ``solver.kafka_sink``; kept as its JSON object (the
    runner puts it into the model's solver)."""
    if not r.has("kafka_sink"):
        return None
    from jctr.config.parser import parse_kafka_sink

    child = r.child("kafka_sink")
    parse_kafka_sink(ObjectReader(child.obj, child.path, child.source))
    return dict(child.obj)


def _sparse_store(r: ObjectReader, base: str) -> tuple[str | None, str]:
    if not r.has("sparse_store"):
        return None, "rocks_db"
    t = r.child("sparse_store")
    kind = t.choice("type", ("rocks_db", "row_file"), "rocks_db")
    path = t.str("path")
    if not path:
        raise t.error("path", "expected a folder for the database")
    t.finish()
    return os.path.normpath(os.path.join(base, path)), kind


def _table_parameters(r: ObjectReader) -> TableParameters:
    if not r.has("table_parameters"):
        return TableParameters()
    t = r.child("table_parameters")
    if t.has("deconverter"):
        raise t.error("deconverter", "jctr's base and delta models are plain files (nothing "
                      "to unpack); leave it out")
    converter = t.str("converter", "")
    if converter and (converter.count(":") != 1 or not all(converter.split(":"))):
        raise t.error("converter", f'expected "package.module:function", got {converter!r}')
    rules = {key: parse_sparse_sgd_rule(t.child(key)) if t.has(key) else None
             for key in ("embed_sgd_param", "embedx_sgd_param")}
    embedx_threshold = t.float("embedx_threshold", 0.0, min_value=0.0)
    if any(rules.values()) or embedx_threshold > 0:
        rules = {k: v or SparseSGDRule() for k, v in rules.items()}
    entry = ShowClickEntry()
    if t.has("show_click_entry"):
        e = t.child("show_click_entry")
        entry = ShowClickEntry(show=_entry_source(e, "show", 1.0),
                               click=_entry_source(e, "click", "label[0]"))
        e.finish()
    out = TableParameters(
        show_click_entry=entry,
        # negative weights would make clicked keys score below unclicked ones (and the
        # shrink delete them)
        click_coeff=t.float("click_coeff", 1.0, min_value=0.0),
        nonclk_coeff=t.float("nonclk_coeff", 0.1, min_value=0.0),
        show_click_decay_rate=t.float("show_click_decay_rate", 1.0, min_value=0.0),
        delete_threshold=t.float("delete_threshold", 0.0),
        delete_after_unseen_days=t.int("delete_after_unseen_days", 30, min_value=1),
        embedx_threshold=embedx_threshold,
        embedx_dim=t.int("embedx_dim", None, min_value=0),
        fea_dim=t.int("fea_dim", None, min_value=3),
        base_threshold=t.float("base_threshold", 0.0),
        delta_threshold=t.float("delta_threshold", 0.0),
        delta_keep_days=t.int("delta_keep_days", 16, min_value=0),
        converter=converter, **rules)
    if out.show_click_decay_rate > 1.0:
        raise t.error("show_click_decay_rate", "expected a number in [0, 1], got "
                      f"{out.show_click_decay_rate}")
    t.finish()
    return out


def _entry_source(r: ObjectReader, key: str, default: float | str) -> float | str:
    value = r.raw(key, default)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    if column_ref(value) is not None:
        return value
    raise r.error(key, f'expected a number >= 0, "label[i]" or "dense[i]", got {value!r}')


def load_online_config(path: str | os.PathLike) -> OnlineConfig:
    """Read a streaming config from a YAML or JSON file."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError("<file>", f"cannot read streaming config: {e.strerror}",
                          source) from e
    if source.endswith(".json"):
        raw = json_from_text(text, source)
    else:
        raw = yaml_from_text(text, source)
    return parse_online_config(raw, source)
