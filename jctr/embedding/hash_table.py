"""A fixed-capacity hash table from 64-bit keys to embedding rows (functional, jittable).

``capacity`` rows (``max_vocabulary_size_per_gpu``) live in a dense value array; keys map to rows
through an open-addressing slot array at most half full, so probe chains stay short. Rows are
handed out in insertion order; training inserts unseen keys, evaluation never does.

:func:`erase` deletes keys at a cost proportional to them: a deleted key's slot becomes a
tombstone (``TOMBSTONE``: probes pass over it, inserts never take it) and its row goes on a free
list that later inserts take first. Tombstones only leave when the table is built again (the
caller does that when they crowd the slots: :func:`occupied_slots`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jctr.errors import UserError
from jctr.ops import EMPTY_KEY, find_slots, representatives

# an erased key's slot: neither empty (probes go on past it) nor any real key (keys equal to
# the two smallest int64 values are reserved)
TOMBSTONE = np.int64(EMPTY_KEY + 1)


class TableFullError(UserError, RuntimeError):
    """More distinct keys arrived than the table has rows."""


class HashTable(NamedTuple):
    """Key -> row index. A pytree; every field is an array."""

    slot_keys: jax.Array  # int64 [num_slots], EMPTY_KEY where free
    slot_rows: jax.Array  # int32 [num_slots], -1 where free
    scratch: jax.Array  # int32 [num_slots], dedupe workspace (contents never matter)
    size: jax.Array  # int32 [], rows handed out so far (in use, or freed and listed below)
    overflow: jax.Array  # int32 [], keys refused because the table was full (sticky)
    free_rows: jax.Array  # int32 [capacity], a stack of rows freed by erase
    free_count: jax.Array  # int32 [], rows on that stack

    @property
    def num_slots(self) -> int:
        return self.slot_keys.shape[0]


def num_slots_for(capacity: int) -> int:
    """Slots for a capacity: a power of two at least twice the capacity (load <= 1/2)."""
    return max(16, 1 << int(2 * capacity - 1).bit_length())


def create_table(capacity: int) -> HashTable:
    n = num_slots_for(capacity)
    return HashTable(
        slot_keys=jnp.full((n,), EMPTY_KEY, jnp.int64),
        slot_rows=jnp.full((n,), -1, jnp.int32),
        scratch=jnp.zeros((n,), jnp.int32),
        size=jnp.zeros((), jnp.int32),
        overflow=jnp.zeros((), jnp.int32),
        free_rows=jnp.zeros((capacity,), jnp.int32),
        free_count=jnp.zeros((), jnp.int32),
    )


class Lookup(NamedTuple):
    """Where the keys of a batch live."""

    rows: jax.Array  # int32 [n], -1 for padding and unknown keys
    rep: jax.Array  # int32 [n], position of one occurrence of the same row (-1 if none)
    fresh: jax.Array  # bool [n], the position that was just given a new row (one per new key)


def lookup(table: HashTable, keys: jax.Array, valid: jax.Array, capacity: int, *,
           insert: bool, dedupe: bool = True) -> tuple[HashTable, Lookup]:
    """Rows of ``keys``; with ``insert`` unseen keys get fresh rows (training).

    ``dedupe`` computes ``rep`` for every key (optimizers that sum a row's gradients need it);
    without it ``rep`` is all -1, and an insert finds the one representative of each *new* key
    only among the keys without a row (few in steady state: the scatter and gather of the
    dedupe touch memory only for them).

    A key that finds the table full gets row -1 (its embedding reads as the default, zeros)
    and is counted in ``table.overflow``; the trainer turns that into a :class:`TableFullError`.
    """
    slot_keys, slots = find_slots(table.slot_keys, keys, valid, insert=insert)
    slot_rows = table.slot_rows
    rows = jnp.where(slots >= 0, slot_rows.at[slots].get(mode="fill", fill_value=-1), -1)
    if dedupe:
        scratch, rep = representatives(table.scratch, slots)
    elif insert:
        scratch, rep = representatives(table.scratch, jnp.where(rows < 0, slots, -1))
    else:
        scratch, rep = table.scratch, jnp.full(slots.shape, -1, jnp.int32)
    size, overflow = table.size, table.overflow
    free_rows, free_count = table.free_rows, table.free_count
    granted = jnp.zeros(keys.shape, bool)
    if insert:
        ar = jnp.arange(keys.shape[0], dtype=jnp.int32)
        new = (slots >= 0) & (rows < 0) & (rep == ar)
        k = jnp.cumsum(new, dtype=jnp.int32) - 1  # rank among the new keys
        # freed rows first (the top of the stack), then rows never handed out
        reused = k < free_count
        new_rows = jnp.where(
            reused, free_rows.at[jnp.maximum(free_count - 1 - k, 0)].get(mode="clip"),
            size + k - free_count)
        granted = new & (reused | (new_rows < capacity))
        slot_rows = slot_rows.at[jnp.where(granted, slots, slot_rows.shape[0])].set(
            new_rows, mode="drop")
        n_new = jnp.sum(new, dtype=jnp.int32)
        n_granted = jnp.sum(granted, dtype=jnp.int32)
        taken = jnp.minimum(n_new, free_count)
        size = size + n_granted - taken
        free_count = free_count - taken
        overflow = overflow + (n_new - n_granted)
        rows = jnp.where(slots >= 0, slot_rows.at[slots].get(mode="fill", fill_value=-1), -1)
    rep = jnp.where(rows >= 0, rep, -1) if dedupe else jnp.full(slots.shape, -1, jnp.int32)
    table = HashTable(slot_keys, slot_rows, scratch, size, overflow, free_rows, free_count)
    return table, Lookup(rows=rows, rep=rep, fresh=granted)


def erase(table: HashTable, keys: jax.Array, valid: jax.Array) -> tuple[HashTable, jax.Array]:
    """``table`` without ``keys`` (distinct; invalid or absent ones are skipped): their slots
    become tombstones and their rows go on the free list. Returns the table and each key's
    freed row (-1 where nothing was erased). Costs the keys' probes, not the table's size."""
    _, slots = find_slots(table.slot_keys, keys, valid, insert=False)
    n_slots = table.slot_keys.shape[0]
    rows = jnp.where(slots >= 0, table.slot_rows.at[slots].get(mode="fill", fill_value=-1), -1)
    hit = rows >= 0
    at = jnp.where(hit, slots, n_slots)
    slot_keys = table.slot_keys.at[at].set(TOMBSTONE, mode="drop")
    slot_rows = table.slot_rows.at[at].set(-1, mode="drop")
    k = jnp.cumsum(hit, dtype=jnp.int32) - 1
    free_rows = table.free_rows.at[jnp.where(hit, table.free_count + k,
                                             table.free_rows.shape[0])].set(rows, mode="drop")
    free_count = table.free_count + jnp.sum(hit, dtype=jnp.int32)
    return table._replace(slot_keys=slot_keys, slot_rows=slot_rows, free_rows=free_rows,
                          free_count=free_count), rows


def occupied_slots(table: HashTable) -> jax.Array:
    """Slots that are not empty (keys and tombstones): probes stay short while this is at
    most about half of the slots; past that the table should be built again."""
    return jnp.sum(table.slot_keys != EMPTY_KEY, dtype=jnp.int32)


def export_items(table: HashTable) -> tuple[np.ndarray, np.ndarray]:
    """All (keys, rows) in the table, ordered by row (host numpy)."""
    keys = np.asarray(table.slot_keys)
    rows = np.asarray(table.slot_rows)
    used = rows >= 0
    keys, rows = keys[used], rows[used]
    n = rows.size
    if n and int(rows.max()) < n:  # rows 0 .. n-1, each once: placed by a scatter, O(n)
        by_row = np.empty(n, keys.dtype)
        by_row[rows] = keys
        return by_row, np.arange(n, dtype=rows.dtype)
    order = np.argsort(rows, kind="stable")
    return keys[order], rows[order]
