"""Pallas kernels for the DLRM dot interaction (Triton on GPU; ``interpret=True`` on CPU).

Forward: one program per sample loads its feature matrix ``T`` [F, D] (padded to powers of two)
and writes the Gram matrix ``T T^T`` with a tensor-core dot. Backward: one program per sample
computes ``dT = (G + G^T) T`` from the Gram gradient ``G``. The lower triangle is cut out (and
scattered back) by the caller, which also keeps accumulation in float32 for 16-bit inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jctr.ops.pallas_bag import _ZERO, _params, _pow2

try:
    from jax.experimental.pallas import triton as plt
except ImportError:  # pragma: no cover
    plt = None


def _dims(f: int, d: int) -> tuple[int, int]:
    # tl.dot needs every dimension >= 16
    return max(16, _pow2(f)), max(16, _pow2(d))


def full_float32() -> bool:
    """Whether the dots run in full float32 (IEEE): the step's ``jax.default_matmul_precision``
    says so ("float32" unless the config sets HugeCTR's ``enable_tf32_compute``). Pallas' Triton
    dot takes TF32 for float32 unless told otherwise, whatever that setting."""
    return jax.config.jax_default_matmul_precision in ("float32", "highest", "F32_F32_F32")


def _precision(ieee: bool):
    return jax.lax.Precision.HIGHEST if ieee else jax.lax.Precision.DEFAULT


def _gram_kernel(t_ref, out_ref, *, f, d, fp, dp, ieee):
    b = pl.program_id(0)
    rows = jnp.arange(fp, dtype=jnp.int32)[:, None]
    cols = jnp.arange(dp, dtype=jnp.int32)[None, :]
    t = plt.load(t_ref.at[b, pl.ds(_ZERO, fp), pl.ds(_ZERO, dp)],
                 mask=(rows < f) & (cols < d), other=0.0)
    g = plt.dot(t, t, trans_b=True, precision=_precision(ieee)).astype(jnp.float32)
    plt.store(out_ref.at[b, pl.ds(_ZERO, fp), pl.ds(_ZERO, fp)], g)


@functools.partial(jax.jit, static_argnames=("interpret", "ieee"))
def gram(feats: jax.Array, *, interpret: bool = False, ieee: bool = True) -> jax.Array:
    """[b, f, d] -> float32 [b, fp, fp] (zero beyond f); ``ieee=False``: TF32 dots."""
    b, f, d = feats.shape
    fp, dp = _dims(f, d)
    kernel = functools.partial(_gram_kernel, f=f, d=d, fp=fp, dp=dp, ieee=ieee)
    return pl.pallas_call(kernel, grid=(b,),
                          out_shape=jax.ShapeDtypeStruct((b, fp, fp), jnp.float32),
                          interpret=interpret, compiler_params=None if interpret else _params(),
                          name="jctr_interaction_fwd")(feats)


def _gram_bwd_kernel(t_ref, g_ref, out_ref, *, f, d, fp, dp, ieee):
    b = pl.program_id(0)
    rows = jnp.arange(fp, dtype=jnp.int32)[:, None]
    cols = jnp.arange(dp, dtype=jnp.int32)[None, :]
    t = plt.load(t_ref.at[b, pl.ds(_ZERO, fp), pl.ds(_ZERO, dp)],
                 mask=(rows < f) & (cols < d), other=0.0).astype(jnp.float32)
    g = plt.load(g_ref.at[b, pl.ds(_ZERO, fp), pl.ds(_ZERO, fp)])
    dt = plt.dot(g + g.T, t, precision=_precision(ieee))
    plt.store(out_ref.at[b, pl.ds(_ZERO, fp), pl.ds(_ZERO, dp)], dt)


@functools.partial(jax.jit, static_argnames=("interpret", "ieee"))
def gram_backward(feats: jax.Array, grad_gram: jax.Array, *, interpret: bool = False,
                  ieee: bool = True):
    """d(feats) [b, f, d] for the gradient [b, fp, fp] of :func:`gram`'s output."""
    b, f, d = feats.shape
    fp, dp = _dims(f, d)
    kernel = functools.partial(_gram_bwd_kernel, f=f, d=d, fp=fp, dp=dp, ieee=ieee)
    out = pl.pallas_call(kernel, grid=(b,),
                         out_shape=jax.ShapeDtypeStruct((b, fp, dp), jnp.float32),
                         interpret=interpret, compiler_params=None if interpret else _params(),
                         name="jctr_interaction_bwd")(feats, grad_gram.astype(jnp.float32))
    return out[:, :f, :d].astype(feats.dtype)


def make_pair_dots(interpret: bool = False):
    """[b, f, d] -> [b, f(f-1)/2] strictly-lower-triangular dots with the kernels above."""

    @jax.custom_vjp
    def pair_dots(feats):
        f = feats.shape[1]
        fp = _dims(f, feats.shape[2])[0]
        li, lj = np.tril_indices(f, k=-1)
        grams = gram(feats, interpret=interpret, ieee=full_float32())
        return grams.reshape(feats.shape[0], fp * fp)[:, li * fp + lj]

    def fwd(feats):
        return pair_dots(feats), feats

    def bwd(feats, g):
        b, f, d = feats.shape
        fp = _dims(f, d)[0]
        li, lj = np.tril_indices(f, k=-1)
        full = jnp.zeros((b, fp * fp), jnp.float32).at[:, li * fp + lj].set(
            g.astype(jnp.float32))
        return (gram_backward(feats, full.reshape(b, fp, fp), interpret=interpret,
                              ieee=full_float32()),)

    pair_dots.defvjp(fwd, bwd)
    return pair_dots
