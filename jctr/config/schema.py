"""Typed configuration: the solver, optimizer and layers clauses of a HugeCTR JSON config.

Field names, nesting and defaults follow HugeCTR's JSON format; jctr extensions are marked.
Parse with :func:`jctr.config.load_config`; nothing downstream reads raw JSON.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from jctr.config.layer_types import LOSS_TYPES, NoParam

_COLUMN = re.compile(r"(label|dense)\[(\d+)\]")


def column_ref(text: object) -> tuple[str, int] | None:
    """``("label" | "dense", index)`` of a sample column named like ``"dense[0]"`` (streaming
    training's show and click sources); None for anything else."""
    m = _COLUMN.fullmatch(text) if isinstance(text, str) else None
    return (m.group(1), int(m.group(2))) if m else None

OPTIMIZER_TYPES = ("Adam", "MomentumSGD", "Nesterov", "SGD", "AdaGrad", "SparseAdaGradSGDRule")
# row-only optimizers: an embedding's own optimizer clause, never the dense network's
ROW_ONLY_OPTIMIZERS = ("SparseAdaGradSGDRule",)
UPDATE_TYPES = ("Local", "Global", "LazyGlobal")
EMBEDDING_TYPES = (
    "DistributedSlotSparseEmbeddingHash",
    "LocalizedSlotSparseEmbeddingHash",
    "LocalizedSlotSparseEmbeddingOneHot",
)
SPARSE_INPUT_TYPES = ("DistributedSlot", "LocalizedSlot")
DATA_FORMATS = ("Norm", "Raw", "Parquet", "FeatureSpec")
MIXED_PRECISION_SCALERS = (128, 256, 512, 1024)
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
# what a non-finite training loss does: stop the run (nothing of the bad state is saved), or
# skip the batch (no update from it) and go on
NAN_POLICIES = ("stop", "skip")


@dataclass(frozen=True)
class SparseSGDRule:
    """PaddlePaddle's ``SparseAdaGradSGDRule`` for one part of an embedding row (the first
    dimension, ``embed_sgd_param``, or the rest, ``embedx_sgd_param``): per row one
    squared-gradient sum ``g2sum`` (the mean over the part's dimensions); a step moves each
    weight by ``learning_rate * sqrt(initial_g2sum / (initial_g2sum + g2sum)) * g`` with ``g``
    the key's gradient divided by its occurrences in the batch, then clips it to
    ``weight_bounds``."""

    learning_rate: float = 0.05
    """The rate before the adaptive factor."""
    initial_g2sum: float = 3.0
    """Stands for the squared gradients seen before the first step."""
    initial_range: float = 1e-4
    """A new row's weights start uniform in ``[-initial_range, initial_range]``."""
    weight_bounds: tuple[float, float] = (-10.0, 10.0)
    """Weights are clipped to ``[low, high]`` after each step."""


@dataclass(frozen=True)
class OptimizerConfig:
    """One optimizer clause (the global one or an embedding's own).

    Example::

        OptimizerConfig(type="Adam", learning_rate=1e-3)
    """

    type: str = "Adam"
    """One of ``Adam``, ``MomentumSGD``, ``Nesterov``, ``SGD``, ``AdaGrad``; its numbers go in
    the matching ``adam_hparam``, ``momentum_sgd_hparam``, ``nesterov_hparam``, ``sgd_hparam``
    or ``adagrad_hparam`` object. An embedding's own clause may also be
    ``SparseAdaGradSGDRule`` (jctr, from PaddlePaddle) with ``embed_sgd_param`` and
    ``embedx_sgd_param`` objects."""
    update_type: str = "Local"
    """Embedding rows: ``Local`` updates the rows a batch touches; ``Global`` every row (a dense
    pass over the table, as HugeCTR); ``LazyGlobal`` touched rows after applying the moment
    decay of the steps each row missed. The dense network always updates every weight."""
    learning_rate: float = 0.001
    """The base learning rate (0.001 for Adam, 0.01 for the others when the hparam object is
    absent or omits it)."""
    beta1: float = 0.9
    """Adam: decay of the first moment."""
    beta2: float = 0.999
    """Adam: decay of the second moment."""
    epsilon: float = 1e-7
    """Adam and AdaGrad: added to the denominator (HugeCTR's 1e-7; PyTorch uses 1e-8)."""
    momentum_factor: float = 0.0
    """MomentumSGD and Nesterov: the momentum coefficient."""
    initial_accu_value: float = 0.0
    """AdaGrad: the starting value of the squared-gradient accumulator."""
    # Learning-rate schedule (HugeCTR's sgd_hparam; jctr accepts it in every hparam clause).
    warmup_steps: int = 0
    """Schedule: the rate rises linearly from 0 over this many iterations."""
    decay_start: int = 0
    """Schedule: the iteration where polynomial decay starts (0: no decay)."""
    decay_steps: int = 0
    """Schedule: iterations the decay takes to reach ``end_lr``; required with
    ``decay_start``."""
    decay_power: float = 2.0
    """Schedule: the exponent of the polynomial decay."""
    end_lr: float = 0.0
    """Schedule: the rate at the end of the decay, kept afterwards."""
    embed_sgd_param: SparseSGDRule | None = None
    """SparseAdaGradSGDRule: the rule of each row's first dimension (object below)."""
    embedx_sgd_param: SparseSGDRule | None = None
    """SparseAdaGradSGDRule: the rule of each row's other dimensions (object below)."""
    embedx_threshold: float = 0.0
    """SparseAdaGradSGDRule (PaddlePaddle's admission): above 0 a new key's row has its first
    dimension only (the others stay 0 and untrained) until its score ``click_coeff * click +
    nonclk_coeff * (show - click)``, counted by the table as it trains, reaches this; then
    the others get their initial values and train too."""
    click_coeff: float = 1.0
    """SparseAdaGradSGDRule admission: the score's weight of a click."""
    nonclk_coeff: float = 0.1
    """SparseAdaGradSGDRule admission: the score's weight of a show without a click."""
    show: str | None = None
    """SparseAdaGradSGDRule (jctr extension, set by streaming training's
    ``show_click_entry``): ``"dense[i]"`` or ``"label[i]"``, the column holding each sample's
    show; a row's gradient is divided by the shows its key was pushed with, as PaddlePaddle's
    accessor divides by ``push_show``. Unset: one show per occurrence."""


@dataclass(frozen=True)
class Metric:
    name: str
    """``AUC``, ``AverageLoss`` (the loss layer's mean) or ``LogLoss`` (binary log loss)."""
    threshold: float | None = None
    """AUC only: training stops once validation AUC reaches it (``"AUC:0.8025"``)."""


METRIC_MODES = ("max", "min")


def default_mode(metric: str) -> str:
    """Whether a larger value of an evaluation metric is better: AUC yes, losses no."""
    return "max" if metric == "AUC" else "min"


@dataclass(frozen=True)
class KafkaSinkConfig:
    """jctr extension ``solver.kafka_sink`` (HugeCTR's ``KafkaMessageSink``): publish the
    embedding rows training updated, and the dense weights, to Kafka for serving models to
    follow (``update_source`` in the parameter-server file)."""

    model_name: str
    """The served model's name: topics are ``hps_et.<model_name>.<embedding>`` and
    ``hps_dense.<model_name>``."""
    brokers: str = "127.0.0.1:9092"
    """The brokers, ``host:port`` separated by ``;`` or ``,``."""
    send_buffer_size: int = 262144
    """The largest message in bytes (rows are split to fit)."""
    every_n_steps: int = 0
    """Publish every this many iterations, and at the end of training (0: at the end only;
    streaming training: after every pass)."""
    max_buffered_mb: int = 64
    """Messages wait in a buffer of this size while the broker is slow or away; beyond it
    they are dropped and counted (a training step never waits for the broker)."""
    security: tuple[tuple[str, str], ...] = ()
    """Authentication and encryption: an object of librdkafka's ``security.protocol``,
    ``sasl.*`` and ``ssl.*`` settings, passed to the client as given."""


@dataclass(frozen=True)
class EarlyStoppingConfig:
    """jctr extension ``solver.early_stopping``: stop when the validation ``metric`` has not
    improved by more than ``min_delta`` for ``patience`` evaluations in a row, and (with
    ``restore_best_weights``) go back to the weights, tables and optimizer state of the best
    evaluation before the final evaluation and any export (Keras' EarlyStopping, FuxiCTR's
    early stop).

    Example::

        EarlyStoppingConfig(metric="AUC", patience=2)
    """

    metric: str = "AUC"
    """The validation metric watched: one of ``solver.eval_metrics`` (default AUC if listed,
    else the first)."""
    mode: str = "max"
    """``max``: larger is better; ``min``: smaller is better (default: ``max`` for AUC,
    ``min`` for the losses)."""
    patience: int = 2
    """Evaluations without improvement before training stops."""
    min_delta: float = 0.0
    """The smallest change that counts as an improvement."""
    restore_best_weights: bool = True
    """Go back to the best evaluation's weights, tables and optimizer state at the end."""
    min_delta_mode: str = "absolute"
    """``absolute``: an improvement beats the best by more than ``min_delta``; ``relative``:
    by more than ``min_delta`` times the best's magnitude (0.001: a 0.1% better value)."""
    start_from_epoch: int = 0
    """Epochs of warm-up: evaluations in (or at the end of) the first this many epochs neither
    count against ``patience`` nor become the best (Keras' ``start_from_epoch``): the first
    epochs' noisy validation cannot stop a run."""
    restart_after_lr_drop: bool = False
    """With ``lr_policy: "plateau"``: an evaluation that lowered the learning rate starts the
    patience count again, so the lower rate gets ``patience`` evaluations of its own
    (FuxiCTR's reduce-then-stop)."""


@dataclass(frozen=True)
class PlateauConfig:
    """jctr extension ``solver.lr_plateau`` (with ``lr_policy: "plateau"``): after ``patience``
    evaluations without an improvement of the validation ``metric`` by more than
    ``min_delta``, every learning rate is multiplied by ``factor``, never taking the solver
    optimizer's rate below ``min_lr`` (Keras' ReduceLROnPlateau). The factor is training state:
    the step is not compiled again.

    Example::

        PlateauConfig(factor=0.1, patience=1, min_lr=1e-6)
    """

    metric: str = "AUC"
    """The validation metric watched: one of ``solver.eval_metrics`` (default AUC if listed,
    else the first)."""
    mode: str = "max"
    """``max``: larger is better; ``min``: smaller is better (default by metric, as for early
    stopping)."""
    factor: float = 0.1
    """Every learning rate is multiplied by this (between 0 and 1) on a plateau."""
    patience: int = 1
    """Evaluations without improvement before the rates drop."""
    min_delta: float = 0.0
    """The smallest change that counts as an improvement."""
    min_delta_mode: str = "absolute"
    """``absolute`` or ``relative`` (``min_delta`` times the best's magnitude), as for early
    stopping."""
    min_lr: float = 0.0
    """The solver optimizer's rate never drops below this."""


@dataclass(frozen=True)
class SolverConfig:
    """The solver clause. ``max_iter`` or ``num_epochs`` must be set before training."""

    lr_policy: str = "fixed"
    """``fixed``: the optimizer's rate with its warm-up and decay schedule; ``plateau`` (jctr):
    also lowered when validation stops improving (``lr_plateau``)."""
    display: int = 200
    """Print (and log) loss and throughput every this many iterations."""
    max_iter: int | None = None
    """Training iterations; exclusive with ``num_epochs`` (one of the two is required)."""
    num_epochs: int | None = None
    """Passes over the training file list; exclusive with ``max_iter``."""
    gpu: tuple[tuple[int, ...], ...] = ((0,),)
    """Devices: ``[0, 1, 2, 3]`` on one host, ``[[0, 1], [0, 1]]`` one list per host (several
    processes through ``jax.distributed``)."""
    batchsize: int = 2048
    """The global training batch, split over the devices (a multiple of their count)."""
    batchsize_eval: int = 2048
    """The evaluation batch (default: ``batchsize``)."""
    snapshot: int = 0
    """Save a checkpoint every this many iterations (0: never)."""
    snapshot_prefix: str = "./"
    """Checkpoints go to the folder ``<snapshot_prefix>checkpoints``."""
    eval_interval: int | str = 1000
    """Evaluate every this many iterations, or ``"epoch"`` (jctr): after every epoch."""
    eval_batches: int | None = None
    """Batches per evaluation; unset: the whole evaluation set (HugeCTR's default of 100
    batches truncated larger sets)."""
    dense_model_file: str | None = None
    """Start from these dense weights (a HugeCTR dense model file); the JSON key may also be
    ``"dense model_file"``."""
    sparse_model_file: tuple[str, ...] = ()
    """Start from these sparse model folders, one per embedding in order."""
    mixed_precision: int | None = None
    """Loss-scaling factor (128, 256, 512 or 1024) for float16 compute; implies
    ``compute_dtype`` float16."""
    enable_tf32_compute: bool = False
    """Matmuls at JAX's ``tensorfloat32`` precision (faster on GPUs that have it)."""
    eval_metrics: tuple[Metric, ...] = (Metric("AUC"),)
    """A list of ``"AUC"``, ``"AUC:<threshold>"`` (stop once reached), ``"AverageLoss"``,
    ``"LogLoss"``."""
    input_key_type: str = "I32"
    """The key width of Norm data files: ``I32`` (uint32) or ``I64`` (int64)."""
    # jctr extensions
    compute_dtype: str = "float32"
    """jctr: the dense network's compute type, ``float32``, ``bfloat16`` or ``float16``
    (default ``float16`` with ``mixed_precision``). Weights and tables stay float32."""
    seed: int = 0
    """jctr: seeds initialization, dropout, shuffling and new embedding rows."""
    log_dir: str | None = None
    """jctr: folder for ``metrics.jsonl``, TensorBoard event files and ``report.html``."""
    paths_relative_to: str = "working_dir"
    """jctr: what relative data, model-file, snapshot and log paths start from:
    ``working_dir`` (HugeCTR's way) or ``config``, the config file's folder (the configs
    ``from_csv`` writes: they run from any folder)."""
    snapshot_keep: int = 3
    """jctr: checkpoints kept (the oldest are deleted first)."""
    replicate_table_bytes: int = 0
    """jctr: on several devices, tables of at most this many bytes get a copy on every
    device."""
    all2all_capacity_factor: float = 2.0
    """jctr: each all-to-all send buffer holds this times keys / devices per destination; a
    batch that does not fit takes a step compiled with full buffers (0: always full)."""
    nan_policy: str = "stop"
    """jctr: on a non-finite training loss, ``stop`` the run (nothing of the bad state is
    saved) or ``skip`` the batch (no update from it)."""
    early_stopping: EarlyStoppingConfig | None = None
    """jctr: stop when validation stops improving (object below; absent: never)."""
    kafka_sink: KafkaSinkConfig | None = None
    """jctr: publish updates for online serving (object below; absent: none)."""
    lr_plateau: PlateauConfig | None = None
    """jctr: how ``lr_policy`` ``plateau`` lowers the rates (object below; set exactly when
    ``lr_policy`` is ``plateau``)."""

    @property
    def checkpoint_dir(self) -> str:
        """Where snapshots go: ``<snapshot_prefix>checkpoints``."""
        return f"{self.snapshot_prefix}checkpoints"

    @property
    def eval_every_epoch(self) -> bool:
        return self.eval_interval == "epoch"

    @property
    def auc_threshold(self) -> float | None:
        for m in self.eval_metrics:
            if m.name == "AUC":
                return m.threshold
        return None


@dataclass(frozen=True)
class SparseInputConfig:
    """One sparse input of the Data layer (``layers[0].sparse[j]``): a group of slots that one
    embedding layer reads."""

    top: str
    """The name embedding layers use as their ``bottom``."""
    type: str
    """``DistributedSlot`` or ``LocalizedSlot`` (HugeCTR's names; placement follows the
    embedding layer's type)."""
    max_feature_num_per_sample: int
    """The most keys one sample holds over all slots of this input."""
    slot_num: int
    """Slots (categorical features) in this input."""
    max_nnz: int
    """The most keys one slot of a sample holds (default ``max_feature_num_per_sample``);
    1 makes the input one-hot (a plain gather)."""

    @property
    def one_hot(self) -> bool:
        """Every slot holds at most one key: the bag is a plain gather."""
        return self.max_nnz == 1

    @property
    def key_positions(self) -> int:
        """Key positions per sample in a batch: one per slot when one-hot, else
        ``max_feature_num_per_sample`` (the most keys of a sample over all its slots)."""
        return self.slot_num if self.one_hot else self.max_feature_num_per_sample


@dataclass(frozen=True)
class SyntheticConfig:
    """jctr extension of the Data layer: generate a power-law dataset when ``source`` is absent.

    Keys of slot ``s`` follow a truncated power law with exponent ``alpha`` over
    ``slot_size_array[s]`` distinct keys (or ``vocabulary_size`` for every slot); labels carry a
    planted signal so that a model can learn something measurable.
    """

    num_samples: int
    """Training samples to generate."""
    eval_num_samples: int
    """Evaluation samples to generate."""
    vocabulary_size: int = 100_000
    """Distinct keys per slot when the Data layer has no ``slot_size_array``."""
    alpha: float = 1.2
    """The power-law exponent: larger concentrates the keys on fewer hot ones."""
    num_files: int = 4
    """Training data files (the evaluation set is one file)."""
    seed: int = 0
    """Seeds keys, dense values and labels."""
    signal: float = 1.0
    """Strength of the planted label signal (0: labels are noise)."""


@dataclass(frozen=True)
class DataConfig:
    """The Data layer: where samples come from and how they are split into inputs."""

    name: str
    """The layer's name (default ``data``)."""
    source: str
    """Training data: a file list (Norm, Parquet), a Raw file or a feature-spec YAML; a list
    of several is read in turn."""
    eval_source: str
    """Validation data, in the same format; scored with ``solver.eval_metrics``."""
    label_top: str
    """``label.top``: the name of the label tensor (the loss layer's second bottom)."""
    label_dim: int
    """``label.label_dim``: labels per sample (1 for CTR)."""
    dense_top: str
    """``dense.top``: the name of the dense-feature tensor."""
    dense_dim: int
    """``dense.dense_dim``: dense features per sample (0: none)."""
    sparse: tuple[SparseInputConfig, ...]
    """The sparse inputs (objects below), in the order of their slots in the data."""
    format: str = "Norm"
    """``Norm``, ``Raw``, ``Parquet`` or ``FeatureSpec`` (jctr: the Dataset Feature
    Specification YAML)."""
    check: str = "None"
    """Norm only: ``Sum`` when every chunk carries a byte-sum check, else ``None``."""
    num_samples: int | None = None
    """Raw: training records in the file (required, the file has no header)."""
    eval_num_samples: int | None = None
    """Raw: evaluation records in the file (required)."""
    slot_size_array: tuple[int, ...] = ()
    """Keys per slot (one entry per slot); required for Raw and Parquet, whose keys are
    per-slot ids that jctr offsets into one table."""
    float_label_dense: bool = False
    """Raw: labels and dense values are float32 (else int32, dense taken as log(x + 1))."""
    cache_eval_data: int = 0
    """``true`` or a batch count: keep the parsed evaluation set in memory between
    evaluations (each file while the machine has room for it beside the training step; the
    rest is read from disk, with a line saying so)."""
    synthetic: SyntheticConfig | None = None
    """jctr: generate a power-law dataset where ``source`` / ``eval_source`` do not exist yet
    (object below)."""
    shuffle: bool = False
    """jctr: permute the file (unit) and record order every epoch, seeded (a file's records
    and their permuted copy are held in memory: a Norm or Raw file too large for that beside
    the training step is refused before the first step)."""
    test_sources: tuple[tuple[str, str], ...] = ()
    """jctr, JSON key ``test_source``: a source, a list, or an object of name -> source; each
    test set is scored after training like ``eval_source`` and reported apart (never used to
    stop or tune)."""

    @property
    def total_slots(self) -> int:
        return sum(s.slot_num for s in self.sparse)

    def sparse_input(self, top: str) -> SparseInputConfig:
        for s in self.sparse:
            if s.top == top:
                return s
        raise KeyError(top)


EVICTION_POLICIES = ("lru", "lfu", "epoch_lru", "epoch_lfu", "score")
SPILL_TYPES = ("rocks_db", "row_file")


@dataclass(frozen=True)
class EvictionConfig:
    """An embedding layer's ``eviction`` object (jctr; NVIDIA HierarchicalKV's policies): a
    full table gives a new key the row of a key it ranks lowest instead of refusing it. The
    ranking uses the table's own clock (one tick per training step): ``lru`` the step a row
    was last touched, ``lfu`` how often it was touched (ties: least recently), ``epoch_lru``
    and ``epoch_lfu`` first the epoch (``epoch_steps`` steps) of its last touch, then its
    last step or its touches within that epoch; ``score`` the caller's scores (HierarchicalKV's
    customized strategy): ``score_fn`` gives every key a step assigns its score, the lowest
    score goes first (ties: least recently). Rows the step touches are never taken."""

    policy: str
    """``"lru"``, ``"lfu"``, ``"epoch_lru"``, ``"epoch_lfu"`` or ``"score"`` (the caller's
    scores, from ``score_fn``: NVIDIA HierarchicalKV's customized strategy; the lowest score
    goes first, ties least recently used). The ``*lfu`` touch counts are 32-bit: every
    256 steps they are cut to 2**31 - 1 less two cuts' worth of touches, so a hot key's
    count never wraps to the lowest."""
    epoch_steps: int = 1000
    """Steps per epoch of the ``epoch_*`` policies (at most 2**28: the table's 32-bit clock
    goes back by whole epochs once past 2**30 steps, its stamps with it)."""
    samples: int = 8
    """Slots whose keys a new key ranks to choose its victim: those from the first slot of
    its home bucket on (eight: the bucket, its scores in one cache line, as NVIDIA
    HierarchicalKV ranks a bucket). New keys claim in turn, each taking a key no new key of
    the step took before it; a key whose slots hold none to take (all this step's) ranks as
    many slots of another bucket (eight rounds). (A GPU ranks a step's new keys together:
    a key whose choice an earlier one took ranks another bucket.)"""
    spill: str | None = None
    """A folder (jctr): every evicted row -- vector, optimizer state and slot -- is written
    to a database there (``spill_type``), and a key seen again takes its row back, so the
    table trains as if it had room for every key (``jctr.embedding.spill``). Checkpoints hold
    the spilled rows too. Any number of devices and processes (a database each process,
    ``<folder>/process<i>``)."""
    score_fn: str | None = None
    """``score`` only (required there): ``"module:function"``, imported when a trainer is
    made (as TFRA's ``gen_scores_fn``; serving never calls it). Called inside the training
    step with the step's keys (int64 [n]) and the table's step (int32 []), it returns each
    key's score (int32 [n], jnp code); every key a step assigns gets its score
    (``jctr.embedding.hash_table.caller_scores``).
    Example: ``def by_range(keys, step): return jnp.where(keys < 1_000_000, 1000, 0)``."""
    spill_type: str = "rocks_db"
    """Where ``spill`` keeps the rows (jctr): ``"rocks_db"`` a RocksDB database, ``"row_file"``
    plain memory-mapped files (``jctr.stores.row_file``: a gather and a scatter a step,
    paged out by the operating system when larger than memory). Either way the folder is the
    run's scratch: a checkpoint holds the spilled rows and a restore writes them again."""

    @property
    def score_columns(self) -> int:
        """int32 columns kept per row: the last step touched, and touches for ``*lfu`` or the
        caller's score for ``score``."""
        return 2 if self.policy.endswith("lfu") or self.policy == "score" else 1


@dataclass(frozen=True)
class EmbeddingConfig:
    """A sparse embedding layer (one hash table over the slots of one sparse input)."""

    name: str
    """The layer's name; model files and checkpoints name the table by it."""
    type: str
    """``DistributedSlotSparseEmbeddingHash`` (rows of every slot spread over the devices by
    key hash), ``LocalizedSlotSparseEmbeddingHash`` (each slot whole on one device) or
    ``LocalizedSlotSparseEmbeddingOneHot`` (the same, one-hot inputs)."""
    bottom: str
    """The sparse input of the Data layer it reads."""
    top: str
    """The output, ``[batch, slots, embedding_vec_size]``."""
    max_vocabulary_size_per_gpu: int
    """``sparse_embedding_hparam``: the row capacity of one device's part of the table; more
    distinct keys stop training with an error naming the table. A ``LocalizedSlot*``
    embedding with ``slot_size_array`` is sized from it instead (HugeCTR ignores this field
    then): the sizes of the slots the busiest device owns."""
    embedding_vec_size: int
    """``sparse_embedding_hparam``: the width of one embedding vector."""
    combiner: str = "sum"
    """``sparse_embedding_hparam``: how a slot's keys pool, 0 or ``"sum"``, 1 or
    ``"mean"``."""
    optimizer: OptimizerConfig | None = None
    """This table's own optimizer clause (same fields as the global one; default: the global
    optimizer)."""
    plan_file: str | None = None
    """HugeCTR's placement plan for its multi-node all-to-all; accepted, not read: jctr plans
    placement itself."""
    init_range: float | None = None
    """``sparse_embedding_hparam`` (jctr): new rows start uniform in ±init_range (default
    ±1/sqrt(embedding_vec_size)), drawn from a hash of the key and ``solver.seed``."""
    replicated: bool | None = None
    """``sparse_embedding_hparam`` (jctr): a full copy on every device (data parallel);
    unset lets the planner decide by ``solver.replicate_table_bytes``."""
    l2_lambda: float = 0.0
    """``sparse_embedding_hparam`` (jctr): every row a batch touches gets ``l2_lambda * w``
    added to its gradient, once per step (``l2_rows`` ``all``: every row of the table
    decays instead)."""
    l2_rows: str = "touched"
    """``sparse_embedding_hparam`` (jctr): which rows ``l2_lambda`` regularizes. ``touched``:
    the rows a batch touches (a weak regularizer: a row decays only when seen). ``all``:
    every row of the table, every step, as a penalty ``l2_lambda / 2 * ||E||^2`` in the loss
    does (FuxiCTR's ``embedding_regularizer``): the whole table is scaled by ``1 - lr *
    l2_lambda`` in place before the step's sparse update (exact for SGD; with Adam and the
    other adaptive rules it is decoupled weight decay, AdamW's form, since the penalty's
    gradient does not enter their moments). Costs one pass over the table per step."""
    l1_lambda: float = 0.0
    """``sparse_embedding_hparam`` (jctr): every row a batch touches gets ``l1_lambda *
    sign(w)`` added to its gradient, once per step."""
    slot_size_array: tuple[int, ...] = ()
    """``sparse_embedding_hparam``, ``LocalizedSlot*`` only: the keys of each slot of the input
    (one entry per slot). The table is sized from it (``max_vocabulary_size_per_gpu`` then
    unneeded, as in HugeCTR's DLRM samples) and its slots are balanced over the devices by
    size."""
    growable: bool = False
    """``sparse_embedding_hparam`` (jctr): the table doubles its rows between steps when
    the rows in use and two batches' keys would not fit (the steps are compiled again, a
    line printed each time), as long as the memory plan of the grown step fits the machine;
    past that, a full table stops (or evicts, with ``eviction``)."""
    eviction: EvictionConfig | None = None
    """The layer's ``eviction`` object (jctr, object below): a full table evicts instead of
    stopping with ``TableFullError`` (HugeCTR's behaviour, the default)."""


@dataclass(frozen=True)
class LayerConfig:
    """A dense layer of the graph: ``bottoms`` name earlier ``tops``."""

    name: str
    """The layer's name (unique in the config)."""
    type: str
    """One of the dense layer types below."""
    bottoms: tuple[str, ...]
    """``bottom``: the input tensor's name, or a list of names (tops of earlier layers or
    inputs)."""
    tops: tuple[str, ...]
    """``top``: the output's name, or a list for layers with several outputs."""
    params: object = field(default_factory=NoParam)
    """The type's own parameters (listed per type below)."""
    path: str = ""
    """Not in JSON: the layer's JSON path, for error messages."""

    @property
    def is_loss(self) -> bool:
        return self.type in LOSS_TYPES


@dataclass(frozen=True)
class ModelConfig:
    """A whole parsed config: solver, optimizer, data layer, embeddings, dense layers."""

    solver: SolverConfig
    """The ``solver`` clause."""
    optimizer: OptimizerConfig
    """The ``optimizer`` clause: the dense network's, and every embedding's without its
    own."""
    data: DataConfig
    """``layers[0]``, the Data layer."""
    embeddings: tuple[EmbeddingConfig, ...]
    """The embedding layers, which follow the Data layer."""
    layers: tuple[LayerConfig, ...]
    """The dense layers, in order; the last is the loss."""
    source: str | None = None
    """Not in JSON: the file the config came from."""
    raw: dict | None = field(default=None, compare=False, hash=False, repr=False)
    """Not in JSON: the JSON it was parsed from (checkpoints and inference bundles carry
    it)."""

    def embedding_optimizer(self, emb: EmbeddingConfig) -> OptimizerConfig:
        return emb.optimizer if emb.optimizer is not None else self.optimizer

    @property
    def loss(self) -> LayerConfig:
        return next(layer for layer in self.layers if layer.is_loss)
