"""DLRM dot interaction: a jnp reference and the XLA formulation used on CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jctr.ops.linear import transposed_copy


def interaction_output_dim(dense_dim: int, num_sparse: int) -> int:
    """Width of the interaction output: dense + pairwise dots + one zero pad (as HugeCTR)."""
    f = num_sparse + 1
    return dense_dim + f * (f - 1) // 2 + 1


def dot_interaction_reference(dense: jax.Array, sparse: jax.Array) -> jax.Array:
    """Reference: batched Gram matrix, strictly lower triangle, dense in front, zero pad last."""
    b, _ = dense.shape
    feats = jnp.concatenate([dense[:, None, :], sparse], axis=1)
    f = feats.shape[1]
    gram = jnp.einsum("bfd,bgd->bfg", feats, feats)
    li, lj = np.tril_indices(f, k=-1)
    flat = gram.reshape(b, f * f)[:, li * f + lj]
    pad = jnp.zeros((b, 1), dense.dtype)
    return jnp.concatenate([dense, flat.astype(dense.dtype), pad], axis=1)


@functools.cache
def _pair_tables(f: int):
    li, lj = np.tril_indices(f, k=-1)
    pair = np.full((f, f), len(li))  # the index of the zero row
    pair[li, lj] = np.arange(len(li))
    pair[lj, li] = np.arange(len(li))
    return li, lj, pair.reshape(-1)


@jax.custom_vjp
def _pair_dots(feats_t: jax.Array) -> jax.Array:
    """[dim, f, batch] -> [pairs, batch]: products summed over dim, batch innermost.

    XLA-CPU runs batched tiny matmuls one sample at a time; with the batch as the contiguous
    axis this is one fused elementwise loop instead (``docs/performance.md``).
    """
    li, lj, _ = _pair_tables(feats_t.shape[1])
    acc = None
    for k in range(feats_t.shape[0]):
        t = feats_t[k]
        term = t[li] * t[lj]
        acc = term if acc is None else acc + term
    return acc


def _pair_dots_fwd(feats_t):
    return _pair_dots(feats_t), feats_t


def _pair_dots_bwd(feats_t, g):
    # d feats[k, i] = sum_j S[i, j] feats[k, j], S the symmetric matrix of pair gradients
    f = feats_t.shape[1]
    _, _, pair = _pair_tables(f)
    gz = jnp.concatenate([g, jnp.zeros((1, g.shape[1]), g.dtype)], axis=0)
    s = gz[pair].reshape(f, f, -1)
    return (jnp.einsum("ijb,kjb->kib", s, feats_t).astype(feats_t.dtype),)


_pair_dots.defvjp(_pair_dots_fwd, _pair_dots_bwd)


def pair_dots_xla(feats: jax.Array) -> jax.Array:
    """[b, f, d] -> [b, f(f-1)/2] in float32, the formulation that is fastest on XLA-CPU."""
    return _pair_dots(jnp.transpose(feats, (2, 1, 0)).astype(jnp.float32)).T


@jax.custom_vjp
def _pair_dots_gram(feats: jax.Array) -> jax.Array:
    """[b, f, d] -> [b, f(f-1)/2] float32 through per-sample Gram matrices (batched matmuls)."""
    b, f, _ = feats.shape
    li, lj, _ = _pair_tables(f)
    gram = jnp.einsum("bfd,bdg->bfg", feats, transposed_copy(feats, (0, 2, 1)),
                      preferred_element_type=jnp.float32)
    return gram.reshape(b, f * f)[:, li * f + lj]


def _pair_dots_gram_fwd(feats):
    return _pair_dots_gram(feats), feats


def _pair_dots_gram_bwd(feats, g):
    # d feats[i] = sum_j S[i, j] feats[j], S the symmetric matrix of pair gradients
    b, f, _ = feats.shape
    _, _, pair = _pair_tables(f)
    gz = jnp.concatenate([g, jnp.zeros((b, 1), g.dtype)], axis=1)
    s = gz[:, pair].reshape(b, f, f).astype(feats.dtype)
    return (jnp.einsum("bij,bjd->bid", s, feats,
                       preferred_element_type=jnp.float32).astype(feats.dtype),)


_pair_dots_gram.defvjp(_pair_dots_gram_fwd, _pair_dots_gram_bwd)


def pair_dots_gram(feats: jax.Array) -> jax.Array:
    """[b, f, d] -> [b, f(f-1)/2] in float32 as batched row-major matmuls: the formulation for
    XLA:CPU's YNNPACK kernels (bfloat16), which take only row-major operands."""
    return _pair_dots_gram(feats)


def assemble(dense: jax.Array, dots: jax.Array) -> jax.Array:
    """``[dense, dots, 0]`` in the dense input's dtype (HugeCTR's layout)."""
    pad = jnp.zeros((dense.shape[0], 1), dense.dtype)
    return jnp.concatenate([dense, dots.astype(dense.dtype), pad], axis=1)
