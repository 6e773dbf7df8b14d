"""Flax NNX layers, the config graph builder, the WDL / DCN / DeepFM / DLRM networks, and the
CTR model as a whole (:mod:`jctr.models.ctr`: TrainState, forward, eval step, build_model)."""

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.models.graph import GraphNetwork, build_network
from jctr.models.layers import Context
from jctr.models.zoo import DCN, DLRM, WDL, DeepFM

__all__ = ["DCN", "DLRM", "WDL", "Context", "DeepFM", "GraphNetwork", "build_network"]
