"""32-bit step clocks that live for months: the embedding table's eviction clock
(:mod:`jctr.embedding.hash_table`) and the serving device cache's LRU clock
(:mod:`jctr.serving.device_cache`) stamp int32 entries. Past 2**31 ticks they would wrap, so
once a clock reaches :data:`CLOCK_LIMIT` it goes back by about :data:`CLOCK_SHIFT`, its
stamps with it (each layer says how), in :func:`at_most_once`.

Example::

    stamps, clock = at_most_once(clock >= CLOCK_LIMIT,
                                 lambda s, c: (jnp.maximum(s - CLOCK_SHIFT, 0), c - CLOCK_SHIFT),
                                 (stamps, clock))
"""

from __future__ import annotations

from collections.abc import Callable

import jax

CLOCK_LIMIT = 1 << 30
CLOCK_SHIFT = 1 << 29


def at_most_once(due: jax.Array, body: Callable[..., tuple], operands: tuple) -> tuple:
    """``body(*operands)`` where ``due``, else ``operands`` as they are: a while loop run at
    most once, since a ``cond`` copies its operands in the branch not taken (a table's
    scores every step). Call it after the step's own writes to the operands: before them XLA
    copied them too (docs/performance.md)."""
    def step(carry):
        return (False, *body(*carry[1:]))

    return jax.lax.while_loop(lambda carry: carry[0], step, (due, *operands))[1:]
