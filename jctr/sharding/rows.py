"""A table's rows to and from the host, wherever the table is placed: the one module that moves
rows (checkpoints, model files, streaming training's working set and shrink, the Kafka
publisher all go through it).

Tables are stored by key (not by device or hash slot), so that any table capacity and, with
sharding, any number of devices can load them.

A stored table is a dict of host arrays ordered by row: ``keys`` int64 [n], ``values`` float32
[n, dim], ``slot`` int32 [n] (the input slot of each key: slot-wise placement needs it) and one
[n, dim] array per optimizer slot (``last_step`` [n] for LazyGlobal).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jctr.embedding.hash_table import (
    export_items,
    lookup,
    rebuild_slots,
    scores_by_row,
    with_layout,
    with_row_scores,
)
from jctr.embedding.sparse_embedding import (
    EmbeddingSpec,
    EmbeddingState,
    erase_keys,
    init_embedding,
)
from jctr.ops import owner_shards_host
from jctr.ops.host_sort import isin
from jctr.sharding.mesh import to_host

_INSERT_CHUNK = 1 << 18


def export_table(state: EmbeddingState, *, copy: bool = True) -> dict[str, np.ndarray]:
    """The used rows of a table, ordered by row. ``copy`` False: rows 0..n-1 of host arrays
    come as views of them (for a caller that is done with them before the table changes)."""
    keys, rows = export_items(state.table)
    return _rows_of(state, keys, rows, copy=copy)


def _rows_of(state: EmbeddingState, keys: np.ndarray, rows: np.ndarray, *, copy: bool = True
             ) -> dict[str, np.ndarray]:
    """A stored-table dict of ``keys`` held at ``rows``: vectors, slot ids, optimizer rows."""
    # rows 0 .. n-1 (a table that never freed one): leading slices, not a gather
    leading = rows.size and int(rows[0]) == 0 and int(rows[-1]) == rows.size - 1 and \
        bool(np.all(np.diff(rows) == 1))
    idx = None

    def take(arr) -> np.ndarray:
        nonlocal idx
        if isinstance(arr, np.ndarray):  # on the host already: no trip through a device
            if leading:
                return arr[: rows.size].copy() if copy else arr[: rows.size]
            return np.take(arr, rows, axis=0)
        if idx is None:
            # padded to a power of two: a run that exports every pass (streaming) compiles
            # a gather for a few sizes, not one for each table size it meets (each compiled
            # program stays in memory for the life of the process)
            idx = np.zeros(1 << max(0, int(rows.size) - 1).bit_length(), np.int32)
            idx[:rows.size] = rows
            idx = jnp.asarray(idx)
        return np.asarray(jnp.take(arr, idx, axis=0))[:rows.size]

    out = {"keys": keys, "values": take(state.values), "slot": take(state.row_slot)}
    for name, arr in state.slots.items():
        out[name] = take(arr)
    if state.table.slot_score.shape[0]:  # eviction's ranking goes with the rows
        out[EVICTION_SCORE] = scores_by_row(state.table, rows, state.values.shape[0])
    return out


# the stored name of a table's eviction scores (int32 [n, columns]: last step, touches)
EVICTION_SCORE = "eviction_score"


_insert = jax.jit(lambda table, keys, valid, capacity: lookup(table, keys, valid, capacity,
                                                              insert=True),
                  static_argnums=3, donate_argnums=0)


_set_rows = jax.jit(lambda arr, rows, data: arr.at[rows].set(data, mode="drop"),
                    donate_argnums=0)
# an empty table written over a donated one: its buffers are reused (same shapes and types;
# kept as parameters although unread, or XLA would allocate the outputs afresh)
_emptied = jax.jit(lambda spec, state: init_embedding(spec), static_argnums=0,
                   donate_argnums=1, keep_unused=True)


_find = jax.jit(lambda table, keys, valid, capacity: lookup(table, keys, valid, capacity,
                                                            insert=False)[1].rows,
                static_argnums=3)


def export_keys(state: EmbeddingState, keys: np.ndarray, placement=None
                ) -> dict[str, np.ndarray]:
    """:func:`export_placed` of only ``keys`` (those the table holds; in ``keys``' order on
    one device, grouped by device when sharded): the keys are looked up where they live and
    only their rows reach the host, never a whole table (a delta save needs a part of it)."""
    keys = np.asarray(keys, np.int64)
    if jax.process_count() > 1:  # other processes' shards are not addressable here
        stored = export_placed(state, placement)
        keep = isin(stored["keys"], keys)
        return {name: arr[keep] for name, arr in stored.items()}
    if placement is None or not placement.sharded:
        return _lookup_rows(state, keys)
    return _shards_rows(state, keys, placement, range(placement.num_shards))


def export_own_keys(state: EmbeddingState, keys: np.ndarray, placement=None, *,
                    keys_only: bool = False) -> dict[str, np.ndarray]:
    """The rows of ``keys`` this process holds: of a sharded table, those in the shards on
    its devices (every process exports its own: together each row once); of a table every
    device holds whole, process 0's. A multi-process run's Kafka publisher sends these.
    ``keys_only``: just ``{"keys": ...}``, no row leaves the device."""
    keys = np.asarray(keys, np.int64)
    if placement is None or not placement.sharded:
        mine = keys if jax.process_index() == 0 else keys[:0]
        return _lookup_rows(jax.tree.map(_first_local, state), mine, keys_only)
    return _shards_rows(state, keys, placement, _own_shards(state), keys_only)


def own_held_keys(state: EmbeddingState, placement=None) -> np.ndarray:
    """Every key of the part of a table :func:`export_own_keys` gives this process; keys
    only: no row leaves the device (the slot arrays do)."""
    if placement is None or not placement.sharded:
        if jax.process_index() != 0:
            return np.zeros(0, np.int64)
        return export_items(jax.tree.map(_first_local, state.table))[0]
    return np.concatenate([export_items(jax.tree.map(lambda x, j=j: _shard(x, j),
                                                     state.table))[0]
                           for j in _own_shards(state)])


def _own_shards(state: EmbeddingState) -> list[int]:
    """The parts of a sharded table on this process's devices."""
    return sorted({s.index[0].start or 0 for s in state.values.addressable_shards})


