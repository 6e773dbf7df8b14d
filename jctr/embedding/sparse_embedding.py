"""Embedding layers: a hash table plus values and optimizer rows per embedding, the bag that
pools a slot's keys, and the sparse row update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jctr.config import ConfigError
from jctr.config.schema import EmbeddingConfig, EvictionConfig, ModelConfig, OptimizerConfig
from jctr.embedding import row_optimizers as row_opt
from jctr.embedding.hash_table import (
    HashTable,
    Lookup,
    create_table,
    erase,
    lookup,
    score_function,
)
from jctr.ops import (
    embedding_bag_backward,
    embedding_bag_forward,
    initialize_rows,
    key_uniform,
    row_rule_by_segment,
    sgd_by_segment,
    sum_at_representatives,
)


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
    seed: int = 0  # with the key, determines a new row's initial vector
    l2: float = 0.0  # regularization of touched rows (EmbeddingConfig.l2_lambda)
    l1: float = 0.0
    eviction: EvictionConfig | None = None  # a full table evicts (EmbeddingConfig.eviction)
    l2_all: bool = False  # l2 decays every row every step (EmbeddingConfig.l2_rows "all")

    @property
    def sums_rows(self) -> bool:
        """Whether updates need one summed gradient per distinct row: every optimizer but
        plain SGD (whose scatter-add sums duplicates itself), and any regularized table (a
        row is regularized once per step)."""
        return self.optimizer.type != "SGD" or bool((self.l2 and not self.l2_all) or self.l1)

    @property
    def init_bound(self) -> float:
        return self.init_range if self.init_range is not None else 1.0 / float(self.dim) ** 0.5

    @classmethod
    def from_config(cls, cfg: ModelConfig, emb: EmbeddingConfig,
                    capacity: int | None = None) -> EmbeddingSpec:
        """The spec of ``emb``; ``capacity`` overrides max_vocabulary_size_per_gpu (a table
        loaded for inference holds exactly its stored keys)."""
        idx = next(i for i, s in enumerate(cfg.data.sparse) if s.top == emb.bottom)
        sp = cfg.data.sparse[idx]
        number = [e.name for e in cfg.embeddings].index(emb.name)
        return cls(name=emb.name, capacity=capacity or emb.max_vocabulary_size_per_gpu,
                   dim=emb.embedding_vec_size, slot_num=sp.slot_num,
                   max_features=sp.slot_num if sp.one_hot else sp.max_feature_num_per_sample,
                   one_hot=sp.one_hot, input_index=idx, optimizer=cfg.embedding_optimizer(emb),
                   combiner=emb.combiner, init_range=emb.init_range,
                   seed=cfg.solver.seed * 1000 + number, l2=emb.l2_lambda, l1=emb.l1_lambda,
                   eviction=emb.eviction, l2_all=emb.l2_rows == "all")


def check_score_functions(cfg: ModelConfig) -> None:
    """Import the function of every table that evicts by the caller's scores (``"policy":
    "score"``) now, before training, naming the layer of one that cannot be (serving and
    export never call them: inference does not evict)."""
    for number, emb in enumerate(cfg.embeddings):
        if emb.eviction is None or emb.eviction.policy != "score":
            continue
        try:
            score_function(emb.eviction.score_fn or "")
        except ValueError as e:  # (embedding layers come right after the Data layer)
            raise ConfigError(f"layers[{number + 1}].eviction.score_fn", str(e),
                              cfg.source) from None


class EmbeddingState(NamedTuple):
    table: HashTable
    values: jax.Array  # float32 [capacity, dim]
    slots: dict  # optimizer rows, each [capacity, dim] (LazyGlobal adds last_step [capacity])
    row_slot: jax.Array  # int32 [capacity], the slot whose key created the row (-1: unused)


def init_embedding(spec: EmbeddingSpec) -> EmbeddingState:
    """An empty table. A row gets its initial vector when its key is inserted
    (:func:`jctr.ops.hashing.key_uniform` of the key), so the model does not depend on the
    order keys arrive in or on how tables are placed on devices."""
    capacity = spec.capacity
    return EmbeddingState(create_table(capacity, spec.eviction),
                          jnp.zeros((capacity, spec.dim), jnp.float32),
                          row_opt.init_slots(spec.optimizer, capacity, spec.dim),
                          jnp.full((capacity,), -1, jnp.int32))


def _rep_rows(lk: Lookup, capacity: int) -> jax.Array:
    """Each distinct row once, at its representative position (``capacity`` elsewhere:
    dropped): an optimizer's one update per row."""
    at = jnp.arange(lk.rows.shape[0], dtype=jnp.int32)
    return jnp.where(lk.rep == at, _safe_rows(lk.rows, capacity), capacity)


