"""Embedding lookups and sparse updates for tables placed over a device mesh.

Inside ``jax.shard_map`` every device holds ``b = B / D`` samples of the batch and its part of
each table. For a sharded table (``localized`` or ``distributed``):

1. each key's owner is computed (slot -> device, or key hash -> device), keys and their
   (sample, slot) segment ids are packed into ``[D, n]`` send buffers (row ``o`` for device
   ``o``; ``n`` is the local key count, so even a batch whose keys all belong to one device
   fits) and exchanged with ``jax.lax.all_to_all``;
2. the owner looks the keys up in its hash table (inserting unseen ones when training), sums
   the vectors per requester segment and sends the ``[D, b * slot_num, dim]`` partial sums back
   with a second all-to-all; the requester adds the partial sums of all owners (HugeCTR's
   reduce-scatter of the pooled output, in all-to-all form);
3. in the backward pass the segment gradients go to every owner (``all_gather``); each owner
   gives every key it served its segment's gradient and applies the row-wise optimizer to the
   distinct rows.

A replicated table is looked up on every device with the keys of all devices (``all_gather``),
so all copies insert the same keys into the same rows and apply the same updates.

The dense network is data parallel through the jitted step's shardings (batch split over the
mesh axis, parameters replicated), so its gradients are averaged over the whole batch by XLA.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jctr.embedding.engine import segment_clicks, segment_shows, spilled_pool
from jctr.embedding.hash_table import Lookup
from jctr.embedding.row_optimizers import admits
from jctr.embedding.sparse_embedding import (
    EmbeddingSpec,
    EmbeddingState,
    apply_key_gradients,
    init_embedding,
    lookup_keys,
    pool,
)
from jctr.ops import EMPTY_KEY, gather_rows, key_gradients, owner_shards, owner_shards_host
from jctr.sharding.mesh import AXIS
from jctr.sharding.plan import Placement


def _squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _expand(tree):
    return jax.tree.map(lambda x: x[None], tree)


def local_segments(segments: jax.Array, device: jax.Array, b: int, slot_num: int) -> jax.Array:
    """Global segment ids (``sample * slot_num + slot`` over the whole batch) of one device's
    keys -> ids within its ``b`` samples; padding -> ``b * slot_num``."""
    lo = device * (b * slot_num)
    inside = (segments >= lo) & (segments < lo + b * slot_num)
    return jnp.where(inside, segments - lo, b * slot_num).astype(jnp.int32)


def globalize_segments(batch, slot_nums: tuple[int, ...], process_index: int,
                       process_count: int):
    """A process's share of the global batch (host numpy): its segment ids, counted within the
    share, become ids within the whole batch (padding -> the global padding id).
    ``slot_nums`` has the slot count of every sparse input."""
    b = batch.label.shape[0]
    segs = []
    for seg, slot_num in zip(batch.segments, slot_nums):
        local_pad = b * slot_num
        seg = np.where(seg < local_pad, seg + process_index * local_pad,
                       process_count * local_pad).astype(np.int32)
        segs.append(seg)
    return batch._replace(segments=tuple(segs))


def owners(placement: Placement, keys: jax.Array, segments: jax.Array, valid: jax.Array,
           slot_num: int) -> jax.Array:
    """The device owning each key (``num_shards`` for padding)."""
    d = placement.num_shards
    if placement.kind == "localized":
        table = jnp.asarray(placement.slot_owner, jnp.int32)
        own = table[jnp.clip(segments % slot_num, 0, slot_num - 1)]
    else:
        own = owner_shards(keys, d)
    return jnp.where(valid, own, d)


def send_positions(owner: jax.Array, num_shards: int) -> jax.Array:
    """Each key's position in its owner's row of the send buffer (order of appearance)."""
    onehot = (owner[:, None] == jnp.arange(num_shards, dtype=jnp.int32)[None, :])
    ranks = jnp.cumsum(onehot.astype(jnp.int32), axis=0) - 1
    return jnp.take_along_axis(ranks, jnp.clip(owner, 0, num_shards - 1)[:, None], axis=1)[:, 0]


def _exchange(x: jax.Array) -> jax.Array:
    """Row ``o`` of ``x`` goes to device ``o``; row ``s`` of the result came from device ``s``."""
    return jax.lax.all_to_all(x, AXIS, 0, 0, tiled=False)


class ShardedEmbeddings:
    """Lookups and updates of all embeddings of a model on a one-axis mesh.

    State layout: a sharded table's arrays carry a leading device axis ``[D, ...]`` split over
    the mesh; a replicated table has the single-device layout on every device.

    Example::

        engine = ShardedEmbeddings(mesh, specs, plan.placements)
        embs = engine.init()
        embs, res, pooled = engine.lookup(embs, batch, train=True)
        embs = engine.apply(embs, res, batch, grads_of_pooled, lrs, count)
    """

    def __init__(self, mesh: Mesh, specs: tuple[EmbeddingSpec, ...],
                 placements: tuple[Placement, ...], capacity_factor: float | None = None):
        self.mesh = mesh
        self.specs = specs
        self.placements = placements
        self.num_devices = mesh.devices.size
        # None: send buffers hold every local key for every device (fits any batch); a factor
        # f sizes each destination's buffer at f * n / D keys, and :meth:`fits` says whether a
        # batch's routing fits them
        self.capacity_factor = capacity_factor
        self.state_specs = tuple(P(AXIS) if p.sharded else P() for p in placements)
        # each process's first device (a replicated spilling table's copies evict alike: one
        # a process writes its database)
        devices = list(mesh.devices.flat)
        firsts = {}
        for i, d in enumerate(devices):
            firsts.setdefault(d.process_index, i)
        self._first_of_process = np.array([firsts[d.process_index] == i
                                           for i, d in enumerate(devices)])

    # ---- state ---------------------------------------------------------------------------

    def init_one(self, spec: EmbeddingSpec, placement: Placement) -> EmbeddingState:
        """An empty table in this placement's layout (use under ``jit`` with out shardings)."""
        es = init_embedding(spec)
        if placement.sharded:
            es = jax.tree.map(lambda x: jnp.broadcast_to(x, (self.num_devices,) + x.shape), es)
        return es

    def init(self) -> tuple[EmbeddingState, ...]:
        """Every table, empty, in its placement's layout (jit with :meth:`shardings`)."""
        return tuple(self.init_one(s, p) for s, p in zip(self.specs, self.placements))

    def shardings(self) -> tuple[NamedSharding, ...]:
        return tuple(NamedSharding(self.mesh, s) for s in self.state_specs)

    def buffer_rows(self, local_keys: int) -> int:
        """Keys per destination in the send buffers, for ``local_keys`` keys per device."""
        if self.capacity_factor is None:
            return local_keys
        return min(local_keys, max(1, math.ceil(self.capacity_factor * local_keys
                                                / self.num_devices)))

    def fits(self, batch, devices: int | None = None) -> bool:
        """Whether every key of a host batch fits its destination's send buffer.

        ``batch`` is the part of the global batch the first ``devices`` devices (default: all)
        hold, with segment ids counted within that part; host numpy, vectorised."""
        if self.capacity_factor is None:
            return True
        d = self.num_devices
        local_devices = devices or d
        for spec, pl in zip(self.specs, self.placements):
            if not pl.sharded:
                continue
            keys = np.asarray(batch.keys[spec.input_index])
            segs = np.asarray(batch.segments[spec.input_index])
            n = keys.shape[0] // local_devices
            valid = batch.key_mask(spec.input_index, spec.slot_num)
            if pl.kind == "localized":
                owner = np.asarray(pl.slot_owner, np.int64)[np.where(valid, segs, 0)
                                                            % spec.slot_num]
            else:
                owner = owner_shards_host(keys, d).astype(np.int64)
            device = np.arange(keys.shape[0]) // n
            cell = np.where(valid, device * d + owner, local_devices * d)
            counts = np.bincount(cell, minlength=local_devices * d + 1)[:-1]
            if counts.size and counts.max() > self.buffer_rows(n):
                return False
        return True

    # ---- lookup --------------------------------------------------------------------------

    def _inputs(self, batch):
        keys = tuple(batch.keys[s.input_index] for s in self.specs)
        segs = tuple(batch.segments[s.input_index] for s in self.specs)
        return keys, segs

    def lookup(self, embs, batch, *, train: bool):
        """(embeddings, residuals for :meth:`apply`, pooled [B, slot_num, dim] per embedding).

        With ``train`` unseen keys are inserted; otherwise they read as zeros and the returned
        embeddings are the ones passed in."""
        b = batch.label.shape[0] // self.num_devices
        keys, segs = self._inputs(batch)

        def local(embs, keys, segs):
            dev = jax.lax.axis_index(AXIS)
            out_embs, out_res, out_pooled = [], [], []
            for spec, pl, es, k, sg in zip(self.specs, self.placements, embs, keys, segs):
                sg = local_segments(sg, dev, b, spec.slot_num)
                if pl.kind == "replicated":
                    writer = jnp.asarray(self._first_of_process)[dev]
                    es, res, pooled = _replicated_lookup(spec, es, k, sg, b, dev, train, writer)
                else:
                    es, res, pooled = _routed_lookup(spec, pl, _squeeze(es), k, sg, b, train,
                                                     self.buffer_rows(k.shape[0]))
                    es = _expand(es)
                out_embs.append(es)
                out_res.append(_expand(res))
                out_pooled.append(pooled)
            return tuple(out_embs), tuple(out_res), tuple(out_pooled)

        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(self.state_specs, P(AXIS), P(AXIS)),
                           out_specs=(self.state_specs, P(AXIS), P(AXIS)), check_vma=False)
        new_embs, res, pooled = fn(embs, keys, segs)
        return (new_embs if train else embs), res, pooled

    # ---- update --------------------------------------------------------------------------

    def apply(self, embs, residuals, batch, grads, lrs, count):
        """Route every key's gradient (from the gradients of the pooled outputs) to its owner
        and apply the row-wise optimizers."""
        b = batch.label.shape[0] // self.num_devices
        _, segs = self._inputs(batch)

        def local(embs, residuals, segs, grads, lrs, count, label, dense):
            dev = jax.lax.axis_index(AXIS)
            out = []
            for spec, pl, es, res, sg, g, lr in zip(self.specs, self.placements, embs,
                                                    residuals, segs, grads, lrs):
                sg = local_segments(sg, dev, b, spec.slot_num)
                nseg = b * spec.slot_num
                flat = g.reshape(nseg, spec.dim).astype(jnp.float32)
                res = _squeeze(res)
                admission = admits(spec.optimizer)
                if pl.kind == "replicated":
                    rows, rep, keys = res
                    g_keys = key_gradients(flat, sg, nseg, spec.combiner)
                    g_all = jax.lax.all_gather(g_keys, AXIS, tiled=True)
                    clicks = shows = None
                    if admission:  # every key's click, gathered like its gradient
                        clicks = jax.lax.all_gather(
                            segment_clicks(label, spec.slot_num)[sg], AXIS, tiled=True)
                    if spec.optimizer.show is not None:  # and its show, the same way
                        shows = jax.lax.all_gather(
                            segment_shows(label, dense, spec)[sg], AXIS, tiled=True)
                    es = apply_key_gradients(spec, es, _lookup(rows, rep), g_all, lr, count,
                                             keys, clicks, shows)
                else:
                    target, rows, rep, keys = res
                    if spec.combiner == "mean":
                        flat = flat / jnp.maximum(_segment_counts(sg, nseg), 1.0)[:, None]
                    # every owner gets every requester's segment gradients, then each key
                    # it served picks its segment's
                    g_all = jax.lax.all_gather(flat, AXIS, tiled=True)  # [D * nseg, dim]
                    g_keys = g_all.at[target].get(mode="fill", fill_value=0.0)
                    clicks = shows = None
                    if admission:  # the click of each served key's segment, the same way
                        all_clicks = jax.lax.all_gather(
                            segment_clicks(label, spec.slot_num)[:nseg], AXIS, tiled=True)
                        clicks = all_clicks.at[target].get(mode="fill", fill_value=0.0)
                    if spec.optimizer.show is not None:  # and its show
                        all_shows = jax.lax.all_gather(
                            segment_shows(label, dense, spec)[:nseg], AXIS, tiled=True)
                        shows = all_shows.at[target].get(mode="fill", fill_value=0.0)
                    es = _expand(apply_key_gradients(spec, _squeeze(es), _lookup(rows, rep),
                                                     g_keys, lr, count,
                                                     keys, clicks, shows))
                out.append(es)
            return tuple(out)

        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(self.state_specs, P(AXIS), P(AXIS), P(AXIS), P(), P(),
                                     P(AXIS), P(AXIS)),
                           out_specs=self.state_specs, check_vma=False)
        return fn(embs, residuals, segs, tuple(grads), tuple(lrs), count, batch.label,
                  batch.dense)


