"""Flax NNX modules for HugeCTR's dense layer types, one class per type (or family of types).

Every layer maps a list of input tensors to a list of outputs (most take and give one), so the
graph builder (:mod:`jctr.models.graph`) can wire any config. Each class declares, with
:func:`layer_type`, the config types it implements; ``build`` checks the input shapes and makes
the module; ``file_weights`` lists its weights in HugeCTR's dense model file order
(:mod:`jctr.checkpoint.model_files`). The parameters each type reads from JSON are declared in
:mod:`jctr.config.layer_types`. Shapes omit the batch axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jctr.config.layer_types import LAYER_TYPES
from jctr.config.reader import ConfigError
from jctr.config.schema import LayerConfig
from jctr.ops import dot_interaction, interaction_output_dim, linear

_glorot = nnx.initializers.glorot_uniform()


def hugectr_initializer(kind: str | None, index: int, fan_in: float, fan_out: float,
                        default=_glorot):
    """HugeCTR's initializer ``kind`` of a layer's weight ``index`` (0: the kernel; others
    take fan-in 0), as ``UniformDataSimulator`` / ``VarianceScalingSimulator`` (scale 1,
    fan_avg; the normal truncated at 2 sigma) draw them; None: ``default``."""
    if kind is None:
        return default
    if kind == "Zero":
        return nnx.initializers.zeros
    fi = fan_in if index == 0 else 0.0
    scale = 1.0 / max(1.0, (fi + fan_out) / 2.0)
    if kind in ("Uniform", "XavierUniform"):
        limit = 1.0 / (fi + fan_out) if kind == "Uniform" else (3.0 * scale) ** 0.5
        return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
            key, shape, dtype, -limit, limit)
    if kind == "XavierNorm":
        std = scale ** 0.5 / 0.87962566103423978
        return lambda key, shape, dtype=jnp.float32: std * jax.random.truncated_normal(
            key, -2.0, 2.0, shape, dtype)
    raise ValueError(kind)

Shape = tuple[int, ...]

# config type name -> the module class that implements it
MODULES: dict[str, type[Layer]] = {}


def layer_type(*names: str) -> Callable[[type[Layer]], type[Layer]]:
    """Register a module class as the implementation of the config layer types ``names``."""

    def register(cls):
        for name in names:
            if name not in LAYER_TYPES:
                raise TypeError(f"{cls.__name__}: {name} is not declared in "
                                "jctr.config.layer_types.LAYER_TYPES")
            MODULES[name] = cls
        return cls

    return register


class Rows(tuple):
    """The per-sample shape ``(k, n)`` of a tensor HugeCTR holds as ``[batch * k, n]``: a
    Reshape to rows narrower than a sample. Stored as ``[batch, k, n]`` (the same memory
    order); the layers that take 2-D inputs in HugeCTR work on its last axis."""

    @property
    def per_sample(self) -> int:
        return self[0]


def fmt_shape(shape: Shape) -> str:
    if isinstance(shape, Rows):
        return f"[batch*{shape[0]}, {shape[1]}]"
    return "[batch" + "".join(f", {d}" for d in shape) + "]"


def _like(shape: Shape, width: int) -> Shape:
    """A 2-D per-sample shape of ``width`` columns, in the row layout of ``shape``."""
    return Rows((shape[0], width)) if isinstance(shape, Rows) else (width,)


class Inputs(NamedTuple):
    """What ``build`` gets: the layer's config, its input shapes, its position in the graph."""

    cfg: LayerConfig
    shapes: Sequence[Shape]
    index: int
    rngs: nnx.Rngs
    source: str | None = None

    @property
    def params(self) -> Any:
        return self.cfg.params

    def fail(self, msg: str) -> ConfigError:
        return ConfigError(self.cfg.path or self.cfg.name,
                           f"{self.cfg.type} \"{self.cfg.name}\": {msg}", self.source)

    def columns(self, i: int = 0) -> int:
        """The width n of the 2-D input ``i``: ``[batch, n]`` or ``[batch * k, n]``."""
        if isinstance(self.shapes[i], Rows):
            return self.shapes[i][1]
        return self.width(i)

    def width(self, i: int = 0) -> int:
        """The width n >= 1 of the 2-D input ``i`` ([batch, n]); any other rank, or an empty
        input (``dense_dim: 0``), is an error naming the layer."""
        if isinstance(self.shapes[i], Rows):
            raise self.fail(f"expects one row per sample [batch, n], got "
                            f"{fmt_shape(self.shapes[i])} from \"{self.cfg.bottoms[i]}\" "
                            "(Reshape it back to a row per sample first)")
        if len(self.shapes[i]) != 1:
            raise self.fail(f"expects a 2-D input [batch, n], got {fmt_shape(self.shapes[i])} "
                            f"from \"{self.cfg.bottoms[i]}\" (add a Reshape)")
        if self.shapes[i][0] == 0:
            raise self.fail(f"input \"{self.cfg.bottoms[i]}\" is empty ([batch, 0]; the Data "
                            "layer's dense_dim is 0?): leave this layer out for data without "
                            "dense features (the model zoo's layouts do for dense_dim=0)")
        return self.shapes[i][0]


