"""Learning-rate schedules (HugeCTR's ``lr_policy: fixed`` with warm-up and polynomial decay)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.config.schema import OptimizerConfig


def learning_rate_schedule(opt: OptimizerConfig) -> Callable[[jax.Array], jax.Array]:
    """``lr(count)`` for the update that follows ``count`` earlier updates (optax convention).

    With update number ``t = count + 1``: linear warm-up ``lr * t / warmup_steps`` while
    ``t <= warmup_steps``; the base rate until ``decay_start``; then
    ``(lr - end_lr) * ((decay_start + decay_steps - t) / decay_steps) ** decay_power + end_lr``,
    and ``end_lr`` once the decay is over. Always float32.

    Example::

        sched = learning_rate_schedule(OptimizerConfig("SGD", learning_rate=24.0,
                                                       warmup_steps=8000))
        sched(jnp.int32(3999))  # 12.0
    """
    base = jnp.float32(opt.learning_rate)

    def schedule(count):
        t = jnp.asarray(count).astype(jnp.float32) + 1.0
        lr = base
        if opt.warmup_steps:
            lr = jnp.where(t <= opt.warmup_steps, base * t / opt.warmup_steps, lr)
        if opt.decay_steps:
            end = jnp.float32(opt.end_lr)
            frac = jnp.clip((opt.decay_start + opt.decay_steps - t) / opt.decay_steps, 0.0, 1.0)
            decayed = (base - end) * frac ** jnp.float32(opt.decay_power) + end
            lr = jnp.where((t > opt.decay_start) & (t > opt.warmup_steps), decayed, lr)
        return jnp.asarray(lr, jnp.float32)

    return schedule
