"""Row-wise optimizers for embedding tables: only the rows a batch touches are read and written.

Each function takes the table values, the optimizer's row state, the distinct rows of the batch
(``rows`` with ``num_rows`` -- out of range -- where a position is not a representative) and the
gradient summed per distinct row. The formulas equal the optax optimizers the dense part uses
(``jctr.train.dense_optimizer``), applied to those rows only; ``Local`` is HugeCTR's default
update type.

``Global`` updates every row (the moments of untouched rows decay and move their weights), and
``LazyGlobal`` updates touched rows only but first applies the decay of the steps they missed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jctr.config.schema import OptimizerConfig


def slot_names(opt: OptimizerConfig) -> tuple[str, ...]:
    """Per-row state arrays the optimizer keeps, each shaped like the values."""
    return {
        "SGD": (),
        "MomentumSGD": ("momentum",),
        "Nesterov": ("momentum",),
        "Adam": ("m", "v"),
        "AdaGrad": ("accum",),
    }[opt.type]


def init_slots(opt: OptimizerConfig, capacity: int, dim: int) -> dict[str, jax.Array]:
    slots = {}
    for name in slot_names(opt):
        fill = opt.initial_accu_value if name == "accum" else 0.0
        slots[name] = jnp.full((capacity, dim), fill, jnp.float32)
    if opt.update_type == "LazyGlobal" and opt.type in ("Adam", "MomentumSGD", "Nesterov"):
        slots["last_step"] = jnp.zeros((capacity,), jnp.int32)
    return slots


def _row_rule(opt: OptimizerConfig, w, g, state: dict, lr, count):
    """New (weights, state) for a block of rows; ``count`` is the 1-based step."""
    t = opt.type
    if t == "SGD":
        return w - lr * g, state
    if t in ("MomentumSGD", "Nesterov"):
        mu = opt.momentum_factor
        m = mu * state["momentum"] + g
        upd = g + mu * m if t == "Nesterov" else m
        return w - lr * upd, {"momentum": m}
    if t == "Adam":
        b1, b2 = opt.beta1, opt.beta2
        m = b1 * state["m"] + (1.0 - b1) * g
        v = b2 * state["v"] + (1.0 - b2) * g * g
        c = count.astype(jnp.float32)
        m_hat = m / (1.0 - jnp.float32(b1) ** c)
        v_hat = v / (1.0 - jnp.float32(b2) ** c)
        return w - lr * m_hat / (jnp.sqrt(v_hat) + opt.epsilon), {"m": m, "v": v}
    if t == "AdaGrad":
        acc = state["accum"] + g * g
        upd = jnp.where(acc > 0, g * jax.lax.rsqrt(acc + opt.epsilon), 0.0)
        return w - lr * upd, {"accum": acc}
    raise ValueError(t)


def apply_rows(opt: OptimizerConfig, values: jax.Array, slots: dict, rows: jax.Array,
               grads: jax.Array, lr: jax.Array, count: jax.Array, *, l2: float = 0.0,
               l1: float = 0.0):
    """Update the distinct ``rows`` (others out of range, dropped) with summed ``grads``.

    Returns (values, slots). ``count`` is the 1-based global step (Adam's bias correction).
    ``l2`` / ``l1`` regularize the updated rows lazily: ``l2 * w + l1 * sign(w)`` joins each
    row's gradient (rows no batch touches are not regularized, whatever the update type).
    """
    capacity = values.shape[0]
    regularized = bool(l2 or l1)

    def penalized(g, w):
        return g + l2 * w + l1 * jnp.sign(w)

    def touched():  # out-of-range rows read 0: no penalty
        return values.at[rows].get(mode="fill", fill_value=0.0)

    if opt.type == "SGD":
        # Scatter-add sums duplicates itself; no gather of the old rows needed (unless
        # regularized: then ``rows`` are distinct)
        g = penalized(grads, touched()) if regularized else grads
        return values.at[rows].add(-lr * g, mode="drop"), slots
    if opt.update_type == "Global":
        g = penalized(grads, touched()) if regularized else grads
        dense_g = jnp.zeros_like(values).at[rows].add(g, mode="drop")
        state = {k: v for k, v in slots.items() if k != "last_step"}
        w, state = _row_rule(opt, values, dense_g, state, lr, count)
        return w, {**slots, **state}
    w = touched()
    if regularized:
        grads = penalized(grads, w)
    state = {k: v.at[rows].get(mode="fill", fill_value=0.0)
             for k, v in slots.items() if k != "last_step"}
    new_slots = dict(slots)
    if "last_step" in slots:
        missed = count - 1 - slots["last_step"].at[rows].get(mode="fill", fill_value=0)
        missed = jnp.maximum(missed, 0).astype(jnp.float32)[:, None]
        if opt.type == "Adam":
            state = {"m": state["m"] * jnp.float32(opt.beta1) ** missed,
                     "v": state["v"] * jnp.float32(opt.beta2) ** missed}
        else:
            state = {"momentum": state["momentum"] * jnp.float32(opt.momentum_factor) ** missed}
        new_slots["last_step"] = slots["last_step"].at[rows].set(
            jnp.broadcast_to(count.astype(jnp.int32), rows.shape), mode="drop")
    w, state = _row_rule(opt, w, grads, state, lr, count)
    values = values.at[rows].set(w, mode="drop")
    for k, v in state.items():
        new_slots[k] = slots[k].at[rows].set(v, mode="drop")
    del capacity
    return values, new_slots