def _safe_rows(rows: jax.Array, capacity: int) -> jax.Array:
    # -1 would wrap around in jnp indexing; capacity is out of range and dropped/filled instead.
    return jnp.where(rows >= 0, rows, capacity)


def lookup_rows(spec: EmbeddingSpec, state: EmbeddingState, keys: jax.Array,
                segments: jax.Array, batch_size: int, *, train: bool
                ) -> tuple[EmbeddingState, Lookup]:
    """Rows of a batch's keys, inserting unseen ones when ``train`` (-1: padding, unknown)."""
    valid = segments < batch_size * spec.slot_num
    # the segments stand for the slots (lookup_keys): only new rows need theirs
    return lookup_keys(spec, state, keys, valid, segments, train=train)


def lookup_keys(spec: EmbeddingSpec, state: EmbeddingState, keys: jax.Array, valid: jax.Array,
                key_slots: jax.Array, *, train: bool, spill_writes: jax.Array | None = None
                ) -> tuple[EmbeddingState, Lookup]:
    """:func:`lookup_rows` for keys that are not laid out as a batch (e.g. routed to a shard).
    ``key_slots``: each key's input slot, or any number whose remainder by the table's
    ``slot_num`` is (its segment: sample * slot_num + slot); a new row records it.
    ``spill_writes`` (bool scalar): whether this copy of a spilling table writes its evicted
    rows (:func:`jctr.embedding.spill.spill_rows`; default: it does)."""
    capacity = state.values.shape[0]
    dedupe = train and spec.sums_rows
    table, lk = lookup(state.table, keys, valid, capacity, insert=train, dedupe=dedupe,
                       eviction=spec.eviction if train else None)
    state = state._replace(table=table)
    if train:
        spills = spec.eviction is not None and spec.eviction.spill is not None
        if spills:  # evicted rows leave before the new keys' rows overwrite them
            from jctr.embedding import spill

            written = spill.spill_rows(spec, state, lk, spill_writes)
            # the rows below are written in place after the spill read them: the write
            # depends on its token (else XLA copied every table array to keep the rows
            # for the read, ~22 ms a step at 2M rows; an optimization barrier did not do)
            lk = lk._replace(fresh=lk.fresh & (written == 0))
        state = initialize_fresh_rows(spec, state, keys, lk, key_slots)
        if spills:  # new keys the database holds take their rows back
            state = spill.take_back(spec, state, keys, lk, written)
    return state, lk


def erase_keys(spec: EmbeddingSpec, state: EmbeddingState, keys: jax.Array,
               valid: jax.Array) -> tuple[EmbeddingState, jax.Array]:
    """``state`` without ``keys`` (distinct): their slots freed
    (:func:`jctr.embedding.hash_table.erase`) and their rows back to what an unused row holds
    (zero vector, no slot, the optimizer's initial state), so a key that takes such a row later
    starts as in a new table. Returns the state and the number of keys erased."""
    table, rows = erase(state.table, keys, valid)
    capacity = state.values.shape[0]
    at = jnp.where(rows >= 0, rows, capacity)
    fresh = row_opt.init_slots(spec.optimizer, 1, spec.dim)
    slots = {name: arr.at[at].set(jnp.broadcast_to(fresh[name][0], (at.shape[0],)
                                                   + arr.shape[1:]), mode="drop")
             for name, arr in state.slots.items()}
    state = EmbeddingState(table, state.values.at[at].set(0.0, mode="drop"), slots,
                           state.row_slot.at[at].set(-1, mode="drop"))
    return state, jnp.sum(rows >= 0, dtype=jnp.int32)


