"""Embedding bag: reduce gathered rows per (sample, slot) segment (jnp reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def embedding_bag(vectors: jax.Array, segments: jax.Array, num_segments: int,
                  combiner: str = "sum") -> jax.Array:
    """Sum or mean of ``vectors`` [n, d] per segment id; ids >= num_segments are dropped.

    Segments are sorted (sample-major), which lets XLA use a cheaper reduction.
    Empty segments give zeros for both combiners.
    """
    out = jax.ops.segment_sum(vectors, segments, num_segments=num_segments,
                              indices_are_sorted=True)
    if combiner == "mean":
        counts = jax.ops.segment_sum(jnp.ones(segments.shape, vectors.dtype), segments,
                                     num_segments=num_segments, indices_are_sorted=True)
        out = out / jnp.maximum(counts, 1.0)[:, None]
    return out
