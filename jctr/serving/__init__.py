"""Serving: inference bundles, export from a checkpoint, and :class:`InferenceModel`."""

from jctr.serving.bundle import InferenceModel, check_bundle_target, export_bundle
from jctr.serving.export import export_checkpoint

__all__ = ["InferenceModel", "check_bundle_target", "export_bundle", "export_checkpoint"]