def initialize_fresh_rows(spec: EmbeddingSpec, state: EmbeddingState, keys: jax.Array,
                          lk: Lookup, key_slots: jax.Array) -> EmbeddingState:
    """Write the initial vector (and slot) of the rows this lookup created; in a table that
    evicts, their optimizer rows start again too (the row may have held another key's).

    On CPU one native pass over the batch for all of it (:func:`jctr.ops.initialize_rows`).
    Elsewhere (a GPU) one scatter of every position's initial vector, the positions that
    created no row dropped: the vectors are a hash of the key, cheap where thousands of
    threads compute them. (Compacted chunks under a ``cond`` went with a copy of the whole
    table in XLA:GPU's step: 2.6 GB of temporaries for a 10M x 64 table,
    ``tests/test_sparse_memory.py`` on an H200.)
    """
    capacity = state.values.shape[0]
    at = jnp.where(lk.fresh & (lk.rows >= 0), lk.rows, capacity)  # new rows; others dropped

    # an evicted key's row held another key's optimizer state: it starts again too
    resets = {}
    if spec.eviction is not None:
        initial = row_opt.init_slots(spec.optimizer, 1, spec.dim)
        resets = {name: (arr, initial[name][0]) for name, arr in state.slots.items()}

    def dense(values, row_slot, keys, _rows, _fresh, key_slots, arrays):
        vectors = initial_vectors(spec, keys)
        if row_opt.admits(spec.optimizer):  # the first dimension only, until admitted
            vectors = vectors.at[:, 1:].set(0.0)
        # one scatter an array, positions that created no row dropped
        reset = {name: arr.at[at].set(jnp.broadcast_to(resets[name][1],
                                                       at.shape + arr.shape[1:]), mode="drop")
                 for name, arr in arrays.items()}
        return (values.at[at].set(vectors, mode="drop"),
                row_slot.at[at].set(key_slots % spec.slot_num, mode="drop"), reset)

    # the native pass takes each new row's slot from its segment (XLA's remainder of the
    # whole batch was ~6 ms of events in a 10-hot step: docs/performance.md)
    values, row_slot, reset = initialize_rows(
        state.values, state.row_slot, keys, lk.rows, lk.fresh, key_slots,
        scales=row_opt.initial_scales(spec.optimizer, spec.dim, spec.init_bound),
        seed=spec.seed, zero_tail=row_opt.admits(spec.optimizer), reference=dense,
        resets=resets, slot_num=spec.slot_num)
    return state._replace(values=values, row_slot=row_slot, slots={**state.slots, **reset})


def initial_vectors(spec: EmbeddingSpec, keys: jax.Array) -> jax.Array:
    """[n, dim]: the initial vector of each key's row."""
    return key_uniform(keys, spec.dim, spec.seed, 1.0) * row_opt.initial_scales(
        spec.optimizer, spec.dim, spec.init_bound)


def pool(spec: EmbeddingSpec, values: jax.Array, rows: jax.Array, segments: jax.Array,
         batch_size: int) -> jax.Array:
    """[batch, slot_num, dim]: the combiner over each slot's keys (unknown keys read as 0)."""
    out = embedding_bag_forward(values, rows, segments, batch_size * spec.slot_num,
                                spec.combiner, one_hot=spec.one_hot)
    return out.reshape(batch_size, spec.slot_num, spec.dim)


def apply_gradients(spec: EmbeddingSpec, state: EmbeddingState, lk: Lookup,
                    segments: jax.Array, grad_pooled: jax.Array, lr: jax.Array,
                    count: jax.Array, keys: jax.Array | None = None,
                    clicks: jax.Array | None = None,
                    shows: jax.Array | None = None) -> EmbeddingState:
    """Sparse update from the gradient w.r.t. the pooled embeddings [batch, slots, dim].
    ``keys`` and ``clicks`` (per looked-up key, 0 / 1) feed admission (see
    :func:`jctr.embedding.row_optimizers.admits`); ``shows`` (per looked-up key) replace one
    show per occurrence where SparseAdaGradSGDRule divides a row's gradient by its shows."""
    b = grad_pooled.shape[0]
    flat = grad_pooled.reshape(b * spec.slot_num, spec.dim)
    if not spec.sums_rows:  # plain SGD: each key's row moves by its segment's gradient
        values, _ = _decay_all(spec, state.values, lr)
        return state._replace(values=sgd_by_segment(
            values, lk.rows, segments, flat, -lr, b * spec.slot_num, spec.combiner))
    if row_opt.steps_bags_natively(spec.optimizer) and not spec.l1 and (
            spec.l2_all or not spec.l2):
        return _rule_by_segment(spec, state, lk, segments, flat, lr, count)
    g = embedding_bag_backward(flat, segments, lk.rep, b * spec.slot_num, spec.combiner,
                               one_hot=spec.one_hot)
    return _apply_rows(spec, state, lk, g, lr, count, keys, clicks, shows)