class Layer(nnx.Module):
    """Base of the layer modules."""

    @classmethod
    def build(cls, x: Inputs) -> tuple[Layer, list[Shape]]:
        """The module for the layer and the shapes of its tops (default: no parameters, the
        shape passes through)."""
        return cls(), [x.shapes[0]]

    def file_weights(self) -> list[tuple[str, int | None]]:
        """Trainable arrays in model file order: (attribute, row of it or None for all)."""
        return []


class Context(NamedTuple):
    """What a forward pass needs besides the tensors."""

    train: bool
    rng: jax.Array | None  # dropout key for this step
    mask: jax.Array  # float32 [batch], 0 for padding samples


@layer_type("InnerProduct", "FusedInnerProduct")
class InnerProduct(Layer):
    """Fully connected layer ``x @ W + b``; ``FusedInnerProduct`` adds a ReLU."""

    def __init__(self, in_features: int, num_output: int, *, bias: bool = True,
                 relu: bool = False, rngs: nnx.Rngs, weight_init: str | None = None,
                 bias_init: str | None = None):
        init = hugectr_initializer(weight_init, 0, in_features, num_output)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, num_output), jnp.float32))
        # zeros draw no random key (the other layers' initial values stay as they were)
        b_init = hugectr_initializer(bias_init, 1, in_features, num_output)
        self.bias = (None if not bias else
                     nnx.Param(jnp.zeros((num_output,), jnp.float32)) if bias_init is None
                     else nnx.Param(b_init(rngs.params(), (num_output,), jnp.float32)))
        self.relu = relu

    @classmethod
    def build(cls, x):
        p = x.params
        return (cls(x.columns(), p.num_output, bias=p.bias,
                    relu=x.cfg.type == "FusedInnerProduct", rngs=x.rngs,
                    weight_init=p.weight_init, bias_init=p.bias_init),
                [_like(x.shapes[0], p.num_output)])

    def file_weights(self):
        return [("kernel", None)] + ([("bias", None)] if self.bias is not None else [])

    def __call__(self, xs, ctx: Context):
        (x,) = xs
        bias = None if self.bias is None else self.bias[...].astype(x.dtype)
        rows = x.reshape(-1, x.shape[-1])  # [batch * k, n] for a row-split input
        y = linear(rows, self.kernel[...].astype(x.dtype), bias, relu=self.relu)
        return [y.reshape(*x.shape[:-1], y.shape[-1])]


@layer_type("ReLU")
class ReLU(Layer):
    def __call__(self, xs, ctx):
        return [jax.nn.relu(xs[0])]


@layer_type("ELU")
class ELU(Layer):
    def __init__(self, alpha: float = 1.0):
        self.alpha = alpha

    @classmethod
    def build(cls, x):
        return cls(x.params.alpha), [x.shapes[0]]

    def __call__(self, xs, ctx):
        return [jax.nn.elu(xs[0], self.alpha)]


