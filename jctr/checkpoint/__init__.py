"""Checkpoints (Orbax, tables by key), HugeCTR-style model files, BatchNorm JSON, inference
bundles."""

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.checkpoint.manager import Checkpointer, CheckpointError
from jctr.checkpoint.model_files import ModelFileError

__all__ = ["CheckpointError", "Checkpointer", "ModelFileError"]