def _rule_by_segment(spec, state, lk, segments, flat, lr, count) -> EmbeddingState:
    """The optimizer's rule on the bag's distinct rows from the segments' gradients (on CPU
    one native pass: :func:`jctr.ops.row_rule_by_segment`); the same as :func:`_apply_rows`
    on the row sums."""
    values, _ = _decay_all(spec, state.values, lr)
    capacity, num_segments = values.shape[0], flat.shape[0]
    names = row_opt.slot_names(spec.optimizer)

    def reference(values, *states):
        g = embedding_bag_backward(flat, segments, lk.rep, num_segments, spec.combiner,
                                   one_hot=spec.one_hot)
        w, slots = row_opt.apply_rows(spec.optimizer, values, dict(zip(names, states)),
                                      _rep_rows(lk, capacity), g, lr, count)
        return (w, *(slots[name] for name in names))

    values, *states = row_rule_by_segment(
        spec.optimizer.type, (values, *(state.slots[name] for name in names)), lk.rows,
        lk.rep, segments, flat, row_opt.rule_params(spec.optimizer, lr, count), num_segments,
        spec.combiner, reference)
    return state._replace(values=values, slots={**state.slots, **dict(zip(names, states))})


def apply_key_gradients(spec: EmbeddingSpec, state: EmbeddingState, lk: Lookup,
                        g_keys: jax.Array, lr: jax.Array, count: jax.Array,
                        keys: jax.Array | None = None,
                        clicks: jax.Array | None = None,
                        shows: jax.Array | None = None) -> EmbeddingState:
    """Sparse update from one gradient per looked-up key [n, dim] (duplicates are summed);
    ``keys``, ``clicks`` and ``shows`` as in :func:`apply_gradients`."""
    if spec.sums_rows:
        g_keys = sum_at_representatives(g_keys, lk.rep)
    return _apply_rows(spec, state, lk, g_keys, lr, count, keys, clicks, shows)


def _apply_rows(spec, state, lk, g, lr, count, keys=None, clicks=None,
                shows=None) -> EmbeddingState:
    capacity = state.values.shape[0]
    rows = _rep_rows(lk, capacity) if spec.sums_rows else _safe_rows(lk.rows, capacity)
    occurrences = None
    if spec.optimizer.type == "SparseAdaGradSGDRule":  # its gradient is per pushed show
        per_key = (lk.rep >= 0).astype(jnp.float32)
        if shows is not None:  # a show column (Paddle's push_show); 0 shows: no division
            per_key = per_key * shows.astype(jnp.float32)
        occurrences = sum_at_representatives(per_key[:, None], lk.rep)[:, 0]
    admitted = None
    if row_opt.admits(spec.optimizer):
        if keys is None or clicks is None:
            raise ValueError(f"embedding \"{spec.name}\": admission needs the keys and clicks "
                             "of the batch")
        admitted = state.slots["accessor"].at[rows, 2].get(mode="fill", fill_value=0.0)
        g = g.at[:, 1:].multiply(admitted[:, None])  # embedx trains once admitted
    values, l2 = _decay_all(spec, state.values, lr)
    values, slots = row_opt.apply_rows(spec.optimizer, values, state.slots, rows, g, lr,
                                       count, l2=l2, l1=spec.l1, occurrences=occurrences)
    if admitted is not None:
        values, slots = _admit(spec, values, slots, rows, admitted, occurrences, keys,
                               sum_at_representatives(clicks.astype(jnp.float32)[:, None],
                                                      lk.rep)[:, 0])
    return state._replace(values=values, slots=slots)


def _decay_all(spec, values, lr) -> tuple[jax.Array, float]:
    """(values, the l2 left for the touched rows): with ``l2_rows: all`` every row decays, as
    the penalty's gradient l2 * w moves it (in place), and none is left."""
    if spec.l2_all:
        return values * (1.0 - lr * spec.l2).astype(values.dtype), 0.0
    return values, spec.l2


def _admit(spec, values, slots, rows, admitted, shows, keys, clicks):
    """Count the batch's shows and clicks per row; rows whose score reaches
    ``embedx_threshold`` now get their embedx dimensions' initial values."""
    opt = spec.optimizer
    acc = slots["accessor"].at[rows].get(mode="fill", fill_value=0.0)
    show, click = acc[:, 0] + shows, acc[:, 1] + clicks
    score = opt.click_coeff * click + opt.nonclk_coeff * (show - click)
    now = (admitted > 0) | (score >= opt.embedx_threshold)
    newly = now & (admitted == 0)
    init = initial_vectors(spec, keys)
    capacity = values.shape[0]
    values = values.at[jnp.where(newly, rows, capacity), 1:].set(init[:, 1:], mode="drop")
    acc = jnp.stack([show, click, now.astype(jnp.float32)], axis=1)
    return values, {**slots, "accessor": slots["accessor"].at[rows].set(acc, mode="drop")}
