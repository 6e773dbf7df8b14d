"""Flax NNX modules for HugeCTR's dense layer types.

Every layer maps a list of input tensors to a list of outputs (most take and give one), so the
graph builder (:mod:`jctr.models.graph`) can wire any config. Shapes below omit the batch axis.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jctr.ops import dot_interaction, linear

_glorot = nnx.initializers.glorot_uniform()


class Context(NamedTuple):
    """What a forward pass needs besides the tensors."""

    train: bool
    rng: jax.Array | None  # dropout key for this step
    mask: jax.Array  # float32 [batch], 0 for padding samples


class InnerProduct(nnx.Module):
    """Fully connected layer ``x @ W + b``; ``FusedInnerProduct`` adds a ReLU."""

    def __init__(self, in_features: int, num_output: int, *, bias: bool = True,
                 relu: bool = False, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_glorot(rngs.params(), (in_features, num_output), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((num_output,), jnp.float32)) if bias else None
        self.relu = relu

    def __call__(self, xs, ctx: Context):
        (x,) = xs
        bias = None if self.bias is None else self.bias[...].astype(x.dtype)
        return [linear(x, self.kernel[...].astype(x.dtype), bias, relu=self.relu)]


class ReLU(nnx.Module):
    def __call__(self, xs, ctx):
        return [jax.nn.relu(xs[0])]


class ELU(nnx.Module):
    def __init__(self, alpha: float = 1.0):
        self.alpha = alpha

    def __call__(self, xs, ctx):
        return [jax.nn.elu(xs[0], self.alpha)]


class Dropout(nnx.Module):
    """Inverted dropout; the key comes from the step's RNG folded with the layer index."""

    def __init__(self, rate: float, index: int):
        self.rate = rate
        self.index = index

    def __call__(self, xs, ctx):
        (x,) = xs
        if not ctx.train or self.rate == 0.0:
            return [x]
        keep = jax.random.bernoulli(jax.random.fold_in(ctx.rng, self.index), 1.0 - self.rate,
                                    x.shape)
        return [jnp.where(keep, x / (1.0 - self.rate), 0.0).astype(x.dtype)]


class BatchNorm(nnx.Module):
    """Batch normalisation over the batch axis, statistics over real (unmasked) samples.

    Running statistics follow HugeCTR's ``factor``: ``running = (1 - factor) * running +
    factor * batch``; they are non-trainable state (``nnx.BatchStat``).
    """

    def __init__(self, features: int, factor: float = 1.0, eps: float = 1e-5):
        self.gamma = nnx.Param(jnp.ones((features,), jnp.float32))
        self.beta = nnx.Param(jnp.zeros((features,), jnp.float32))
        self.mean = nnx.BatchStat(jnp.zeros((features,), jnp.float32))
        self.var = nnx.BatchStat(jnp.ones((features,), jnp.float32))
        self.factor = factor
        self.eps = eps

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


class Reshape(nnx.Module):
    def __init__(self, leading_dim: int):
        self.leading_dim = leading_dim

    def __call__(self, xs, ctx):
        (x,) = xs
        return [x.reshape(x.shape[0], self.leading_dim)]


class Concat(nnx.Module):
    """2-D inputs join on the feature axis, 3-D inputs on the slot axis."""

    def __call__(self, xs, ctx):
        return [jnp.concatenate(xs, axis=1)]


class Slice(nnx.Module):
    def __init__(self, ranges):
        self.ranges = tuple(ranges)

    def __call__(self, xs, ctx):
        (x,) = xs
        return [x[:, b:e] for b, e in self.ranges]


class Split(nnx.Module):
    """Copies the input to every top (Caffe's Split)."""

    def __init__(self, copies: int):
        self.copies = copies

    def __call__(self, xs, ctx):
        return [xs[0]] * self.copies