def _lookup(rows, rep) -> Lookup:
    return Lookup(rows=rows, rep=rep, fresh=jnp.zeros(rows.shape, bool))


def _segment_counts(segs, num_segments: int):
    return jax.ops.segment_sum(jnp.ones(segs.shape, jnp.float32), segs,
                               num_segments=num_segments)


def _routed_lookup(spec: EmbeddingSpec, pl: Placement, es: EmbeddingState, keys, segs, b: int,
                   train: bool, rows_per_device: int):
    d = pl.num_shards
    n = rows_per_device  # send buffer rows per destination (all local keys, or fewer)
    nseg = b * spec.slot_num
    valid = segs < nseg
    owner = owners(pl, keys, segs, valid, spec.slot_num)
    rank = send_positions(owner, d)
    send_keys = jnp.full((d, n), EMPTY_KEY, jnp.int64).at[owner, rank].set(keys, mode="drop")
    send_segs = jnp.full((d, n), nseg, jnp.int32).at[owner, rank].set(segs, mode="drop")
    recv_keys = _exchange(send_keys).reshape(-1)
    recv_segs = _exchange(send_segs).reshape(-1)
    recv_valid = recv_segs < nseg
    es, lk = lookup_keys(spec, es, recv_keys, recv_valid, recv_segs, train=train)
    vectors = gather_rows(es.values, lk.rows)
    if not train and _spills(spec):  # keys the table lost are read from the spill database
        from jctr.embedding import spill

        vectors = vectors + spill.stored_vectors(spec, recv_keys,
                                                 (lk.rows < 0) & recv_valid)
    # The owner sums the vectors of each requester's (sample, slot) it holds and sends back
    # one partial sum per segment: for multi-hot bags this moves `hot` times less than
    # returning every key's vector, and the gradient comes back per segment the same way.
    source = jnp.arange(d * n, dtype=jnp.int32) // n
    target = jnp.where(recv_valid, source * nseg + recv_segs, d * nseg)
    partial = jax.ops.segment_sum(vectors, target,
                                  num_segments=d * nseg)
    pooled = _exchange(partial.reshape(d, nseg, spec.dim)).sum(axis=0)
    if spec.combiner == "mean":
        pooled = pooled / jnp.maximum(_segment_counts(segs, nseg), 1.0)[:, None]
    keys_kept = recv_keys if admits(spec.optimizer) else None  # admission initializes by key
    return es, (target, lk.rows, lk.rep, keys_kept), pooled.reshape(b, spec.slot_num,
                                                                    spec.dim)


