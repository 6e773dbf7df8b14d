"""DLRM dot interaction (jnp reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def interaction_output_dim(dense_dim: int, num_sparse: int) -> int:
    """Width of the interaction output: dense + pairwise dots + one zero pad (as HugeCTR)."""
    f = num_sparse + 1
    return dense_dim + f * (f - 1) // 2 + 1


def dot_interaction(dense: jax.Array, sparse: jax.Array) -> jax.Array:
    """Concatenate ``dense`` [b, d] with the strictly-lower-triangular pairwise dot products of
    the features ``[dense, sparse[:, 0], ..., sparse[:, s-1]]`` and one zero column.

    Example::

        dot_interaction(jnp.ones((2, 4)), jnp.ones((2, 3, 4))).shape  # (2, 4 + 6 + 1)
    """
    b, d = dense.shape
    feats = jnp.concatenate([dense[:, None, :], sparse], axis=1)
    f = feats.shape[1]
    gram = jnp.einsum("bfd,bgd->bfg", feats, feats)
    li, lj = np.tril_indices(f, k=-1)
    flat = gram.reshape(b, f * f)[:, li * f + lj]
    pad = jnp.zeros((b, 1), dense.dtype)
    return jnp.concatenate([dense, flat.astype(dense.dtype), pad], axis=1)
