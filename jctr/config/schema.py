"""Typed configuration: the solver, optimizer and layers clauses of a HugeCTR JSON config.

Field names, nesting and defaults follow HugeCTR's JSON format; jctr extensions are marked.
Parse with :func:`jctr.config.load_config`; nothing downstream reads raw JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jctr.config.layer_types import LOSS_TYPES, NoParam

OPTIMIZER_TYPES = ("Adam", "MomentumSGD", "Nesterov", "SGD", "AdaGrad")
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
class OptimizerConfig:
    """One optimizer clause (the global one or an embedding's own).

    Example::

        OptimizerConfig(type="Adam", learning_rate=1e-3)
    """

    type: str = "Adam"
    update_type: str = "Local"
    learning_rate: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-7
    momentum_factor: float = 0.0
    initial_accu_value: float = 0.0
    # Learning-rate schedule (HugeCTR's sgd_hparam; jctr accepts it in every hparam clause).
    warmup_steps: int = 0
    decay_start: int = 0
    decay_steps: int = 0
    decay_power: float = 2.0
    end_lr: float = 0.0


@dataclass(frozen=True)
class Metric:
    name: str  # "AUC", "AverageLoss" (the loss layer's mean) or "LogLoss" (binary log loss)
    threshold: float | None = None


METRIC_MODES = ("max", "min")


def default_mode(metric: str) -> str:
    """Whether a larger value of an evaluation metric is better: AUC yes, losses no."""
    return "max" if metric == "AUC" else "min"


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
    mode: str = "max"  # "max": larger is better; "min": smaller is better
    patience: int = 2
    min_delta: float = 0.0
    restore_best_weights: bool = True


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
    mode: str = "max"
    factor: float = 0.1
    patience: int = 1
    min_delta: float = 0.0
    min_lr: float = 0.0


@dataclass(frozen=True)
class SolverConfig:
    """The solver clause. ``max_iter`` or ``num_epochs`` must be set before training."""

    lr_policy: str = "fixed"
    display: int = 200
    max_iter: int | None = None
    num_epochs: int | None = None
    gpu: tuple[tuple[int, ...], ...] = ((0,),)
    batchsize: int = 2048
    batchsize_eval: int = 2048
    snapshot: int = 0
    snapshot_prefix: str = "./"
    eval_interval: int | str = 1000  # iterations, or "epoch" (jctr): after every epoch
    eval_batches: int | None = None  # None: the whole evaluation set (HugeCTR: 100 batches)
    dense_model_file: str | None = None
    sparse_model_file: tuple[str, ...] = ()
    mixed_precision: int | None = None
    enable_tf32_compute: bool = False
    eval_metrics: tuple[Metric, ...] = (Metric("AUC"),)
    input_key_type: str = "I32"
    # jctr extensions
    compute_dtype: str = "float32"
    seed: int = 0
    log_dir: str | None = None
    snapshot_keep: int = 3  # checkpoints kept (oldest deleted first)
    replicate_table_bytes: int = 0  # on several devices, copy tables this small to every one
    # send buffers per destination hold factor * keys / devices (0: every key, any skew); a
    # batch that does not fit takes a step compiled with full buffers
    all2all_capacity_factor: float = 2.0
    nan_policy: str = "stop"  # see NAN_POLICIES
    early_stopping: EarlyStoppingConfig | None = None
    lr_plateau: PlateauConfig | None = None  # set exactly when lr_policy is "plateau"

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
    top: str
    type: str
    max_feature_num_per_sample: int
    slot_num: int
    max_nnz: int

    @property
    def one_hot(self) -> bool:
        """Every slot holds at most one key: the bag is a plain gather."""
        return self.max_nnz == 1


@dataclass(frozen=True)
class SyntheticConfig:
    """jctr extension of the Data layer: generate a power-law dataset when ``source`` is absent.

    Keys of slot ``s`` follow a truncated power law with exponent ``alpha`` over
    ``slot_size_array[s]`` distinct keys (or ``vocabulary_size`` for every slot); labels carry a
    planted signal so that a model can learn something measurable.
    """

    num_samples: int
    eval_num_samples: int
    vocabulary_size: int = 100_000
    alpha: float = 1.2
    num_files: int = 4
    seed: int = 0
    signal: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    """The Data layer: where samples come from and how they are split into inputs."""

    name: str
    source: str
    eval_source: str
    label_top: str
    label_dim: int
    dense_top: str
    dense_dim: int
    sparse: tuple[SparseInputConfig, ...]
    format: str = "Norm"
    check: str = "None"
    num_samples: int | None = None
    eval_num_samples: int | None = None
    slot_size_array: tuple[int, ...] = ()
    float_label_dense: bool = False
    cache_eval_data: int = 0
    synthetic: SyntheticConfig | None = None
    shuffle: bool = False  # jctr: permute file (unit) and record order per epoch, seeded
    # jctr: (name, source) of each test set, scored after training like eval_source (the
    # validation set) with the same metrics and reported apart; never used to stop or tune
    test_sources: tuple[tuple[str, str], ...] = ()

    @property
    def total_slots(self) -> int:
        return sum(s.slot_num for s in self.sparse)

    def sparse_input(self, top: str) -> SparseInputConfig:
        for s in self.sparse:
            if s.top == top:
                return s
        raise KeyError(top)


@dataclass(frozen=True)
class EmbeddingConfig:
    """A sparse embedding layer (one hash table over the slots of one sparse input)."""

    name: str
    type: str
    bottom: str
    top: str
    max_vocabulary_size_per_gpu: int
    embedding_vec_size: int
    combiner: str = "sum"  # HugeCTR 0 -> "sum", 1 -> "mean"
    optimizer: OptimizerConfig | None = None
    plan_file: str | None = None
    # jctr extension: values start uniform in [-init_range, init_range]
    init_range: float | None = None
    # jctr extension: a full copy on every device (data parallel); None lets the planner decide
    replicated: bool | None = None
    # jctr extension: L2 / L1 regularization of the rows a batch touches, applied with their
    # sparse update (gradient + l2_lambda * w + l1_lambda * sign(w), once per row and step)
    l2_lambda: float = 0.0
    l1_lambda: float = 0.0


@dataclass(frozen=True)
class LayerConfig:
    """A dense layer of the graph: ``bottoms`` name earlier ``tops``."""

    name: str
    type: str
    bottoms: tuple[str, ...]
    tops: tuple[str, ...]
    params: object = field(default_factory=NoParam)
    path: str = ""  # JSON path, for error messages

    @property
    def is_loss(self) -> bool:
        return self.type in LOSS_TYPES


@dataclass(frozen=True)
class ModelConfig:
    """A whole parsed config: solver, optimizer, data layer, embeddings, dense layers."""

    solver: SolverConfig
    optimizer: OptimizerConfig
    data: DataConfig
    embeddings: tuple[EmbeddingConfig, ...]
    layers: tuple[LayerConfig, ...]
    source: str | None = None  # file it came from
    # the JSON it was parsed from (checkpoints and inference bundles carry it)
    raw: dict | None = field(default=None, compare=False, hash=False, repr=False)

    def embedding_optimizer(self, emb: EmbeddingConfig) -> OptimizerConfig:
        return emb.optimizer if emb.optimizer is not None else self.optimizer

    @property
    def loss(self) -> LayerConfig:
        return next(layer for layer in self.layers if layer.is_loss)
