"""Embedding layers: a hash table plus values and optimizer rows per embedding, the bag that
pools a slot's keys, and the sparse row update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jctr.config.schema import EmbeddingConfig, ModelConfig, OptimizerConfig
from jctr.embedding import optimizers as row_opt
from jctr.embedding.hash_table import HashTable, Lookup, create_table, lookup
from jctr.ops import embedding_bag_backward, embedding_bag_forward
from jctr.ops.bag import key_gradients


@dataclass(frozen=True)
class EmbeddingSpec:
    """Static description of one embedding (hashable, so it can close over jitted code).

    Example::

        spec = EmbeddingSpec("emb", capacity=1000, dim=8, slot_num=3, max_features=3,
                             one_hot=True, input_index=0, optimizer=OptimizerConfig("SGD"))
    """

    name: str
    capacity: int
    dim: int
    slot_num: int
    max_features: int
    one_hot: bool
    input_index: int
    optimizer: OptimizerConfig
    combiner: str = "sum"
    init_range: float | None = None

    @classmethod
    def from_config(cls, cfg: ModelConfig, emb: EmbeddingConfig) -> EmbeddingSpec:
        idx = next(i for i, s in enumerate(cfg.data.sparse) if s.top == emb.bottom)
        sp = cfg.data.sparse[idx]
        return cls(name=emb.name, capacity=emb.max_vocabulary_size_per_gpu,
                   dim=emb.embedding_vec_size, slot_num=sp.slot_num,
                   max_features=sp.slot_num if sp.one_hot else sp.max_feature_num_per_sample,
                   one_hot=sp.one_hot, input_index=idx, optimizer=cfg.embedding_optimizer(emb),
                   combiner=emb.combiner, init_range=emb.init_range)


class EmbeddingState(NamedTuple):
    table: HashTable
    values: jax.Array  # float32 [capacity, dim]
    slots: dict  # optimizer rows, each [capacity, dim] (LazyGlobal adds last_step [capacity])


def init_embedding(spec: EmbeddingSpec, key: jax.Array) -> EmbeddingState:
    """Values are drawn once up front, so inserting a key costs no initialisation."""
    r = spec.init_range if spec.init_range is not None else 1.0 / float(spec.dim) ** 0.5
    values = jax.random.uniform(key, (spec.capacity, spec.dim), jnp.float32, -r, r)
    return EmbeddingState(create_table(spec.capacity), values,
                          row_opt.init_slots(spec.optimizer, spec.capacity, spec.dim))


def _safe_rows(rows: jax.Array, capacity: int) -> jax.Array:
    # -1 would wrap around in jnp indexing; capacity is out of range and dropped/filled instead.
    return jnp.where(rows >= 0, rows, capacity)


def lookup_rows(spec: EmbeddingSpec, state: EmbeddingState, keys: jax.Array,
                segments: jax.Array, batch_size: int, *, train: bool
                ) -> tuple[EmbeddingState, Lookup]:
    """Rows of a batch's keys, inserting unseen ones when ``train`` (-1: padding, unknown)."""
    valid = segments < batch_size * spec.slot_num
    table, lk = lookup(state.table, keys, valid, spec.capacity, insert=train, dedupe=train)
    return state._replace(table=table), lk


def pool(spec: EmbeddingSpec, values: jax.Array, rows: jax.Array, segments: jax.Array,
         batch_size: int) -> jax.Array:
    """[batch, slot_num, dim]: the combiner over each slot's keys (unknown keys read as 0)."""
    out = embedding_bag_forward(values, rows, segments, batch_size * spec.slot_num,
                                spec.combiner, one_hot=spec.one_hot)
    return out.reshape(batch_size, spec.slot_num, spec.dim)


def apply_gradients(spec: EmbeddingSpec, state: EmbeddingState, lk: Lookup,
                    segments: jax.Array, grad_pooled: jax.Array, lr: jax.Array,
                    count: jax.Array) -> EmbeddingState:
    """Sparse update from the gradient w.r.t. the pooled embeddings [batch, slots, dim]."""
    b = grad_pooled.shape[0]
    n = segments.shape[0]
    flat = grad_pooled.reshape(b * spec.slot_num, spec.dim)
    if spec.optimizer.type == "SGD":
        # SGD's scatter-add sums duplicate rows itself: no per-row summation pass needed
        g = key_gradients(flat, segments, b * spec.slot_num, spec.combiner)
        rows = _safe_rows(lk.rows, spec.capacity)
    else:
        g = embedding_bag_backward(flat, segments, lk.rep, b * spec.slot_num, spec.combiner,
                                   one_hot=spec.one_hot)
        ar = jnp.arange(n, dtype=jnp.int32)
        rows = jnp.where(lk.rep == ar, _safe_rows(lk.rows, spec.capacity), spec.capacity)
    values, slots = row_opt.apply_rows(spec.optimizer, state.values, state.slots, rows, g, lr,
                                       count)
    return state._replace(values=values, slots=slots)