def _first_local(x: jax.Array) -> jax.Array:
    """An array every device holds whole, from this process's first device."""
    return x if jax.process_count() == 1 else x.addressable_shards[0].data


def _shard(x: jax.Array, j: int) -> jax.Array:
    """Shard ``j`` (axis 0: a sharded table's devices) of ``x``, from this process."""
    if jax.process_count() == 1:
        return x[j]
    return next(s.data for s in x.addressable_shards if (s.index[0].start or 0) == j)[0]


def _shards_rows(state: EmbeddingState, keys: np.ndarray, placement, shards,
                 keys_only: bool = False) -> dict[str, np.ndarray]:
    """``keys``' rows from ``shards`` of a sharded table, each key looked up on the device
    that owns it (slot-wise tables: on each, a key's device follows its slot)."""
    owner = (None if placement.kind == "localized"
             else owner_shards_host(keys, placement.num_shards))
    parts = [_lookup_rows(jax.tree.map(lambda x, j=j: _shard(x, j), state),
                          keys if owner is None else keys[owner == j], keys_only)
             for j in shards]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _lookup_rows(state: EmbeddingState, keys: np.ndarray, keys_only: bool = False
                 ) -> dict[str, np.ndarray]:
    """The stored rows of those of ``keys`` a one-device table holds, in ``keys``' order
    (``keys_only``: those keys alone)."""
    capacity = state.values.shape[0]
    rows = np.empty(keys.size, np.int32)
    for start in range(0, keys.size, _INSERT_CHUNK):
        chunk = keys[start:start + _INSERT_CHUNK]
        pad = np.zeros(_INSERT_CHUNK, np.int64)
        pad[:chunk.size] = chunk
        valid = np.arange(_INSERT_CHUNK) < chunk.size
        rows[start:start + chunk.size] = np.asarray(
            _find(state.table, jnp.asarray(pad), jnp.asarray(valid), capacity))[:chunk.size]
    held = rows >= 0
    if keys_only:
        return {"keys": keys[held]}
    return _rows_of(state, keys[held], rows[held])


