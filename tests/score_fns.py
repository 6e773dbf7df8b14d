"""Score functions the ``score`` eviction policy's tests name (``"tests.score_fns:..."``)."""

import jax.numpy as jnp


def by_key(keys, step):
    """A score from the key alone (the dictionary model computes the same)."""
    return (keys * 7) % 5


def odd_first(keys, step):
    """Odd keys outrank even ones: a full table keeps them."""
    return ((keys & 1) * 1000).astype(jnp.int32)


def one_number(keys, step):
    """Wrong: one score for the whole batch."""
    return jnp.zeros((1,), jnp.int32)


NOT_A_FUNCTION = 3
