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


def __getattr__(name):
    # lazy: `python -m jctr.serve --help` must not start JAX, and the HPS pulls the stores'
    # clients only when used
    if name in ("InferenceModel", "check_bundle_target", "export_bundle"):
        from jctr.serving import bundle

        return getattr(bundle, name)
    if name == "export_checkpoint":
        from jctr.serving.export import export_checkpoint

        return export_checkpoint
    if name == "Databases":
        from jctr.serving.hps import Databases

        return Databases
    if name == "HPSModel":
        from jctr.serving.hps_model import HPSModel

        return HPSModel
    raise AttributeError(name)


__all__ = [
    "DatabaseOverflowPolicy_t", "DatabaseType_t", "Databases", "HPSModel", "InferenceModel",
    "InferenceParams", "ParameterServerConfig", "PersistentDatabaseParams", "UpdateSourceParams",
    "VolatileDatabaseParams", "check_bundle_target", "export_bundle", "export_checkpoint",
    "load_ps_config",
]