def import_table(spec: EmbeddingSpec, state: EmbeddingState,
                 stored: dict[str, np.ndarray], *, source: str = "<table>",
                 owned: bool = False) -> EmbeddingState:
    """Insert stored keys into ``state`` (normally freshly initialised) and set their rows.

    Keys go in in stored order, so an empty table gives them rows 0..n-1 again: a restored
    run continues exactly. Rows of keys not stored keep ``state``'s values. ``owned``: the
    state's arrays are the caller's copies, written in place (no copy of a whole table).
    """
    keys = np.asarray(stored["keys"], np.int64)
    values = np.asarray(stored["values"], np.float32)
    n = keys.shape[0]
    if values.shape != (n, spec.dim):
        raise ValueError(f"{source}: embedding \"{spec.name}\" expects values of shape "
                         f"({n}, {spec.dim}), got {values.shape}")
    if n > spec.capacity:
        raise ValueError(f"{source}: {n} keys do not fit embedding \"{spec.name}\" of capacity "
                         f"{spec.capacity} (max_vocabulary_size_per_gpu)")
    table = state.table
    rows = np.empty(n, np.int32)
    for start in range(0, n, _INSERT_CHUNK):
        chunk = keys[start:start + _INSERT_CHUNK]
        pad = np.zeros(_INSERT_CHUNK, np.int64)
        pad[:chunk.size] = chunk
        valid = np.arange(_INSERT_CHUNK) < chunk.size
        table, lk = _insert(table, jnp.asarray(pad), jnp.asarray(valid), spec.capacity)
        rows[start:start + chunk.size] = np.asarray(lk.rows)[:chunk.size]
    if (rows < 0).any():
        raise ValueError(f"{source}: embedding \"{spec.name}\" could not place every key")
    taken = np.zeros(state.values.shape[0], bool)  # rows marked, not sorted (millions)
    taken[rows] = True
    if np.count_nonzero(taken) != n:
        raise ValueError(f"{source}: embedding \"{spec.name}\" holds duplicate keys")

    def put(arr, data):  # rows written in fixed chunks: one compile per table shape
        if not owned:  # the caller's array stays as it is
            arr = jnp.array(arr, copy=True)
        for start in range(0, n, _INSERT_CHUNK):
            at = np.full(_INSERT_CHUNK, arr.shape[0], np.int32)  # beyond: dropped
            part = np.zeros((_INSERT_CHUNK, *arr.shape[1:]), arr.dtype)
            m = min(_INSERT_CHUNK, n - start)
            at[:m], part[:m] = rows[start:start + m], data[start:start + m]
            arr = _set_rows(arr, jnp.asarray(at), jnp.asarray(part))
        return arr

    new_values = put(state.values, values)
    new_slots = {}
    for name, arr in state.slots.items():
        if name in stored:
            data = np.asarray(stored[name], arr.dtype)
            if data.shape != (n, *arr.shape[1:]):
                raise ValueError(f"{source}: embedding \"{spec.name}\" optimizer state "
                                 f"\"{name}\" has shape {data.shape}, expected "
                                 f"{(n, *arr.shape[1:])}")
            new_slots[name] = put(arr, data)
        else:  # warm start from files without optimizer state: fresh optimizer rows
            new_slots[name] = arr
    row_slot = state.row_slot
    if "slot" in stored:
        row_slot = put(row_slot, np.asarray(stored["slot"], np.int32))
    if table.slot_score.shape[0] and EVICTION_SCORE in stored:
        score = np.asarray(stored[EVICTION_SCORE], np.int32)
        if score.shape != (n, table.slot_score.shape[1]):
            raise ValueError(f"{source}: embedding \"{spec.name}\" eviction scores have shape "
                             f"{score.shape}, expected {(n, table.slot_score.shape[1])}")
        # the clock goes on from the newest step the rows were touched in (the saved step)
        clock = jnp.maximum(table.clock, int(score[:, 0].max()) if n else 0)
        table = with_row_scores(table, rows, score, state.values.shape[0])._replace(
            clock=clock.astype(jnp.int32))
    return EmbeddingState(table, new_values, new_slots, row_slot)


def export_placed(state: EmbeddingState, placement=None, *, copy: bool = True
                  ) -> dict[str, np.ndarray]:
    """:func:`export_table` of a table in any placement: a sharded table's parts are exported
    one after another (by key, so the result loads on any device count). ``copy`` False: a
    table on one device may come as views of its arrays (:func:`export_table`): for a
    synchronous save, which is done with them before the next step changes the table."""
    host = jax.tree.map(to_host, state)
    if placement is None or not placement.sharded:
        return export_table(host, copy=copy)
    parts = [export_table(jax.tree.map(lambda x, i=i: x[i], host))
             for i in range(placement.num_shards)]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def import_placed(spec: EmbeddingSpec, state: EmbeddingState, stored: dict[str, np.ndarray],
                  placement=None, *, source: str = "<table>") -> EmbeddingState:
    """:func:`import_table` into a table in any placement: every key goes to the part of the
    device that owns it (by key hash, or by its slot for slot-wise placement)."""
    if placement is None or not placement.sharded:
        local = jax.tree.map(lambda x: jnp.asarray(to_host(x)), state)
        return _like(import_table(spec, local, stored, source=source, owned=True), state)
    owner = _owners(spec, stored, placement, source)
    host = jax.tree.map(to_host, state)
    parts = []
    for i in range(placement.num_shards):
        part = jax.tree.map(lambda x, i=i: jnp.asarray(x[i]), host)
        pick = owner == i
        parts.append(import_table(spec, part, {k: np.asarray(v)[pick] for k, v in stored.items()},
                                  source=f"{source} (device {i})", owned=True))
    stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *parts)
    return _like(stacked, state)


