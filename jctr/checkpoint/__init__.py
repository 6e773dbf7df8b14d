"""Checkpoints (Orbax, tables by key), HugeCTR-style model files, BatchNorm JSON, inference
bundles."""

from jctr.checkpoint.manager import Checkpointer, CheckpointError
from jctr.checkpoint.model_files import ModelFileError

__all__ = ["CheckpointError", "Checkpointer", "ModelFileError"]