@layer_type("Dropout")
class Dropout(Layer):
    """Inverted dropout; the key comes from the step's RNG folded with the layer index."""

    def __init__(self, rate: float, index: int):
        self.rate = rate
        self.index = index

    @classmethod
    def build(cls, x):
        return cls(x.params.rate, x.index), [x.shapes[0]]

    def __call__(self, xs, ctx):
        (x,) = xs
        if not ctx.train or self.rate == 0.0:
            return [x]
        keep = jax.random.bernoulli(jax.random.fold_in(ctx.rng, self.index), 1.0 - self.rate,
                                    x.shape)
        return [jnp.where(keep, x / (1.0 - self.rate), 0.0).astype(x.dtype)]


@layer_type("BatchNorm")
class BatchNorm(Layer):
    """Batch normalisation over the batch axis, statistics over real (unmasked) samples.

    Running statistics follow HugeCTR's ``factor``: ``running = (1 - factor) * running +
    factor * batch``; they are non-trainable state (``nnx.BatchStat``).
    """

    def __init__(self, features: int, factor: float = 1.0, eps: float = 1e-5, *,
                 gamma_zero: bool = False):
        # HugeCTR's BatchNorm has only its default initializer and Zero (beta: zero either way)
        self.gamma = nnx.Param((jnp.zeros if gamma_zero else jnp.ones)((features,), jnp.float32))
        self.beta = nnx.Param(jnp.zeros((features,), jnp.float32))
        self.mean = nnx.BatchStat(jnp.zeros((features,), jnp.float32))
        self.var = nnx.BatchStat(jnp.ones((features,), jnp.float32))
        self.factor = factor
        self.eps = eps

    @classmethod
    def build(cls, x):
        p = x.params
        return cls(x.width(), p.factor, p.eps, gamma_zero=p.gamma_init == "Zero"), [x.shapes[0]]

    def file_weights(self):
        return [("gamma", None), ("beta", None)]

    def __call__(self, xs, ctx):
        (x,) = xs
        if ctx.train:
            xf = x.astype(jnp.float32)
            w = ctx.mask[:, None]
            n = jnp.maximum(jnp.sum(ctx.mask), 1.0)
            mean = jnp.sum(xf * w, axis=0) / n
            var = jnp.sum(jnp.square(xf - mean) * w, axis=0) / n
            f = self.factor
            self.mean[...] = (1.0 - f) * self.mean[...] + f * mean
            self.var[...] = (1.0 - f) * self.var[...] + f * var
        else:
            mean, var = self.mean[...], self.var[...]
        y = (x.astype(jnp.float32) - mean) * jax.lax.rsqrt(var + self.eps)
        return [(y * self.gamma[...] + self.beta[...]).astype(x.dtype)]


