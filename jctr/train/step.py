"""The jitted, pure train step: lookup, forward, gradients, dense and sparse updates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.data.batch import Batch
from jctr.embedding.engine import EmbeddingEngine, LocalEmbeddings
from jctr.models.ctr import StepConfig, TrainState, forward
from jctr.train.schedules import learning_rate_schedule


def make_train_step(sc: StepConfig, dense_tx: optax.GradientTransformation,
                    engine: EmbeddingEngine | None = None,
                    auc_buckets: int = 0):
    """``train_step(state, batch) -> (state, metrics)``; jit it with the state donated.

    ``engine`` does the embedding lookups and updates (default: all tables on one device).
    ``auc_buckets`` > 0 adds ``metrics["auc_counts"]``: the batch's real samples counted per
    prediction bucket, negatives then positives (``[2, auc_buckets]``, see
    :func:`jctr.train.metrics.bucket_auc`)."""
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
                loss, aux = forward(sc, params, batch_stats, pooled, batch, rng, True)
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
            # every dense optimizer's update is linear in its learning rate
            updates = jax.tree.map(lambda u: u * state.lr_scale.astype(u.dtype), updates)
            params = optax.apply_updates(state.params, updates)
            count = state.step + 1
            lrs = tuple(sched(state.step) * state.lr_scale for sched in schedules)
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
            # a table that evicts refuses a key only when its sampling rounds found no row:
            # counted (embedding_norms), never a reason to stop
            overflow = sum(jnp.sum(es.table.overflow) for es, spec in zip(new_embs, sc.specs)
                           if spec.eviction is None)
            new_state = TrainState(count, state.rng, params, new_stats, opt_state,
                                   tuple(new_embs), state.lr_scale)
            skipped = ~finite if sc.skip_nonfinite else jnp.array(False)
            # per table, the fullest device part's rows in use (growable tables grow by it)
            in_use = jnp.stack([jnp.max(es.table.size - es.table.free_count)
                                for es in new_embs]) if new_embs else jnp.zeros(0, jnp.int32)
            metrics = {"loss": scaled / sc.loss_scale, "overflow": overflow,
                       "rows_in_use": in_use,
                       "grads_finite": finite, "skipped": skipped}
            if auc_buckets:
                metrics["auc_counts"] = prediction_counts(pred, batch, auc_buckets)
            return new_state, metrics

    return train_step


def prediction_counts(pred: jax.Array, batch: Batch, buckets: int) -> jax.Array:
    """``[2, buckets]`` int32: the real samples per bucket of their (first) prediction,
    label 0 in row 0 and label 1 in row 1."""
    p = pred.reshape(pred.shape[0], -1)[:, 0].astype(jnp.float32)
    y = batch.label.reshape(batch.label.shape[0], -1)[:, 0] > 0.5
    idx = jnp.clip((p * buckets).astype(jnp.int32), 0, buckets - 1)
    w = batch.mask.astype(jnp.int32)
    return jnp.zeros((2, buckets), jnp.int32).at[y.astype(jnp.int32), idx].add(w)
