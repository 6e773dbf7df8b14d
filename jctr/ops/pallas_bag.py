"""Pallas kernels for the embedding bag (Triton on GPU; ``interpret=True`` runs them on CPU).

Forward: one program per segment walks its keys (segments are sorted, so a segment's keys are a
contiguous range, found by a binary search outside the kernel), gathers their rows and reduces.
Backward: one program per key adds its segment's gradient into its row's representative slot
with an atomic add, so duplicate keys sum without sorting.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

try:  # the Triton compiler parameters (absent from very old jax)
    from jax.experimental.pallas import triton as plt
except ImportError:  # pragma: no cover
    plt = None


_ZERO = np.int32(0)  # indices stay int32 under jax_enable_x64


def _pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _params():
    return plt.CompilerParams(num_warps=4, num_stages=1) if plt is not None else None


def _bag_fwd_kernel(off_ref, rows_ref, values_ref, out_ref, *, dim, dim_p, mean):
    s = pl.program_id(0)
    start = off_ref[s]
    end = off_ref[s + 1]
    lanes = jnp.arange(dim_p, dtype=jnp.int32)
    lane_ok = lanes < dim

    def body(i, acc):
        r = rows_ref[i]
        ok = lane_ok & (r >= 0)
        vec = plt.load(values_ref.at[jnp.maximum(r, 0), pl.ds(_ZERO, dim_p)], mask=ok, other=0.0)
        return acc + vec.astype(jnp.float32)

    acc = jax.lax.fori_loop(start, end, body, jnp.zeros((dim_p,), jnp.float32))
    if mean:
        acc = acc / jnp.maximum(end - start, 1).astype(jnp.float32)
    plt.store(out_ref.at[s, pl.ds(_ZERO, dim_p)], acc.astype(out_ref.dtype), mask=lane_ok)


def segment_offsets(segments: jax.Array, num_segments: int) -> jax.Array:
    """CSR offsets [num_segments + 1] of sorted segment ids (padding ids sort last)."""
    return jnp.searchsorted(segments, jnp.arange(num_segments + 1, dtype=segments.dtype),
                            side="left").astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("num_segments", "combiner", "interpret"))
def bag_forward(values, rows, segments, *, num_segments: int, combiner: str = "sum",
                interpret: bool = False):
    dim = values.shape[1]
    dim_p = _pow2(dim)
    off = segment_offsets(segments, num_segments)
    kernel = functools.partial(_bag_fwd_kernel, dim=dim, dim_p=dim_p, mean=combiner == "mean")
    return pl.pallas_call(
        kernel, grid=(num_segments,),
        out_shape=jax.ShapeDtypeStruct((num_segments, dim), values.dtype),
        interpret=interpret, compiler_params=None if interpret else _params(),
        name="jctr_bag_forward")(off, rows.astype(jnp.int32), values)


def _bag_bwd_kernel(seg_ref, rep_ref, scale_ref, grad_ref, _init_ref, out_ref, *, dim, dim_p,
                    num_segments):
    i = pl.program_id(0)
    seg = seg_ref[i]
    rep = rep_ref[i]
    lanes = jnp.arange(dim_p, dtype=jnp.int32)
    ok = (lanes < dim) & (rep >= 0) & (seg < num_segments)
    g = plt.load(grad_ref.at[jnp.minimum(seg, num_segments - 1), pl.ds(_ZERO, dim_p)], mask=ok,
                 other=0.0)
    g = g * scale_ref[i]  # zero outside ``ok``: the unmasked add below is harmless there
    plt.atomic_add(out_ref, (jnp.maximum(rep, 0), pl.ds(_ZERO, dim_p)), g)


@functools.partial(jax.jit, static_argnames=("num_segments", "combiner", "interpret"))
def bag_backward(grad_out, segments, rep, *, num_segments: int, combiner: str = "sum",
                 interpret: bool = False):
    n = segments.shape[0]
    dim = grad_out.shape[1]
    if combiner == "mean":
        off = segment_offsets(segments, num_segments)
        counts = (off[1:] - off[:-1]).astype(grad_out.dtype)
        scale = 1.0 / jnp.maximum(counts.at[segments].get(mode="fill", fill_value=1.0), 1.0)
    else:
        scale = jnp.ones((n,), grad_out.dtype)
    dim_p = _pow2(dim)
    kernel = functools.partial(_bag_bwd_kernel, dim=dim, dim_p=dim_p, num_segments=num_segments)
    # accumulate into a power-of-two wide buffer (Triton blocks), trimmed afterwards
    zeros = jnp.zeros((n, dim_p), grad_out.dtype)
    out = pl.pallas_call(
        kernel, grid=(n,), out_shape=jax.ShapeDtypeStruct((n, dim_p), grad_out.dtype),
        input_output_aliases={4: 0}, interpret=interpret,
        compiler_params=None if interpret else _params(),
        name="jctr_bag_backward")(segments.astype(jnp.int32), rep.astype(jnp.int32), scale,
                                  grad_out, zeros)
    return out[:, :dim]
