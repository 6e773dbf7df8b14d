"""The training state and the jitted, pure train and eval steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jctr.data.batch import Batch
from jctr.embedding.collection import (
    EmbeddingSpec,
    EmbeddingState,
    apply_gradients,
    lookup_rows,
    pool,
)
from jctr.models.layers import Context
from jctr.train.schedules import learning_rate_schedule


class TrainState(NamedTuple):
    """Everything that changes during training, as one pytree."""

    step: jax.Array  # int32 [], updates done
    rng: jax.Array  # uint32 [2], base key; step keys are folded from it
    params: Any  # nnx.State of nnx.Param
    batch_stats: Any  # nnx.State of the rest (BatchNorm running statistics)
    opt_state: Any  # optax state of the dense part
    embeddings: tuple[EmbeddingState, ...]


class StepConfig(NamedTuple):
    """Static (hashable) inputs of the step functions."""

    graphdef: Any
    specs: tuple[EmbeddingSpec, ...]
    emb_tops: tuple[str, ...]
    label_top: str
    dense_top: str
    compute_dtype: Any
    loss_scale: float
    matmul_precision: str
    skip_nonfinite: bool = False  # solver.nan_policy "skip": a bad batch updates nothing


def _cast(tree, dtype):
    if dtype == jnp.float32:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, tree)


def _forward(sc: StepConfig, params, batch_stats, pooled, batch: Batch, rng, train: bool):
    inputs = {sc.label_top: batch.label,
              sc.dense_top: batch.dense.astype(sc.compute_dtype)}
    for top, p in zip(sc.emb_tops, pooled):
        inputs[top] = p.astype(sc.compute_dtype)
    model = nnx.merge(sc.graphdef, _cast(params, sc.compute_dtype), batch_stats)
    ctx = Context(train=train, rng=rng, mask=batch.mask.astype(jnp.float32))
    loss, pred = model(inputs, ctx)
    new_stats = nnx.state(model, nnx.BatchStat) if train else batch_stats
    return loss, (pred, new_stats)


class LocalEmbeddings:
    """Lookups and updates of all embeddings on one device (the interface
    :class:`jctr.sharding.ShardedEmbeddings` also implements for a mesh)."""

    def __init__(self, specs: tuple[EmbeddingSpec, ...]):
        self.specs = specs

    def lookup(self, embs, batch: Batch, *, train: bool):
        b = batch.label.shape[0]
        new_embs, lookups, pooled = [], [], []
        for spec, es in zip(self.specs, embs):
            segs = batch.segments[spec.input_index]
            es, lk = lookup_rows(spec, es, batch.keys[spec.input_index], segs, b, train=train)
            new_embs.append(es)
            lookups.append(lk)
            pooled.append(pool(spec, es.values, lk.rows, segs, b))
        return (tuple(new_embs) if train else embs), tuple(lookups), tuple(pooled)

    def apply(self, embs, lookups, batch: Batch, grads, lrs, count):
        return tuple(apply_gradients(spec, es, lk, batch.segments[spec.input_index],
                                     g.astype(jnp.float32), lr, count)
                     for spec, es, lk, g, lr in zip(self.specs, embs, lookups, grads, lrs))


def make_train_step(sc: StepConfig, dense_tx: optax.GradientTransformation, engine=None):
    """``train_step(state, batch) -> (state, metrics)``; jit it with the state donated.

    ``engine`` does the embedding lookups and updates (default: all tables on one device)."""
    schedules = [learning_rate_schedule(s.optimizer) for s in sc.specs]
    engine = engine or LocalEmbeddings(sc.specs)

    def train_step(state: TrainState, batch: Batch):
        with jax.default_matmul_precision(sc.matmul_precision):
            embs, lookups, pooled = engine.lookup(state.embeddings, batch, train=True)
            rng = jax.random.fold_in(state.rng, state.step)

            # The BatchNorm statistics enter as a differentiated argument only so that NNX sees
            # them on the same trace level as the layers that update them; their gradient is
            # unused (a few floats).
            def loss_fn(params, pooled, batch_stats):
                loss, aux = _forward(sc, params, batch_stats, pooled, batch, rng, True)
                return loss * sc.loss_scale, aux

            (scaled, (pred, new_stats)), (g_params, g_pooled, _) = jax.value_and_grad(
                loss_fn, argnums=(0, 1, 2), has_aux=True)(state.params, pooled,
                                                          state.batch_stats)
            inv = jnp.float32(1.0 / sc.loss_scale)
            finite = jnp.array(True)
            unscale = lambda g: g.astype(jnp.float32)
            if sc.loss_scale != 1.0 or sc.skip_nonfinite:
                # fp16 with a static loss scale, or nan_policy "skip": a step whose loss or
                # gradients are not finite applies no gradient at all (instead of poisoning
                # the weights)
                finite = jnp.isfinite(scaled)
                for g in jax.tree.leaves((g_params, g_pooled)):
                    finite = finite & jnp.all(jnp.isfinite(g))
                inv = jnp.where(finite, inv, 0.0)
                unscale = lambda g: jnp.nan_to_num(g.astype(jnp.float32) * inv)
            g_params = jax.tree.map(unscale, g_params)
            updates, opt_state = dense_tx.update(g_params, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            count = state.step + 1
            lrs = tuple(sched(state.step) for sched in schedules)
            if sc.skip_nonfinite:
                # the dense part keeps its old values exactly; table rows get a zero gradient
                # at learning rate 0 (weights unchanged; touched rows' moments decay a step)
                keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b),
                                                     new, old)
                params = keep(params, state.params)
                opt_state = keep(opt_state, state.opt_state)
                new_stats = keep(new_stats, state.batch_stats)
                lrs = tuple(jnp.where(finite, lr, 0.0) for lr in lrs)
            new_embs = engine.apply(embs, lookups, batch, tuple(unscale(g) for g in g_pooled),
                                    lrs, count)
            overflow = sum(jnp.sum(es.table.overflow) for es in new_embs)
            new_state = TrainState(count, state.rng, params, new_stats, opt_state,
                                   tuple(new_embs))
            skipped = ~finite if sc.skip_nonfinite else jnp.array(False)
            return new_state, {"loss": scaled / sc.loss_scale, "overflow": overflow,
                               "grads_finite": finite, "skipped": skipped}

    return train_step


def make_eval_step(sc: StepConfig, engine=None):
    """``eval_step(state, batch) -> (loss, prediction)``; never inserts keys."""
    engine = engine or LocalEmbeddings(sc.specs)

    def eval_step(state: TrainState, batch: Batch):
        with jax.default_matmul_precision(sc.matmul_precision):
            _, _, pooled = engine.lookup(state.embeddings, batch, train=False)
            loss, (pred, _) = _forward(sc, state.params, state.batch_stats, pooled, batch,
                                       None, False)
            return loss, pred

    return eval_step
