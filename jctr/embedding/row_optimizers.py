"""Row-wise optimizers for embedding tables: only the rows a batch touches are read and written.

Each function takes the table values, the optimizer's row state, the distinct rows of the batch
(``rows`` with ``num_rows`` -- out of range -- where a position is not a representative) and the
gradient summed per distinct row. The formulas equal the optax optimizers the dense part uses
(``jctr.train.dense_optimizer``), applied to those rows only; ``Local`` is HugeCTR's default
update type.

``Global`` updates every row (the moments of untouched rows decay and move their weights), and
``LazyGlobal`` updates touched rows only but first applies the decay of the steps they missed.

``SparseAdaGradSGDRule`` (PaddlePaddle's sparse table rule) keeps one squared-gradient sum per
row and part (the first dimension, "embed", and the rest, "embedx"), divides a key's gradient
by its occurrences in the batch and clips the weights (:class:`jctr.config.schema.SparseSGDRule`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jctr.config.schema import OptimizerConfig, SparseSGDRule


def slot_names(opt: OptimizerConfig) -> tuple[str, ...]:
    """Per-row state arrays the optimizer keeps, each shaped like the values."""
    return {
        "SGD": (),
        "MomentumSGD": ("momentum",),
        "Nesterov": ("momentum",),
        "Adam": ("m", "v"),
        "AdaGrad": ("accum",),
        "SparseAdaGradSGDRule": ("g2sum",),
    }[opt.type]


def init_slots(opt: OptimizerConfig, capacity: int, dim: int) -> dict[str, jax.Array]:
    if opt.type == "SparseAdaGradSGDRule":  # one sum per row for embed and for embedx
        slots = {"g2sum": jnp.zeros((capacity, 2), jnp.float32)}
        if admits(opt):  # show, click, embedx admitted (0 / 1) per row
            slots["accessor"] = jnp.zeros((capacity, 3), jnp.float32)
        return slots
    slots = {}
    for name in slot_names(opt):
        fill = opt.initial_accu_value if name == "accum" else 0.0
        slots[name] = jnp.full((capacity, dim), fill, jnp.float32)
    if opt.update_type == "LazyGlobal" and opt.type in ("Adam", "MomentumSGD", "Nesterov"):
        slots["last_step"] = jnp.zeros((capacity,), jnp.int32)
    return slots


def _state_rule(opt: OptimizerConfig, g, state: dict) -> dict:
    """The new optimizer state of a block of rows (what :func:`_row_rule` computes first)."""
    t = opt.type
    if t in ("MomentumSGD", "Nesterov"):
        return {"momentum": opt.momentum_factor * state["momentum"] + g}
    if t == "Adam":
        return {"m": opt.beta1 * state["m"] + (1.0 - opt.beta1) * g,
                "v": opt.beta2 * state["v"] + (1.0 - opt.beta2) * g * g}
    if t == "AdaGrad":
        return {"accum": state["accum"] + g * g}
    raise ValueError(t)


def _weight_rule(opt: OptimizerConfig, w, g, new_state: dict, lr, count):
    """The new weights of a block of rows from the gradient and the new state."""
    t = opt.type
    if t == "SGD":
        return w - lr * g
    if t in ("MomentumSGD", "Nesterov"):
        m = new_state["momentum"]
        return w - lr * (g + opt.momentum_factor * m if t == "Nesterov" else m)
    if t == "Adam":  # HugeCTR's: epsilon beside sqrt(v), the bias corrections in the step size
        return w - adam_step_size(opt, lr, count) * new_state["m"] / (
            jnp.sqrt(new_state["v"]) + opt.epsilon)
    if t == "AdaGrad":  # HugeCTR's: epsilon beside the root, not under it (as optax puts it)
        acc = new_state["accum"]
        return w - jnp.where(acc > 0, lr * g / (jnp.sqrt(acc) + opt.epsilon), 0.0)
    raise ValueError(t)


def _row_rule(opt: OptimizerConfig, w, g, state: dict, lr, count):
    """New (weights, state) for a block of rows; ``count`` is the 1-based step."""
    if opt.type == "SGD":
        return w - lr * g, state
    new = _state_rule(opt, g, state)
    return _weight_rule(opt, w, g, new, lr, count), new


def steps_bags_natively(opt: OptimizerConfig) -> bool:
    """Whether a bag's rows may step through :func:`jctr.ops.row_rule_by_segment` (Adam,
    AdaGrad, MomentumSGD or Nesterov on the touched rows alone: ``Local``, no ``last_step``
    to catch up)."""
    return opt.type in ("Adam", "AdaGrad", "MomentumSGD", "Nesterov") and (
        opt.update_type == "Local")


def rule_params(opt: OptimizerConfig, lr, count) -> jax.Array:
    """The scalars of :func:`_row_rule` as :func:`jctr.ops.row_rule_by_segment` takes them:
    :func:`adam_params` for Adam, else float32 [3] lr, epsilon, momentum factor."""
    if opt.type == "Adam":
        return adam_params(opt, lr, count)
    return jnp.stack([jnp.asarray(lr, jnp.float32), jnp.float32(opt.epsilon),
                      jnp.float32(opt.momentum_factor)])


def adam_step_size(opt: OptimizerConfig, lr, count) -> jax.Array:
    """HugeCTR's ``alpha_t = lr * sqrt(1 - beta2 ** t) / (1 - beta1 ** t)`` (float32; ``t``:
    the 1-based step): Adam's bias corrections folded into the step size, so that epsilon
    is added to ``sqrt(v)`` itself (``adam_update``, HugeCTR/src/optimizers/adam_optimizer.cu;
    ``opt_adam_kernel``, sparse_optimizer.cu), not to the corrected ``sqrt(v_hat)`` as optax
    adds it: early in training, and for rows whose gradients are tiny, HugeCTR's steps are
    the smaller ones."""
    c = count.astype(jnp.float32)
    return jnp.asarray(lr, jnp.float32) * jnp.sqrt(1.0 - jnp.float32(opt.beta2) ** c) / (
        1.0 - jnp.float32(opt.beta1) ** c)


def adam_params(opt: OptimizerConfig, lr, count) -> jax.Array:
    """float32 [6]: beta1, 1 - beta1, beta2, 1 - beta2, :func:`adam_step_size`, epsilon: the
    scalars of :func:`_row_rule`'s Adam, each computed as it computes it
    (:func:`jctr.ops.row_rule_by_segment`)."""
    return jnp.stack([jnp.float32(opt.beta1), jnp.float32(1.0 - opt.beta1),
                      jnp.float32(opt.beta2), jnp.float32(1.0 - opt.beta2),
                      adam_step_size(opt, lr, count), jnp.float32(opt.epsilon)])


def initial_scales(opt: OptimizerConfig, dim: int, bound: float) -> jax.Array | float:
    """What a new row's uniform [-1, 1) vector is multiplied by: ``bound`` for every column, or
    per part the ``initial_range`` of SparseAdaGradSGDRule."""
    if opt.type != "SparseAdaGradSGDRule":
        return bound
    embed, embedx = _rules(opt)
    return jnp.asarray([embed.initial_range] + [embedx.initial_range] * (dim - 1), jnp.float32)


def admits(opt: OptimizerConfig) -> bool:
    """Whether a row's embedx dimensions wait for admission (SparseAdaGradSGDRule with an
    ``embedx_threshold``)."""
    return opt.type == "SparseAdaGradSGDRule" and opt.embedx_threshold > 0


def _rules(opt: OptimizerConfig) -> tuple[SparseSGDRule, SparseSGDRule]:
    """SparseAdaGradSGDRule's (embed, embedx) rules, PaddlePaddle's defaults where unset."""
    return opt.embed_sgd_param or SparseSGDRule(), opt.embedx_sgd_param or SparseSGDRule()


def _sparse_adagrad(opt: OptimizerConfig, w, g, g2sum, lr):
    """SparseAdaGradSGDRule on gathered rows: ``g`` already divided by the occurrences."""
    embed, embedx = _rules(opt)
    parts = [(embed, slice(0, 1))]
    if w.shape[1] > 1:
        parts.append((embedx, slice(1, None)))
    new_w, new_g2 = [], []
    for i, (rule, cols) in enumerate(parts):
        acc = g2sum[:, i]
        ratio = rule.learning_rate * lr * jnp.sqrt(rule.initial_g2sum / (rule.initial_g2sum
                                                                          + acc))
        lo, hi = rule.weight_bounds
        new_w.append(jnp.clip(w[:, cols] - ratio[:, None] * g[:, cols], lo, hi))
        new_g2.append(acc + jnp.mean(g[:, cols] * g[:, cols], axis=1))
    if len(parts) == 1:
        new_g2.append(g2sum[:, 1])
    return jnp.concatenate(new_w, axis=1), jnp.stack(new_g2, axis=1)


def apply_rows(opt: OptimizerConfig, values: jax.Array, slots: dict, rows: jax.Array,
               grads: jax.Array, lr: jax.Array, count: jax.Array, *, l2: float = 0.0,
               l1: float = 0.0, occurrences: jax.Array | None = None):
    """Update the distinct ``rows`` (others out of range, dropped) with summed ``grads``.

    Returns (values, slots). ``count`` is the 1-based global step (Adam's bias correction).
    ``l2`` / ``l1`` regularize the updated rows lazily: ``l2 * w + l1 * sign(w)`` joins each
    row's gradient (rows no batch touches are not regularized, whatever the update type).
    ``occurrences`` (SparseAdaGradSGDRule): the shows each row's key was pushed with (one per
    occurrence, or a show column's sum); its gradient is divided by them (Paddle's
    ``push_show``), a row with none is not divided.
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
        w, state = _global_in_blocks(opt, values, dense_g, state, lr, count)
        return w, {**slots, **state}

    def update(values, slots, rows, grads, occurrences):
        """Gather, step and scatter back the rows of one chunk."""
        w = values.at[rows].get(mode="fill", fill_value=0.0)
        if regularized:
            grads = penalized(grads, w)
        if opt.type == "SparseAdaGradSGDRule":
            g = (grads if occurrences is None
                 else grads / jnp.where(occurrences > 0, occurrences, 1.0)[:, None])
            g2 = slots["g2sum"].at[rows].get(mode="fill", fill_value=0.0)
            w, g2 = _sparse_adagrad(opt, w, g, g2, lr)
            return (values.at[rows].set(w, mode="drop"),
                    {**slots, "g2sum": slots["g2sum"].at[rows].set(g2, mode="drop")})
        state = {k: v.at[rows].get(mode="fill", fill_value=0.0)
                 for k, v in slots.items() if k != "last_step"}
        new_slots = dict(slots)
        if "last_step" in slots:
            # last_step keeps the count's low 32 bits (4 bytes a row): the gap modulo 2**32
            # is the true one past 2**31 iterations too (a gap of 2**32 has no moment left)
            last = slots["last_step"].at[rows].get(mode="fill", fill_value=0)
            missed = (jnp.asarray(count, jnp.int64) - 1 - last) % 2**32
            missed = missed.astype(jnp.float32)[:, None]
            if opt.type == "Adam":
                state = {"m": state["m"] * jnp.float32(opt.beta1) ** missed,
                         "v": state["v"] * jnp.float32(opt.beta2) ** missed}
            else:
                state = {"momentum": state["momentum"]
                         * jnp.float32(opt.momentum_factor) ** missed}
            new_slots["last_step"] = slots["last_step"].at[rows].set(
                jnp.broadcast_to(count.astype(jnp.int32), rows.shape), mode="drop")
        w, state = _row_rule(opt, w, grads, state, lr, count)
        values = values.at[rows].set(w, mode="drop")
        for k, v in state.items():
            new_slots[k] = slots[k].at[rows].set(v, mode="drop")
        return values, new_slots

    return _in_chunks(update, values, slots, rows, grads, occurrences, capacity)


