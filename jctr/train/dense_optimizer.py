"""Optimizers of the dense part (optax), built from the config's optimizer clause.

The embedding tables use the row-wise twins in :mod:`jctr.embedding.row_optimizers`, whose formulas
are these same ones restricted to the rows a batch touches.
"""

from __future__ import annotations

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
        return optax.adam(lr, b1=opt.beta1, b2=opt.beta2, eps=opt.epsilon)
    if opt.type == "AdaGrad":
        return optax.adagrad(lr, initial_accumulator_value=opt.initial_accu_value,
                             eps=opt.epsilon)
    raise ValueError(f"unknown optimizer type {opt.type!r}")
