"""Build a network from the config's dense layers, wired by ``bottom``/``top`` names.

Shapes are inferred layer by layer when the network is built, so a mismatch is a
:class:`ConfigError` naming the layer's JSON path before anything trains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jctr.config.reader import ConfigError
from jctr.config.schema import LayerConfig, ModelConfig
from jctr.models import layers as L
from jctr.ops import interaction_output_dim

Shape = tuple[int, ...]


def _fmt(shape: Shape) -> str:
    return "[batch" + "".join(f", {d}" for d in shape) + "]"


def build_layer(cfg: LayerConfig, shapes: Sequence[Shape], index: int, rngs: nnx.Rngs,
                source: str | None = None):
    """The module for one layer and the shapes of its tops."""
    p = cfg.params
    t = cfg.type

    def fail(msg):
        return ConfigError(cfg.path or cfg.name, f"{t} \"{cfg.name}\": {msg}", source)

    def need_2d(i=0):
        if len(shapes[i]) != 1:
            raise fail(f"expects a 2-D input [batch, n], got {_fmt(shapes[i])} from "
                       f"\"{cfg.bottoms[i]}\" (add a Reshape)")
        return shapes[i][0]

    if t in ("InnerProduct", "FusedInnerProduct"):
        n = need_2d()
        return (L.InnerProduct(n, p.num_output, bias=p.bias, relu=t == "FusedInnerProduct",
                               rngs=rngs), [(p.num_output,)])
    if t == "ReLU":
        return L.ReLU(), [shapes[0]]
    if t == "ELU":
        return L.ELU(p.alpha), [shapes[0]]
    if t == "Dropout":
        return L.Dropout(p.rate, index), [shapes[0]]
    if t == "BatchNorm":
        return L.BatchNorm(need_2d(), p.factor, p.eps), [shapes[0]]
    if t == "Reshape":
        size = math.prod(shapes[0])
        if size != p.leading_dim:
            raise fail(f"leading_dim {p.leading_dim} must equal the per-sample size {size} of "
                       f"input {_fmt(shapes[0])} (output [batch, leading_dim])")
        return L.Reshape(p.leading_dim), [(p.leading_dim,)]
    if t == "Concat":
        ranks = {len(s) for s in shapes}
        if ranks == {1}:
            return L.Concat(), [(sum(s[0] for s in shapes),)]
        if ranks == {2} and len({s[1] for s in shapes}) == 1:
            return L.Concat(), [(sum(s[0] for s in shapes), shapes[0][1])]
        raise fail("inputs must all be 2-D, or all 3-D with the same last dimension; got "
                   + ", ".join(_fmt(s) for s in shapes))
    if t == "Slice":
        n = need_2d()
        for b, e in p.ranges:
            if e > n:
                raise fail(f"range [{b}, {e}) exceeds the input width {n}")
        return L.Slice(p.ranges), [(e - b,) for b, e in p.ranges]
    if t == "Split":
        return L.Split(len(cfg.tops)), [shapes[0]] * len(cfg.tops)
    if t == "Multiply":
        n = need_2d()
        s, d = p.weight_dims
        if n != s:
            raise fail(f"weight_dims[0] {s} must equal the input width {n}")
        return L.Multiply(s, d, rngs=rngs), [(s * d,)]
    if t == "FmOrder2":
        n = need_2d()
        if n % p.out_dim:
            raise fail(f"input width {n} is not a multiple of out_dim {p.out_dim}")
        return L.FmOrder2(p.out_dim), [(p.out_dim,)]
    if t == "MultiCross":
        n = need_2d()
        return L.MultiCross(n, p.num_layers, rngs=rngs), [(n,)]
    if t == "ReduceSum":
        rank = len(shapes[0]) + 1
        if not 1 <= p.axis < rank:
            raise fail(f"axis {p.axis} out of range for input {_fmt(shapes[0])} "
                       "(axis 0 is the batch)")
        out = list(shapes[0])
        out[p.axis - 1] = 1
        return L.ReduceSum(p.axis), [tuple(out)]
    if t == "Add":
        if len(set(shapes)) != 1:
            raise fail("inputs must have equal shapes, got " + ", ".join(_fmt(s) for s in shapes))
        return L.Add(), [shapes[0]]
    if t == "Interaction":
        d = need_2d(0)
        if len(shapes[1]) != 2 or shapes[1][1] != d:
            raise fail(f"second input must be embeddings [batch, slots, {d}], got "
                       f"{_fmt(shapes[1])}")
        return L.Interaction(), [(interaction_output_dim(d, shapes[1][0]),)]
    if t == "BinaryCrossEntropyLoss":
        if shapes[0] != (1,) or shapes[1] != (1,):
            raise fail(f"expects [batch, 1] predictions and labels, got {_fmt(shapes[0])} and "
                       f"{_fmt(shapes[1])}")
        return L.BinaryCrossEntropyLoss(), [()]
    if t == "CrossEntropyLoss":
        if shapes[0] != (2,) or shapes[1] != (1,):
            raise fail(f"expects [batch, 2] logits and [batch, 1] class labels, got "
                       f"{_fmt(shapes[0])} and {_fmt(shapes[1])}")
        return L.CrossEntropyLoss(), [()]
    if t == "MultiCrossEntropyLoss":
        if len(shapes[0]) != 1 or shapes[0] != shapes[1]:
            raise fail(f"expects predictions and labels of equal shape [batch, n], got "
                       f"{_fmt(shapes[0])} and {_fmt(shapes[1])}")
        tw = p.target_weight or (1.0,) * shapes[0][0]
        if len(tw) != shapes[0][0]:
            raise fail(f"target_weight has {len(tw)} entries for {shapes[0][0]} labels")
        return L.MultiCrossEntropyLoss(tw), [()]
    raise fail("unsupported layer type")


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
