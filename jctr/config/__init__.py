"""Configuration: typed dataclasses and the HugeCTR JSON parser."""

from jctr.config.parser import (
    load_config,
    override_embedding_optimizers,
    override_optimizer,
    override_solver,
    parse_config,
)
from jctr.config.reader import ConfigError
from jctr.config.schema import (
    DataConfig,
    EmbeddingConfig,
    LayerConfig,
    ModelConfig,
    OptimizerConfig,
    SolverConfig,
    SparseInputConfig,
)

__all__ = [
    "ConfigError", "DataConfig", "EmbeddingConfig", "LayerConfig", "ModelConfig",
    "OptimizerConfig", "SolverConfig", "SparseInputConfig", "load_config",
    "override_embedding_optimizers", "override_optimizer", "override_solver", "parse_config",
]
