"""The CTR model as a whole: its state, its static description, forward pass, eval step and
construction from a parsed config. Below training and checkpoints: serving and checkpoint code
use it without the trainer.

Example::

    step_config, init_state = build_model(cfg)
    state = init_state()                      # no dense optimizer state (inference)
    eval_step = jax.jit(make_eval_step(step_config))
    loss, probs = eval_step(state, batch)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jctr.config import ModelConfig
from jctr.embedding.engine import EmbeddingEngine, LocalEmbeddings
from jctr.embedding.sparse_embedding import EmbeddingSpec, EmbeddingState, init_embedding
from jctr.models.graph import build_network
from jctr.models.layers import Context

if TYPE_CHECKING:  # annotations only: the models and tables do not read files
    from jctr.data.batch import Batch

COMPUTE_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


class TrainState(NamedTuple):
    """Everything that changes during training, as one pytree."""

    # int64 [], updates done (int32 wrapped at 2**31: a negative count, a negative warm-up
    # learning rate; a snapshot of int32 restores into it)
    step: jax.Array
    rng: jax.Array  # uint32 [2], base key; step keys are folded from it
    params: Any  # nnx.State of nnx.Param
    batch_stats: Any  # nnx.State of the rest (BatchNorm running statistics)
    opt_state: Any  # optax state of the dense part
    embeddings: tuple[EmbeddingState, ...]
    # float32 [], multiplies every learning rate (lr_policy "plateau" lowers it between steps:
    # state, so that a change compiles nothing)
    lr_scale: jax.Array


def with_lr_scale(state: TrainState, scale: float) -> TrainState:
    """``state`` with its learning-rate factor set, placed like the old one (any process
    count: every process passes the same value)."""
    value = np.float32(scale)
    return state._replace(lr_scale=jax.make_array_from_callback(
        (), state.lr_scale.sharding, lambda _: value))


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


def forward(sc: StepConfig, params, batch_stats, pooled, batch: Batch, rng, train: bool):
    inputs = {sc.label_top: batch.label,
              sc.dense_top: batch.dense.astype(sc.compute_dtype)}
    for top, p in zip(sc.emb_tops, pooled):
        inputs[top] = p.astype(sc.compute_dtype)
    model = nnx.merge(sc.graphdef, _cast(params, sc.compute_dtype), batch_stats)
    ctx = Context(train=train, rng=rng, mask=batch.mask.astype(jnp.float32))
    loss, pred = model(inputs, ctx)
    new_stats = nnx.state(model, nnx.BatchStat) if train else batch_stats
    return loss, (pred, new_stats)


def make_eval_step(sc: StepConfig, engine: EmbeddingEngine | None = None):
    """``eval_step(state, batch) -> (loss, prediction)``; never inserts keys."""
    engine = engine or LocalEmbeddings(sc.specs)

    def eval_step(state: TrainState, batch: Batch):
        with jax.default_matmul_precision(sc.matmul_precision):
            _, _, pooled = engine.lookup(state.embeddings, batch, train=False)
            loss, (pred, _) = forward(sc, state.params, state.batch_stats, pooled, batch,
                                       None, False)
            return loss, pred

    return eval_step


def build_model(cfg: ModelConfig, capacities: dict[str, int] | None = None,
                ) -> tuple[StepConfig, Callable[..., TrainState]]:
    """The static step configuration and a function creating the initial :class:`TrainState`
    (``init_state(dense_tx)``: the dense optimizer's state from ``dense_tx.init``, or None
    without one). Separate so that shapes can be inspected without allocating
    (``jax.eval_shape``). ``capacities`` sizes tables by embedding name instead of the
    config's max_vocabulary_size_per_gpu (inference loads exactly the stored keys)."""
    capacities = capacities or {}
    specs = tuple(EmbeddingSpec.from_config(cfg, e, capacities.get(e.name))
                  for e in cfg.embeddings)
    net = build_network(cfg, nnx.Rngs(cfg.solver.seed))
    graphdef, params, batch_stats = nnx.split(net, nnx.Param, ...)
    step_config = StepConfig(
        graphdef=graphdef, specs=specs, emb_tops=tuple(e.top for e in cfg.embeddings),
        label_top=cfg.data.label_top, dense_top=cfg.data.dense_top,
        compute_dtype=COMPUTE_DTYPES[cfg.solver.compute_dtype],
        loss_scale=float(cfg.solver.mixed_precision or 1.0),
        skip_nonfinite=cfg.solver.nan_policy == "skip",
        matmul_precision="tensorfloat32" if cfg.solver.enable_tf32_compute else "float32")

    def init_state(dense_tx=None) -> TrainState:
        return TrainState(
            step=jnp.zeros((), jnp.int64), rng=jax.random.PRNGKey(cfg.solver.seed),
            params=params, batch_stats=batch_stats,
            opt_state=None if dense_tx is None else dense_tx.init(params),
            embeddings=tuple(init_embedding(s) for s in specs),
            lr_scale=jnp.ones((), jnp.float32))

    return step_config, init_state