def _spills(spec: EmbeddingSpec) -> bool:
    return spec.eviction is not None and spec.eviction.spill is not None


def _replicated_lookup(spec: EmbeddingSpec, es: EmbeddingState, keys, segs, b: int, dev,
                       train: bool, writer):
    n = keys.shape[0]
    valid = segs < b * spec.slot_num
    if not train:  # every copy is complete: look up locally
        _, lk = lookup_keys(spec, es, keys, valid, segs, train=False)
        pooled = pool(spec, es.values, lk.rows, segs, b)
        if _spills(spec):  # and keys the table lost in the spill database
            pooled = pooled + spilled_pool(spec, es, keys, lk.rows, segs, b)
        return es, (lk.rows, lk.rep, None), pooled
    all_keys = jax.lax.all_gather(keys, AXIS, tiled=True)
    all_valid = jax.lax.all_gather(valid, AXIS, tiled=True)
    all_slots = jax.lax.all_gather(segs, AXIS, tiled=True)  # (slots: see lookup_keys)
    # every copy evicts the same keys: each process's first device writes their rows to its
    # spill database
    es, lk = lookup_keys(spec, es, all_keys, all_valid, all_slots, train=train,
                         spill_writes=writer)
    rows = jax.lax.dynamic_slice_in_dim(lk.rows, dev * n, n)
    keys_kept = all_keys if admits(spec.optimizer) else None
    return es, (lk.rows, lk.rep, keys_kept), pool(spec, es.values, rows, segs, b)
