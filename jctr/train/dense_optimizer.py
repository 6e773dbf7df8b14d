"""Optimizers of the dense part (optax), built from the config's optimizer clause.

The embedding tables use the row-wise twins in :mod:`jctr.embedding.row_optimizers`, whose formulas
are these same ones restricted to the rows a batch touches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.config.schema import OptimizerConfig
from jctr.train.schedules import learning_rate_schedule


def dense_optimizer(opt: OptimizerConfig) -> optax.GradientTransformation:
    """optax transformation for an optimizer clause.

    Example::

        tx = dense_optimizer(OptimizerConfig("Adam", learning_rate=1e-3))
    """
    lr = learning_rate_schedule(opt)
    if opt.type == "SGD":
        return optax.sgd(lr)
    if opt.type == "MomentumSGD":
        return optax.sgd(lr, momentum=opt.momentum_factor)
    if opt.type == "Nesterov":
        return optax.sgd(lr, momentum=opt.momentum_factor, nesterov=True)
    if opt.type == "Adam":
        return optax.chain(_scale_by_hugectr_adam(opt.beta1, opt.beta2, opt.epsilon),
                           optax.scale_by_learning_rate(lr))
    if opt.type == "AdaGrad":
        return optax.chain(_scale_by_root_plus_epsilon(opt.initial_accu_value, opt.epsilon),
                           optax.scale_by_learning_rate(lr))
    raise ValueError(f"unknown optimizer type {opt.type!r}")


def _scale_by_hugectr_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """HugeCTR's Adam direction ``sqrt(1 - b2 ** t) / (1 - b1 ** t) * m / (sqrt(v) + eps)``
    (``adam_update``, HugeCTR/src/optimizers/adam_optimizer.cu: the bias corrections folded
    into the step size), where ``optax.scale_by_adam`` adds epsilon to the corrected
    ``sqrt(v_hat)``: at step 1 with beta2 0.999 HugeCTR's epsilon weighs 32 times more. Its
    state is optax's ``ScaleByAdamState``, so checkpoints of either load as the other."""
    def init(params):
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                      mu=jax.tree.map(jnp.zeros_like, params),
                                      nu=jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda g, m: b1 * m + (1.0 - b1) * g, updates, state.mu)
        nu = jax.tree.map(lambda g, v: b2 * v + (1.0 - b2) * g * g, updates, state.nu)
        count = optax.safe_int32_increment(state.count)
        c = count.astype(jnp.float32)
        size = jnp.sqrt(1.0 - jnp.float32(b2) ** c) / (1.0 - jnp.float32(b1) ** c)
        step = jax.tree.map(lambda m, v: size * m / (jnp.sqrt(v) + eps), mu, nu)
        return step, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def _scale_by_root_plus_epsilon(initial: float, eps: float) -> optax.GradientTransformation:
    """HugeCTR's AdaGrad direction ``g / (sqrt(accum) + eps)`` after ``accum += g * g``
    (``ada_grad_update_kernel``, HugeCTR/src/optimizers/adagrad_optimizer.cu): epsilon beside
    the root, where ``optax.scale_by_rss`` puts it under it (``g / sqrt(accum + eps)``: a
    third of HugeCTR's first step for a gradient of 1e-4 with eps 1e-7, a thirtieth for
    1e-5). Its state is optax's ``ScaleByRssState``, so checkpoints of either load as the
    other."""
    def init(params):
        return optax.ScaleByRssState(sum_of_squares=jax.tree.map(
            lambda p: jnp.full_like(p, initial), params))

    def update(updates, state, params=None):
        del params
        acc = jax.tree.map(lambda g, a: a + g * g, updates, state.sum_of_squares)
        step = jax.tree.map(
            lambda g, a: jnp.where(a > 0, g / (jnp.sqrt(a) + eps), 0.0), updates, acc)
        return step, optax.ScaleByRssState(sum_of_squares=acc)

    return optax.GradientTransformation(init, update)