def _global_in_blocks(opt: OptimizerConfig, values, dense_g, state: dict, lr, count):
    """``Global``: every row steps, in blocks of :func:`row_chunk` rows updated in place: first
    the optimizer state, then the weights from the new state, so that the step holds the
    table's gradient and one block of new values (one loop for both would have XLA fuse each
    write-back with a recomputation from the old state, and copy the table to keep it)."""
    cap, block = values.shape[0], row_chunk(values.shape[1])
    if cap <= 2 * block or not state:
        return _row_rule(opt, values, dense_g, state, lr, count)
    full = cap // block
    cut = lambda x, start, n: jax.lax.dynamic_slice_in_dim(x, start, n)  # noqa: E731
    put = lambda x, new, start: jax.lax.dynamic_update_slice_in_dim(x, new, start, 0)  # noqa

    def state_block(st, start, n):
        new = _state_rule(opt, cut(dense_g, start, n), {k: cut(v, start, n)
                                                         for k, v in st.items()})
        return {k: put(st[k], new[k], start) for k in st}

    def weight_block(w, st, start, n):
        new = _weight_rule(opt, cut(w, start, n), cut(dense_g, start, n),
                           {k: cut(v, start, n) for k, v in st.items()}, lr, count)
        return put(w, new, start)

    tail = cap - full * block  # the last, shorter block
    state = jax.lax.fori_loop(0, full, lambda i, st: state_block(st, i * block, block), state)
    if tail:
        state = state_block(state, full * block, tail)
    w = jax.lax.fori_loop(0, full, lambda i, w: weight_block(w, state, i * block, block),
                          values)
    if tail:
        w = weight_block(w, state, full * block, tail)
    return w, state


