"""Build a network from the config's dense layers, wired by ``bottom``/``top`` names.

Shapes are inferred layer by layer when the network is built, so a mismatch is a
:class:`ConfigError` naming the layer's JSON path before anything trains.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jctr.config.schema import LayerConfig, ModelConfig
from jctr.models import layers as L
from jctr.models.layers import Shape


def build_layer(cfg: LayerConfig, shapes: Sequence[Shape], index: int, rngs: nnx.Rngs,
                source: str | None = None):
    """The module for one layer and the shapes of its tops."""
    x = L.Inputs(cfg, shapes, index, rngs, source)
    module = L.MODULES.get(cfg.type)
    if module is None:
        raise x.fail("unsupported layer type")
    return module.build(x)


class GraphNetwork(nnx.Module):
    """The dense part of a model: layers evaluated in config order.

    ``__call__(inputs, ctx)`` takes the named input tensors (label, dense, one [batch, slots,
    dim] tensor per embedding) and returns (loss, prediction).
    """

    def __init__(self, layers: Sequence[LayerConfig], input_shapes: dict[str, Shape], *,
                 regularizer: str | None = None, reg_lambda: float = 0.0,
                 rngs: nnx.Rngs, source: str | None = None):
        shapes = dict(input_shapes)
        mods = []
        self.wiring = []
        for i, cfg in enumerate(layers):
            mod, outs = build_layer(cfg, [shapes[b] for b in cfg.bottoms], i, rngs, source)
            mods.append(mod)
            self.wiring.append((tuple(cfg.bottoms), tuple(cfg.tops)))
            shapes.update(zip(cfg.tops, outs))
        self.layers = nnx.List(mods)
        self.shapes = shapes
        self.regularizer = regularizer
        self.reg_lambda = reg_lambda

    def __call__(self, inputs: dict[str, jax.Array], ctx: L.Context):
        tensors = dict(inputs)
        loss = pred = None
        for mod, (bottoms, tops) in zip(self.layers, self.wiring):
            out = mod([tensors[b] for b in bottoms], ctx)
            if isinstance(out, tuple):  # the loss layer
                loss, pred = out
            else:
                tensors.update(zip(tops, out))
        return loss + self.regularization(jnp.sum(ctx.mask)), pred

    def regularization(self, batch_size) -> jax.Array:
        """HugeCTR's regulariser on fully connected weights, scaled by 1/batch."""
        if not self.regularizer or self.reg_lambda == 0.0:
            return jnp.zeros((), jnp.float32)
        total = jnp.zeros((), jnp.float32)
        for mod in self.layers:
            if isinstance(mod, L.InnerProduct):
                w = mod.kernel[...].astype(jnp.float32)
                total += jnp.sum(w * w) * 0.5 if self.regularizer == "L2" else jnp.sum(jnp.abs(w))
        return self.reg_lambda * total / jnp.maximum(batch_size, 1.0)


def input_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    shapes: dict[str, Shape] = {cfg.data.label_top: (cfg.data.label_dim,),
                                cfg.data.dense_top: (cfg.data.dense_dim,)}
    for emb in cfg.embeddings:
        sp = cfg.data.sparse_input(emb.bottom)
        shapes[emb.top] = (sp.slot_num, emb.embedding_vec_size)
    return shapes


def build_network(cfg: ModelConfig, rngs: nnx.Rngs) -> GraphNetwork:
    """The dense network of a parsed config (shape-checked)."""
    loss = cfg.loss.params
    return GraphNetwork(cfg.layers, input_shapes(cfg), regularizer=loss.regularizer,
                        reg_lambda=loss.lambda_, rngs=rngs, source=cfg.source)