@layer_type("Reshape")
class Reshape(Layer):
    """HugeCTR's Reshape (``reshape_layer.cu``): rows of ``leading_dim`` values, one or several
    per sample, or the ``selected`` slots of an embedding output side by side."""

    def __init__(self, out: Shape, selected: tuple[int, ...] | None = None):
        self.out = tuple(out)
        self.selected = selected

    @classmethod
    def build(cls, x):
        shape, p = x.shapes[0], x.params
        if p.selected is not None:
            if isinstance(shape, Rows) or len(shape) != 2:
                raise x.fail(f"selected slots need an embedding output [batch, slots, vec], "
                             f"got {fmt_shape(shape)}")
            slots, vec = shape
            if len(p.selected) > slots:
                raise x.fail(f"selects {len(p.selected)} slots of an input with {slots}")
            bad = [s for s in p.selected if s >= slots]
            if bad:
                raise x.fail(f"selected slot {bad[0]} does not exist: the input "
                             f"{fmt_shape(shape)} has slots 0..{slots - 1}")
            return cls((len(p.selected) * vec,), tuple(p.selected)), [(len(p.selected) * vec,)]
        size = math.prod(shape)
        n = size if p.leading_dim is None else p.leading_dim
        last = shape[-1]
        if n < last or n % last:
            raise x.fail(f"leading_dim {n} must be a multiple of the input's last dimension "
                         f"{last} (input {fmt_shape(shape)})")
        if n > size or size % n:
            raise x.fail(f"leading_dim {n} must divide a sample's {size} values (input "
                         f"{fmt_shape(shape)}): a row may not hold parts of two samples")
        out = (n,) if n == size else Rows((size // n, n))
        return cls(out), [out]

    def __call__(self, xs, ctx):
        (x,) = xs
        if self.selected is not None:
            x = x[:, jnp.asarray(self.selected)]
        return [x.reshape(x.shape[0], *self.out)]


@layer_type("Concat")
class Concat(Layer):
    """2-D inputs join on the feature axis, 3-D inputs on the slot axis (row-split inputs,
    HugeCTR's 2-D ``[batch * k, n]``, on the columns)."""

    def __init__(self, axis: int = 1):
        self.axis = axis

    @classmethod
    def build(cls, x):
        shapes = x.shapes
        if any(isinstance(s, Rows) for s in shapes):  # HugeCTR: 2-D, equal heights
            if len({s[0] if isinstance(s, Rows) else None for s in shapes}) != 1:
                raise x.fail("inputs must have the same rows per sample, got "
                             + ", ".join(fmt_shape(s) for s in shapes))
            return cls(axis=2), [Rows((shapes[0][0], sum(s[1] for s in shapes)))]
        ranks = {len(s) for s in shapes}
        if ranks == {1}:
            return cls(), [(sum(s[0] for s in shapes),)]
        if ranks == {2} and len({s[1] for s in shapes}) == 1:
            return cls(), [(sum(s[0] for s in shapes), shapes[0][1])]
        raise x.fail("inputs must all be 2-D, or all 3-D with the same last dimension; got "
                     + ", ".join(fmt_shape(s) for s in shapes))

    def __call__(self, xs, ctx):
        return [jnp.concatenate(xs, axis=self.axis)]


@layer_type("Slice")
class Slice(Layer):
    def __init__(self, ranges):
        self.ranges = tuple(ranges)

    @classmethod
    def build(cls, x):
        n = x.columns()
        for b, e in x.params.ranges:
            if e > n:
                raise x.fail(f"range [{b}, {e}) exceeds the input width {n}")
        return cls(x.params.ranges), [_like(x.shapes[0], e - b) for b, e in x.params.ranges]

    def __call__(self, xs, ctx):
        (x,) = xs
        return [x[..., b:e] for b, e in self.ranges]


@layer_type("Split")
class Split(Layer):
    """Copies the input to every top (Caffe's Split)."""

    def __init__(self, copies: int):
        self.copies = copies

    @classmethod
    def build(cls, x):
        return cls(len(x.cfg.tops)), [x.shapes[0]] * len(x.cfg.tops)

    def __call__(self, xs, ctx):
        return [xs[0]] * self.copies


@layer_type("Multiply", "WeightMultiply")
class Multiply(Layer):
    """[b, s] times a weight [s, d], elementwise per row, flattened to [b, s*d]."""

    def __init__(self, slots: int, dim: int, *, rngs: nnx.Rngs, weight_init: str | None = None):
        init = hugectr_initializer(weight_init, 0, slots, slots * dim)
        self.weight = nnx.Param(init(rngs.params(), (slots, dim), jnp.float32))

    @classmethod
    def build(cls, x):
        n = x.width()
        s, d = x.params.weight_dims
        if n != s:
            raise x.fail(f"weight_dims[0] {s} must equal the input width {n}")
        return cls(s, d, rngs=x.rngs, weight_init=x.params.weight_init), [(s * d,)]

    def file_weights(self):
        return [("weight", None)]

    def __call__(self, xs, ctx):
        (x,) = xs
        y = x[:, :, None] * self.weight[...].astype(x.dtype)[None]
        return [y.reshape(x.shape[0], -1)]


@layer_type("FmOrder2")
class FmOrder2(Layer):
    """Second-order factorisation machine term over fields of width ``out_dim``:
    ``0.5 * ((sum_f v_f)^2 - sum_f v_f^2)``, [b, f*d] -> [b, d]."""

    def __init__(self, out_dim: int):
        self.out_dim = out_dim

    @classmethod
    def build(cls, x):
        n, d = x.width(), x.params.out_dim
        if n % d:
            raise x.fail(f"input width {n} is not a multiple of out_dim {d}")
        return cls(d), [(d,)]

    def __call__(self, xs, ctx):
        (x,) = xs
        v = x.reshape(x.shape[0], -1, self.out_dim)
        s = jnp.sum(v, axis=1)
        return [0.5 * (s * s - jnp.sum(v * v, axis=1))]


@layer_type("MultiCross")
class MultiCross(Layer):
    """DCN cross network: ``x_{l+1} = x_0 * (x_l . w_l) + b_l + x_l`` for ``num_layers``."""

    def __init__(self, features: int, num_layers: int, *, rngs: nnx.Rngs,
                 weight_init: str | None = None):
        # HugeCTR's MultiCross has only its default initializer (Xavier uniform over
        # features x features) and Zero; its bias starts at zero either way
        w_init = (_glorot if weight_init is None else nnx.initializers.zeros
                  if weight_init == "Zero" else hugectr_initializer("XavierUniform", 0,
                                                                   features, features))
        self.w = nnx.Param(w_init(rngs.params(), (num_layers, features), jnp.float32))
        self.b = nnx.Param(jnp.zeros((num_layers, features), jnp.float32))
        self.num_layers = num_layers

    @classmethod
    def build(cls, x):
        n, p = x.width(), x.params
        return cls(n, p.num_layers, rngs=x.rngs, weight_init=p.weight_init), [(n,)]

    def file_weights(self):
        return [(attr, i) for i in range(self.num_layers) for attr in ("w", "b")]

    def __call__(self, xs, ctx):
        (x0,) = xs
        w = self.w[...].astype(x0.dtype)
        b = self.b[...].astype(x0.dtype)
        x = x0
        for i in range(self.num_layers):
            x = x0 * (x @ w[i])[:, None] + b[i] + x
        return [x]


@layer_type("ReduceSum")
class ReduceSum(Layer):
    def __init__(self, axis: int):
        self.axis = axis

    @classmethod
    def build(cls, x):
        axis, shape = x.params.axis, x.shapes[0]
        if isinstance(shape, Rows):  # HugeCTR's 2-D [batch * k, n]: axis 1 is the columns
            if axis != 1:
                raise x.fail(f"axis {axis} of input {fmt_shape(shape)}: only axis 1 (the "
                             "columns) keeps samples apart")
            return cls(-1), [Rows((shape[0], 1))]
        if not 1 <= axis < len(shape) + 1:
            raise x.fail(f"axis {axis} out of range for input {fmt_shape(shape)} (axis 0 is "
                         "the batch)")
        out = list(shape)
        out[axis - 1] = 1
        return cls(axis), [tuple(out)]

    def __call__(self, xs, ctx):
        return [jnp.sum(xs[0], axis=self.axis, keepdims=True)]


@layer_type("Add", "DotProduct")
class Elementwise(Layer):
    """``Add``: the elementwise sum of inputs of one shape; HugeCTR's ``DotProduct``
    (``dot_product_layer.cu``): their elementwise product."""

    def __init__(self, product: bool = False):
        self.product = product

    @classmethod
    def build(cls, x):
        if len(set(x.shapes)) != 1:
            raise x.fail("inputs must have equal shapes, got "
                         + ", ".join(fmt_shape(s) for s in x.shapes))
        return cls(product=x.cfg.type == "DotProduct"), [x.shapes[0]]

    def __call__(self, xs, ctx):
        out = xs[0]
        for x in xs[1:]:
            out = out * x if self.product else out + x
        return [out]


@layer_type("Interaction")
class Interaction(Layer):
    """DLRM dot interaction of the bottom-MLP output [b, d] with embeddings [b, s, d]: the
    dense vector, the pairwise dot products of [dense, embeddings] and one zero column. With
    the embeddings alone as its one bottom (data without dense features), the pairwise dot
    products of the embeddings and the zero column."""

    def __init__(self, dense_input: bool = True):
        self.dense_input = dense_input

    @classmethod
    def build(cls, x):
        emb = x.shapes[-1]
        if len(x.shapes) == 1:
            if len(emb) != 2 or emb[0] < 2:
                raise x.fail(f"its one input must be embeddings [batch, slots >= 2, dim], got "
                             f"{fmt_shape(emb)}")
            d = emb[1]
            return cls(dense_input=False), [(interaction_output_dim(d, emb[0] - 1) - d,)]
        d = x.width(0)
        if len(emb) != 2 or emb[1] != d:
            raise x.fail(f"second input must be embeddings [batch, slots, {d}], got "
                         f"{fmt_shape(emb)}")
        return cls(), [(interaction_output_dim(d, emb[0]),)]

    def __call__(self, xs, ctx):
        if not self.dense_input:  # the first embedding takes the dense vector's place
            (emb,) = xs
            d = emb.shape[2]
            return [dot_interaction(emb[:, 0], emb[:, 1:])[:, d:]]
        dense, emb = xs
        return [dot_interaction(dense, emb.astype(dense.dtype))]


# ---- losses: [prediction input, label] -> (mean loss over real samples, prediction) ---------


def _masked_mean(per_sample, mask):
    return jnp.sum(per_sample * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@layer_type("BinaryCrossEntropyLoss")
class BinaryCrossEntropyLoss(Layer):
    @classmethod
    def build(cls, x):
        pred, label = x.shapes
        if pred != (1,) or label != (1,):
            raise x.fail(f"expects [batch, 1] predictions and labels, got {fmt_shape(pred)} "
                         f"and {fmt_shape(label)}")
        return cls(), [()]

    def __call__(self, xs, ctx):
        logits, label = xs
        z = logits.astype(jnp.float32)[:, 0]
        y = label[:, 0]
        per = jnp.maximum(z, 0.0) - z * y + jnp.log1p(jnp.exp(-jnp.abs(z)))
        return _masked_mean(per, ctx.mask), jax.nn.sigmoid(z)


@layer_type("CrossEntropyLoss")
class CrossEntropyLoss(Layer):
    """Two-class softmax; the label holds the class index (0 or 1)."""

    @classmethod
    def build(cls, x):
        pred, label = x.shapes
        if pred != (2,) or label != (1,):
            raise x.fail(f"expects [batch, 2] logits and [batch, 1] class labels, got "
                         f"{fmt_shape(pred)} and {fmt_shape(label)}")
        return cls(), [()]

    def __call__(self, xs, ctx):
        logits, label = xs
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        y = label[:, 0].astype(jnp.int32)
        per = -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]
        return _masked_mean(per, ctx.mask), jnp.exp(logp[:, 1])


@layer_type("MultiCrossEntropyLoss")
class MultiCrossEntropyLoss(Layer):
    """Independent sigmoid cross-entropy per label column, weighted by ``target_weight``."""

    def __init__(self, target_weight):
        self.target_weight = tuple(target_weight)

    @classmethod
    def build(cls, x):
        pred, label = x.shapes
        if len(pred) != 1 or pred != label:
            raise x.fail(f"expects predictions and labels of equal shape [batch, n], got "
                         f"{fmt_shape(pred)} and {fmt_shape(label)}")
        tw = x.params.target_weight or (1.0,) * pred[0]
        if len(tw) != pred[0]:
            raise x.fail(f"target_weight has {len(tw)} entries for {pred[0]} labels")
        return cls(tw), [()]

    def __call__(self, xs, ctx):
        logits, label = xs
        z = logits.astype(jnp.float32)
        per = jnp.maximum(z, 0.0) - z * label + jnp.log1p(jnp.exp(-jnp.abs(z)))
        w = jnp.asarray(self.target_weight, jnp.float32)
        per = jnp.sum(per * w, axis=1) / jnp.sum(w)
        return _masked_mean(per, ctx.mask), jax.nn.sigmoid(z)


_missing = sorted(set(LAYER_TYPES) - set(MODULES))
if _missing:  # a type declared in the config schema must have a module
    raise TypeError(f"no module for layer type(s) {', '.join(_missing)} (jctr.models.layers)")
