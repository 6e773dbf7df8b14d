"""Embedding bag: gather table rows by key and reduce them per (sample, slot) segment.

Forward: ``out[s] = combine(values[rows[i]] for i with segments[i] == s)``; rows -1 (padding,
unknown keys) contribute nothing; ids >= num_segments are dropped; empty segments give zeros.
Backward: the gradient of every key's row, summed per distinct row and stored at that row's
representative position (``rep[i] == i``), ready for the row-wise optimizer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_counts(segments, num_segments, dtype):
    """Positions per segment id (ids >= num_segments dropped)."""
    return jax.ops.segment_sum(jnp.ones(segments.shape, dtype), segments,
                               num_segments=num_segments, indices_are_sorted=True)


def per_position(per_segment, segments, num_segments):
    """[num_segments, dim] rows divided by their segment's positions (at least one): the
    ``mean`` combiner's division."""
    counts = segment_counts(segments, num_segments, per_segment.dtype)
    return per_segment / jnp.maximum(counts, 1.0)[:, None]


def gather_rows(values: jax.Array, rows: jax.Array) -> jax.Array:
    """``values[rows]`` with zeros for rows < 0 (negative indices must not wrap)."""
    safe = jnp.where(rows >= 0, rows, values.shape[0])
    return values.at[safe].get(mode="fill", fill_value=0.0)


def embedding_bag(vectors: jax.Array, segments: jax.Array, num_segments: int,
                  combiner: str = "sum") -> jax.Array:
    """Sum or mean of already gathered ``vectors`` [n, d] per segment id."""
    out = jax.ops.segment_sum(vectors, segments, num_segments=num_segments,
                              indices_are_sorted=True)
    return per_position(out, segments, num_segments) if combiner == "mean" else out


def embedding_bag_forward_reference(values: jax.Array, rows: jax.Array, segments: jax.Array,
                                    num_segments: int, combiner: str = "sum") -> jax.Array:
    """Reference forward: gather, then segment reduction."""
    return embedding_bag(gather_rows(values, rows), segments, num_segments, combiner)


def key_gradients(grad_out: jax.Array, segments: jax.Array, num_segments: int,
                  combiner: str = "sum") -> jax.Array:
    """[n, dim]: each key's gradient is its segment's (over the count for mean); padding 0."""
    g = grad_out.at[segments].get(mode="fill", fill_value=0.0)
    if combiner == "mean":
        cnt = segment_counts(segments, num_segments, grad_out.dtype)
        g = g / jnp.maximum(cnt.at[segments].get(mode="fill", fill_value=1.0), 1.0)[:, None]
    return g


def embedding_bag_backward_reference(grad_out: jax.Array, segments: jax.Array, rep: jax.Array,
                                     num_segments: int, combiner: str = "sum") -> jax.Array:
    """Reference backward: :func:`key_gradients` summed at the representative position of each
    key's row. Keys with rep -1 get nothing."""
    return sum_at_representatives(key_gradients(grad_out, segments, num_segments, combiner), rep)


def sum_at_representatives(g: jax.Array, rep: jax.Array) -> jax.Array:
    """[n, dim]: every key's gradient added at its row's representative position."""
    target = jnp.where(rep >= 0, rep, g.shape[0])
    return jnp.zeros_like(g).at[target].add(g, mode="drop")
