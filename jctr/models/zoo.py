"""WDL, DCN, DeepFM and DLRM as NNX modules, built from the layer lists of
:mod:`jctr.config.model_layers` (the same lists produce the shipped JSON configs, so a module
built here and a network built from ``configs/<model>.json`` are the same graph).
"""

from __future__ import annotations

from flax import nnx

from jctr.config.model_layers import dcn_layers, deepfm_layers, dlrm_layers, wdl_layers
from jctr.config.parser import parse_dense_layer
from jctr.config.reader import ObjectReader
from jctr.models.graph import GraphNetwork


def _parse(layers: list[dict]):
    return [parse_dense_layer(ObjectReader(d, f"layers[{i}]"), d["type"])
            for i, d in enumerate(layers)]


def _shapes(dense_dim, num_slots, dim, extra=None):
    s = {"label": (1,), "dense": (dense_dim,), "sparse_embedding1": (num_slots, dim)}
    s.update(extra or {})
    return s


class WDL(GraphNetwork):
    """Wide & Deep. Inputs: ``dense`` [b, dense_dim], ``sparse_embedding1`` [b, num_slots, dim]
    (deep), ``sparse_embedding2`` [b, wide_slots, 1] (wide), ``label`` [b, 1].

    Example::

        net = WDL(dense_dim=13, num_slots=26, embedding_dim=16, rngs=nnx.Rngs(0))
    """

    def __init__(self, dense_dim=13, num_slots=26, embedding_dim=16, wide_slots=1,
                 hidden=(1024, 1024), dropout=0.5, *, rngs: nnx.Rngs):
        super().__init__(
            _parse(wdl_layers(dense_dim, num_slots, embedding_dim, wide_slots, hidden, dropout)),
            _shapes(dense_dim, num_slots, embedding_dim,
                    {"sparse_embedding2": (wide_slots, 1)}), rngs=rngs)


class DCN(GraphNetwork):
    """Deep & Cross Network: a cross network and an MLP over [embeddings, dense].

    Example::

        net = DCN(dense_dim=13, num_slots=26, embedding_dim=16, rngs=nnx.Rngs(0))
    """

    def __init__(self, dense_dim=13, num_slots=26, embedding_dim=16, cross_layers=6,
                 hidden=(1024, 1024), dropout=0.5, *, rngs: nnx.Rngs):
        super().__init__(
            _parse(dcn_layers(dense_dim, num_slots, embedding_dim, cross_layers, hidden,
                              dropout)),
            _shapes(dense_dim, num_slots, embedding_dim), rngs=rngs)


class DeepFM(GraphNetwork):
    """DeepFM: FM (first and second order) plus an MLP over shared field embeddings.
    ``sparse_embedding2`` [b, num_slots, 1] holds the first-order weights.

    Example::

        net = DeepFM(dense_dim=13, num_slots=26, embedding_dim=10, rngs=nnx.Rngs(0))
    """

    def __init__(self, dense_dim=13, num_slots=26, embedding_dim=10, hidden=(400, 400, 400),
                 dropout=0.5, *, rngs: nnx.Rngs):
        super().__init__(
            _parse(deepfm_layers(dense_dim, num_slots, embedding_dim, hidden, dropout)),
            _shapes(dense_dim, num_slots, embedding_dim,
                    {"sparse_embedding2": (num_slots, 1)}), rngs=rngs)


class DLRM(GraphNetwork):
    """DLRM: bottom MLP on dense features, dot interaction with the embeddings, top MLP.

    Example::

        net = DLRM(dense_dim=13, num_slots=26, embedding_dim=16, rngs=nnx.Rngs(0))
        loss, prob = net({"dense": d, "sparse_embedding1": e, "label": y}, ctx)
    """

    def __init__(self, dense_dim=13, num_slots=26, embedding_dim=16,
                 bottom_mlp=(512, 256, 64, 16), top_mlp=(512, 256, 1), *, rngs: nnx.Rngs):
        super().__init__(
            _parse(dlrm_layers(dense_dim, num_slots, embedding_dim, bottom_mlp, top_mlp)),
            _shapes(dense_dim, num_slots, embedding_dim), rngs=rngs)


__all__ = ["DCN", "DLRM", "WDL", "DeepFM", "dcn_layers", "deepfm_layers", "dlrm_layers",
           "wdl_layers"]
