"""Fully connected layer ``act(x @ kernel + bias)`` with a backward pass in row-major matmuls.

On XLA:CPU the bfloat16 matmuls go to YNNPACK, whose AVX512-BF16 kernels outrun float32, but
only for row-major ``[m, k] @ [k, n]`` operands: the backward products of a plain
``x @ kernel`` (``g @ kernel.T`` and ``x.T @ g``) reach XLA with a transposed operand and fall
back to XLA's own float32 dot after converting both operands (figures: ``docs/performance.md``).
So the VJP materialises the transposed operand once (``kernel.T`` is tiny; ``x.T`` costs one
pass over the activations), applies the ReLU mask and sums the bias gradient in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def linear_reference(x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                     relu: bool = False) -> jax.Array:
    """``x @ kernel + bias`` (ReLU optional) in ``x``'s dtype, the plain formulation.

    Example::

        linear_reference(jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.zeros(4), relu=True)
    """
    y = x @ kernel
    if bias is not None:
        y = y + bias
    return jax.nn.relu(y) if relu else y


def transposed_copy(a: jax.Array, axes: tuple[int, ...] | None = None) -> jax.Array:
    """``jnp.transpose(a, axes)`` as a row-major copy that XLA keeps for the next matmul.

    XLA folds a bare transpose into the dot's dimension numbers (and an optimization barrier
    alone lets it become a layout change); through the added unit axis it stays a copy.
    """
    return lax.optimization_barrier(jnp.transpose(a, axes)[None])[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def linear_rowmajor(x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                    relu: bool = False) -> jax.Array:
    """:func:`linear_reference` whose backward uses only row-major matmuls (float32
    accumulation, float32 bias sums); same values up to rounding.

    Example::

        x, w = jnp.ones((4, 3), jnp.bfloat16), jnp.ones((3, 2), jnp.bfloat16)
        jax.grad(lambda w: linear_rowmajor(x, w, None).astype(jnp.float32).sum())(w)
    """
    return _forward(x, kernel, bias, relu)[0]


def _forward(x, kernel, bias, relu):
    y = jnp.dot(x, kernel, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if relu:
        y = jnp.maximum(y, 0.0)
    y = y.astype(x.dtype)
    return y, (x, kernel, bias, y if relu else None)


def _backward(relu, residuals, g):
    x, kernel, bias, y = residuals
    if relu:
        g = jnp.where(y > 0, g, jnp.zeros_like(g))
    g = g.astype(x.dtype)
    dx = jnp.dot(g, transposed_copy(kernel), preferred_element_type=jnp.float32)
    dk = jnp.dot(transposed_copy(x), g, preferred_element_type=jnp.float32)
    db = None if bias is None else jnp.sum(g.astype(jnp.float32), axis=0).astype(bias.dtype)
    return dx.astype(x.dtype), dk.astype(kernel.dtype), db


linear_rowmajor.defvjp(_forward, _backward)