def row_chunk(dim: int) -> int:
    """Rows a gathering optimizer steps at a time: ~32 MiB per gathered array. A batch of
    millions of keys (HugeCTR's criteo sample: 40,960 samples x 100 keys) otherwise holds
    the gathered rows, the optimizer state and their new values for every key at once,
    six to eight ``[keys, dim]`` arrays in the step's temporaries."""
    return max(4096, (32 << 20) // (4 * max(dim, 1)))


def _in_chunks(update, values, slots, rows, grads, occurrences, capacity: int):
    """``update`` over the distinct ``rows`` in chunks of :func:`row_chunk` rows (one call
    when they fit one): the same result, the temporaries of one chunk."""
    n, chunk = rows.shape[0], row_chunk(values.shape[1])
    if n <= 2 * chunk:
        return update(values, slots, rows, grads, occurrences)
    k = -(-n // chunk)
    pad = k * chunk - n
    rows_c = jnp.concatenate([rows, jnp.full((pad,), capacity, rows.dtype)]).reshape(k, chunk)
    grads_c = jnp.concatenate([grads, jnp.zeros((pad, grads.shape[1]), grads.dtype)]
                              ).reshape(k, chunk, grads.shape[1])
    occ_c = (None if occurrences is None else
             jnp.concatenate([occurrences, jnp.ones((pad,), occurrences.dtype)]
                             ).reshape(k, chunk))

    def body(i, carry):
        return update(*carry, rows_c[i], grads_c[i], None if occ_c is None else occ_c[i])

    return jax.lax.fori_loop(0, k, body, (values, slots))
