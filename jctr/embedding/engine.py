"""Embedding engines: the lookups and row updates of all tables of a model. The one-device
engine lives here; :class:`jctr.sharding.ShardedEmbeddings` implements the same protocol on a
device mesh.

Example::

    engine = LocalEmbeddings(specs)
    embs, lookups, pooled = engine.lookup(state.embeddings, batch, train=True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import jax.numpy as jnp

from jctr.config.schema import column_ref
from jctr.embedding.row_optimizers import admits
from jctr.embedding.sparse_embedding import (
    EmbeddingSpec,
    apply_gradients,
    lookup_rows,
    pool,
)

if TYPE_CHECKING:  # annotations only: the models and tables do not read files
    from jctr.data.batch import Batch


class EmbeddingEngine(Protocol):
    """What a train or eval step needs from the embedding tables."""

    def lookup(self, embs, batch: Batch, *, train: bool) -> tuple[Any, Any, tuple]:
        """``(tables, lookups, pooled)``: tables with new keys inserted (``train``), what
        ``apply`` needs, and the pooled vectors [batch, slots, dim] per table."""

    def apply(self, embs, lookups, batch: Batch, grads, lrs, count) -> tuple:
        """Tables after the sparse row update from the gradients of the pooled vectors."""


class LocalEmbeddings:
    """Lookups and updates of all embeddings on one device (:class:`EmbeddingEngine`)."""

    def __init__(self, specs: tuple[EmbeddingSpec, ...]):
        self.specs = specs

    def lookup(self, embs, batch: Batch, *, train: bool):
        b = batch.label.shape[0]
        new_embs, lookups, pooled = [], [], []
        for spec, es in zip(self.specs, embs):
            segs = batch.segments[spec.input_index]
            keys = batch.keys[spec.input_index]
            es, lk = lookup_rows(spec, es, keys, segs, b, train=train)
            new_embs.append(es)
            lookups.append(lk)
            pooled.append(pool(spec, es.values, lk.rows, segs, b))
            if not train and spec.eviction is not None and spec.eviction.spill:
                pooled[-1] = pooled[-1] + spilled_pool(spec, es, keys, lk.rows, segs, b)
        return (tuple(new_embs) if train else embs), tuple(lookups), tuple(pooled)

    def apply(self, embs, lookups, batch: Batch, grads, lrs, count):
        out = []
        for spec, es, lk, g, lr in zip(self.specs, embs, lookups, grads, lrs):
            segs = batch.segments[spec.input_index]
            keys = clicks = None
            if admits(spec.optimizer):  # per key: its sample's click
                keys = batch.keys[spec.input_index]
                clicks = segment_clicks(batch.label, spec.slot_num)[segs]
            shows = None
            if spec.optimizer.show is not None:  # per key: its sample's show
                shows = segment_shows(batch.label, batch.dense, spec)[segs]
            out.append(apply_gradients(spec, es, lk, segs, g.astype(jnp.float32), lr, count,
                                       keys, clicks, shows))
        return tuple(out)


def spilled_pool(spec, es, keys, rows, segs, b):
    """The pooled vectors of the keys an evaluation did not find in the table (``rows`` -1)
    but the spill database holds (the mean combiner counts every key of a segment either
    way)."""
    from jctr.embedding import spill

    missing = (rows < 0) & (segs < b * spec.slot_num)
    return pool(spec, spill.stored_vectors(spec, keys, missing),
                jnp.arange(keys.shape[0], dtype=jnp.int32), segs, b)


def _segment_column(label, dense, column: tuple[str, int], slot_num: int):
    """[batch * slot_num + 1] float32: each (sample, slot) segment's value of a sample column
    (a label column counts 1 where above 0.5), and 0 for the padding segment id."""
    kind, index = column
    source = label if kind == "label" else dense
    col = source.reshape(source.shape[0], -1)[:, index].astype(jnp.float32)
    if kind == "label":
        col = (col > 0.5).astype(jnp.float32)
    return jnp.append(jnp.repeat(col, slot_num), 0.0)


def segment_clicks(label, slot_num: int):
    """Each segment's click: the first label column (see :func:`_segment_column`)."""
    return _segment_column(label, None, ("label", 0), slot_num)


def segment_shows(label, dense, spec: EmbeddingSpec):
    """Each segment's show, from the column ``spec.optimizer.show`` names, as streaming
    training's statistics count it (see :func:`_segment_column`)."""
    return _segment_column(label, dense, column_ref(spec.optimizer.show), spec.slot_num)