def _owners(spec: EmbeddingSpec, stored: dict[str, np.ndarray], placement, source: str
            ) -> np.ndarray:
    """The part of a sharded table each stored key belongs to."""
    keys = np.asarray(stored["keys"], np.int64)
    if placement.kind == "localized":
        if "slot" not in stored:
            raise ValueError(f"{source}: embedding \"{spec.name}\" is placed slot-wise on "
                             f"{placement.num_shards} devices, which needs the slot of every "
                             "key; the stored table has no slot ids")
        slot = np.asarray(stored["slot"], np.int64)
        if slot.size and (slot.min() < 0 or slot.max() >= spec.slot_num):
            raise ValueError(f"{source}: embedding \"{spec.name}\": slot ids outside "
                             f"[0, {spec.slot_num})")
        return np.asarray(placement.slot_owner, np.int64)[slot]
    return owner_shards_host(keys, placement.num_shards)  # the routing's owner function


def held_here(spec: EmbeddingSpec, state: EmbeddingState, stored: dict[str, np.ndarray],
              placement=None, *, source: str = "<table>") -> np.ndarray:
    """bool [n]: which stored keys this process's devices hold (every key of a table each
    device holds whole; of a sharded one, those of the parts on this process's devices)."""
    n = np.asarray(stored["keys"]).size
    if placement is None or not placement.sharded or jax.process_count() == 1:
        return np.ones(n, bool)
    return np.isin(_owners(spec, stored, placement, source), _own_shards(state))


def slot_layout(state: EmbeddingState) -> np.ndarray:
    """Where an evicting table's keys sit in its slots (its ``slot_keys``, tombstones
    included; a sharded table's parts along the first axis), on the host: a checkpoint keeps
    it beside the rows so that a restore evicts as the saved table would
    (:func:`restore_layout`)."""
    return np.asarray(to_host(state.table.slot_keys))


def restore_layout(state: EmbeddingState, layout: np.ndarray) -> EmbeddingState:
    """``state`` with its keys back in the slots of a saved :func:`slot_layout` (each part
    of a sharded table in its own); as it is where the layout does not fit (another device
    count or capacity, other keys)."""
    host = jax.tree.map(to_host, state.table)
    layout = np.asarray(layout)
    if layout.shape != host.slot_keys.shape:
        return state
    if layout.ndim == 1:
        table = with_layout(host, layout)
    else:  # one part a device
        parts = [with_layout(jax.tree.map(lambda x, i=i: x[i], host), layout[i])
                 for i in range(layout.shape[0])]
        table = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *parts)
    # the table alone is placed again: the rest stays as it is (with several processes, a
    # global array cannot be read on one host)
    return state._replace(table=_like(table, state.table))


def _like(new, old):
    """``new`` (host or device arrays; an :class:`EmbeddingState` or a part of one) placed
    like ``old``'s arrays."""

    def put(x, ref):
        x = np.asarray(x)
        if isinstance(ref, jax.Array) and hasattr(ref, "sharding"):
            return jax.make_array_from_callback(x.shape, ref.sharding, lambda idx: x[idx])
        return jnp.asarray(x)

    return jax.tree.map(put, new, old)


def put_rows(spec: EmbeddingSpec, state: EmbeddingState, placement,
             stored: dict[str, np.ndarray], *, replace: bool = False,
             consume: bool = False) -> EmbeddingState:
    """``state`` with stored rows (keys, values, optimizer rows, slot ids) inserted, placed as
    before; ``replace``: into an empty table instead (every other key leaves, free rows hold
    initial values again). Streaming training moves its working set with this. ``consume``
    (with ``replace``): ``state``'s buffers become the new table's (a table on one device of
    one process is emptied and filled in place: no fresh table and no copy of one, ~0.9 s of a
    5.2M-row table's 1.1 s); the caller must not use ``state`` afterwards.

    Example::

        es = put_rows(spec, es, placement, store.pull(0, keys), replace=True, consume=True)
    """
    where = jax.tree.map(lambda x: x.sharding, state)  # (read before a donation)
    in_place = (replace and consume and (placement is None or not placement.sharded)
                and jax.process_count() == 1)
    base = state
    if in_place:  # the table's own buffers, emptied
        base = _emptied(spec, state)
    elif replace:  # a key's row gets its initial vector when inserted: no reset needed
        base = init_embedding(spec)
        if placement is not None and placement.sharded:
            base = jax.tree.map(lambda x: jnp.broadcast_to(x, (placement.num_shards,)
                                                           + x.shape), base)
    if replace and not np.size(stored["keys"]):  # an emptied table: nothing to insert
        filled = base
    elif in_place:  # written where they are
        filled = import_table(spec, base, stored, source=f"rows of {spec.name}", owned=True)
    else:
        filled = import_placed(spec, base, stored, placement, source=f"rows of {spec.name}")
    if jax.process_count() > 1:  # every process holds the same rows: each places its part
        return _like(filled, state)
    return jax.device_put(filled, where)  # a no-op where XLA kept them there