class Multiply(nnx.Module):
    """[b, s] times a weight [s, d], elementwise per row, flattened to [b, s*d]."""

    def __init__(self, slots: int, dim: int, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(_glorot(rngs.params(), (slots, dim), jnp.float32))

    def __call__(self, xs, ctx):
        (x,) = xs
        y = x[:, :, None] * self.weight[...].astype(x.dtype)[None]
        return [y.reshape(x.shape[0], -1)]


class FmOrder2(nnx.Module):
    """Second-order factorisation machine term over fields of width ``out_dim``:
    ``0.5 * ((sum_f v_f)^2 - sum_f v_f^2)``, [b, f*d] -> [b, d]."""

    def __init__(self, out_dim: int):
        self.out_dim = out_dim

    def __call__(self, xs, ctx):
        (x,) = xs
        v = x.reshape(x.shape[0], -1, self.out_dim)
        s = jnp.sum(v, axis=1)
        return [0.5 * (s * s - jnp.sum(v * v, axis=1))]


class MultiCross(nnx.Module):
    """DCN cross network: ``x_{l+1} = x_0 * (x_l . w_l) + b_l + x_l`` for ``num_layers``."""

    def __init__(self, features: int, num_layers: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(_glorot(rngs.params(), (num_layers, features), jnp.float32))
        self.b = nnx.Param(jnp.zeros((num_layers, features), jnp.float32))
        self.num_layers = num_layers

    def __call__(self, xs, ctx):
        (x0,) = xs
        w = self.w[...].astype(x0.dtype)
        b = self.b[...].astype(x0.dtype)
        x = x0
        for i in range(self.num_layers):
            x = x0 * (x @ w[i])[:, None] + b[i] + x
        return [x]


class ReduceSum(nnx.Module):
    def __init__(self, axis: int):
        self.axis = axis

    def __call__(self, xs, ctx):
        return [jnp.sum(xs[0], axis=self.axis, keepdims=True)]


class Add(nnx.Module):
    def __call__(self, xs, ctx):
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return [out]


class Interaction(nnx.Module):
    """DLRM dot interaction of the bottom-MLP output [b, d] with embeddings [b, s, d]."""

    def __call__(self, xs, ctx):
        dense, emb = xs
        return [dot_interaction(dense, emb.astype(dense.dtype))]


# ---- losses: [prediction input, label] -> (mean loss over real samples, prediction) ---------


def _masked_mean(per_sample, mask):
    return jnp.sum(per_sample * mask) / jnp.maximum(jnp.sum(mask), 1.0)


class BinaryCrossEntropyLoss(nnx.Module):
    def __call__(self, xs, ctx):
        logits, label = xs
        z = logits.astype(jnp.float32)[:, 0]
        y = label[:, 0]
        per = jnp.maximum(z, 0.0) - z * y + jnp.log1p(jnp.exp(-jnp.abs(z)))
        return _masked_mean(per, ctx.mask), jax.nn.sigmoid(z)


class CrossEntropyLoss(nnx.Module):
    """Two-class softmax; the label holds the class index (0 or 1)."""

    def __call__(self, xs, ctx):
        logits, label = xs
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        y = label[:, 0].astype(jnp.int32)
        per = -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]
        return _masked_mean(per, ctx.mask), jnp.exp(logp[:, 1])


class MultiCrossEntropyLoss(nnx.Module):
    """Independent sigmoid cross-entropy per label column, weighted by ``target_weight``."""

    def __init__(self, target_weight):
        self.target_weight = tuple(target_weight)

    def __call__(self, xs, ctx):
        logits, label = xs
        z = logits.astype(jnp.float32)
        per = jnp.maximum(z, 0.0) - z * label + jnp.log1p(jnp.exp(-jnp.abs(z)))
        w = jnp.asarray(self.target_weight, jnp.float32)
        per = jnp.sum(per * w, axis=1) / jnp.sum(w)
        return _masked_mean(per, ctx.mask), jax.nn.sigmoid(z)
