"""Serving: inference bundles, export from a checkpoint, :class:`InferenceModel` (whole tables on
the device), and the hierarchical parameter server (:class:`HPSModel` over :class:`Databases`,
configured with HugeCTR's parameter objects; ``python -m jctr.serve``)."""

from jctr.config.hps import (
    DatabaseOverflowPolicy_t,
    DatabaseType_t,
    InferenceParams,
    ParameterServerConfig,
    PersistentDatabaseParams,
    UpdateSourceParams,
    VolatileDatabaseParams,
    load_ps_config,
)

# lazy: `python -m jctr.serve --help` must not start JAX, and the HPS pulls the stores' clients
# only when used
_LAZY = {
    "InferenceModel": "jctr.serving.bundle", "check_bundle_target": "jctr.serving.bundle",
    "export_bundle": "jctr.serving.bundle", "export_checkpoint": "jctr.serving.export",
    "Databases": "jctr.serving.hps", "HPSModel": "jctr.serving.hps_model",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = [
    "DatabaseOverflowPolicy_t", "DatabaseType_t", "Databases", "HPSModel", "InferenceModel",
    "InferenceParams", "ParameterServerConfig", "PersistentDatabaseParams", "UpdateSourceParams",
    "VolatileDatabaseParams", "check_bundle_target", "export_bundle", "export_checkpoint",
    "load_ps_config",
]