def drop_keys(spec: EmbeddingSpec, state: EmbeddingState, placement, keys: np.ndarray
              ) -> tuple[EmbeddingState, int]:
    """``state`` without ``keys``, their rows freed (streaming training's shrink). The keys
    are erased where they are (a cost proportional to them:
    :func:`jctr.embedding.sparse_embedding.erase_keys`; a key given twice is erased once); a
    sharded table's every device part erases them all (a part skips the keys it does not
    hold, so neither the key hash nor a slot-wise placement needs routing). When the
    tombstones they leave would crowd the slots once the freed rows take new keys (past
    ``MAX_FILL`` of them), each part's slots are built again on its device (rows do not
    move). Returns the table and its rows in use; ``state`` itself is consumed (its buffers
    are reused in place: an erase never copies a whole table)."""
    keys = np.asarray(keys, np.int64)
    sharded = placement is not None and placement.sharded
    erase = _erase_parts if sharded else _erase
    placed = jax.tree.map(lambda x: x.sharding, state)
    for start in range(0, keys.size, _INSERT_CHUNK):
        chunk = keys[start:start + _INSERT_CHUNK]
        pad = np.zeros(_INSERT_CHUNK, np.int64)
        pad[:chunk.size] = chunk
        valid = np.arange(_INSERT_CHUNK) < chunk.size
        state, _ = erase(spec, state, jnp.asarray(pad), jnp.asarray(valid))
    # a shrink of a few percent leaves its tombstones to a later one
    if (int(np.max(to_host(state.table.tombstones))) + state.values.shape[-2]
            > MAX_FILL * state.table.slot_keys.shape[-1]):
        sharding = state.values.sharding
        state = (_rebuild_on(sharding.mesh, sharding.spec[0]) if sharded else _rebuild)(state)
    state = jax.device_put(state, placed)  # where it was (a no-op when XLA kept it)
    table = state.table
    return state, int(np.sum(to_host(table.size) - to_host(table.free_count)))


_erase = jax.jit(erase_keys, static_argnums=0, donate_argnums=1)
# keys and tombstones in at most this share of a table's slots once its free rows are
# refilled (bucketed probes of new keys stay within a few cache lines)
MAX_FILL = 0.95


def _rebuilt(state: EmbeddingState) -> EmbeddingState:
    return state._replace(table=rebuild_slots(state.table))


_rebuild = jax.jit(_rebuilt, donate_argnums=0)


@functools.cache
def _rebuild_on(mesh, axis):
    """:func:`_rebuild` of every part of a sharded table, each device on its own part."""
    from jax.sharding import PartitionSpec as P

    def local(part):
        return jax.tree.map(lambda x: x[None], _rebuilt(jax.tree.map(lambda x: x[0], part)))

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(axis),), out_specs=P(axis),
                                 check_vma=False), donate_argnums=0)


def _erase_parts(spec: EmbeddingSpec, state: EmbeddingState, keys, valid):
    """:func:`erase_keys` of the same keys in every part of a sharded table (the leading
    axis), each device on its own part."""
    sharding = state.values.sharding
    return _erase_on(spec, sharding.mesh, sharding.spec[0])(state, keys, valid)


@functools.cache
def _erase_on(spec: EmbeddingSpec, mesh, axis):
    from jax.sharding import PartitionSpec as P

    def local(part, keys, valid):
        part, erased = erase_keys(spec, jax.tree.map(lambda x: x[0], part), keys, valid)
        return jax.tree.map(lambda x: x[None], part), erased[None]

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(axis), P(), P()),
                                 out_specs=(P(axis), P(axis)), check_vma=False),
                   donate_argnums=0)


def scale_slot(state: EmbeddingState, name: str, factors: tuple[float, ...]) -> EmbeddingState:
    """``state`` with the columns of optimizer slot ``name`` multiplied by ``factors``
    (streaming training's daily decay of the admission counts)."""
    scaled = _scale(state.slots[name], jnp.asarray(factors, jnp.float32))
    return state._replace(slots={**state.slots, name: scaled})


_scale = jax.jit(lambda x, f: x * f)
