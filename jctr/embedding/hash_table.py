"""A fixed-capacity hash table from 64-bit keys to embedding rows (functional, jittable).

``capacity`` rows (``max_vocabulary_size_per_gpu``) live in a dense value array; keys map to rows
through an open-addressing slot array in buckets of eight (:mod:`jctr.ops.hashing`), at most
85% full, so a probe mostly reads one cache line. Rows are handed out in insertion order;
training inserts unseen keys, evaluation never does.

:func:`erase` deletes keys at a cost proportional to them: a deleted key's slot becomes a
tombstone (``TOMBSTONE``: probes pass over it, inserts never take it) and its row goes on a free
list that later inserts take first. Tombstones leave when the slots are built again
(:func:`rebuild_slots`): an evicting table's training lookup does it when keys and tombstones
would pass ``MAX_OCCUPIED`` of the slots, the shrink (:func:`jctr.sharding.rows.drop_keys`)
when a refill would crowd them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jctr.config.schema import EvictionConfig
from jctr.errors import UserError
from jctr.ops import (
    EMPTY_KEY,
    evict_rows,
    find_and_assign,
    find_slots,
    hash_keys,
    representatives,
)
from jctr.ops.hashing import BUCKET, MAX_LOAD

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
    # eviction (empty [0] arrays for a table without it):
    row_slots: jax.Array  # int32 [capacity], each row's slot (an evicted key's slot is found)
    row_score: jax.Array  # int32 [capacity, columns], last step touched (and touches: *lfu)
    clock: jax.Array  # int32 [], training lookups so far (the steps the scores count in)
    evicted: jax.Array  # int32 [], keys evicted so far
    tombstones: jax.Array  # int32 [], erased or evicted keys' slots since the last rehash

    @property
    def num_slots(self) -> int:
        return self.slot_keys.shape[0]


def num_slots_for(capacity: int, eviction: EvictionConfig | None = None) -> int:
    """Slots for a capacity, in whole buckets: keys fill at most ``MAX_LOAD`` (85%) of them
    (bucketed probing stays short there: :mod:`jctr.ops.hashing`); a table that evicts gets
    twice its rows: a full table's new keys need free slots to compete for rows (a step
    places at most as many as there are free slots: its rows' worth after the slots are built
    again), and its evicted keys leave tombstones until then."""
    need = 2 * capacity if eviction is not None else -(-capacity * 100 // int(MAX_LOAD * 100))
    return max(2 * BUCKET, -(-need // BUCKET) * BUCKET)


def create_table(capacity: int, eviction: EvictionConfig | None = None) -> HashTable:
    """An empty table; with ``eviction`` it keeps what its policy ranks rows by."""
    n = num_slots_for(capacity, eviction)
    tracked = capacity if eviction is not None else 0
    columns = eviction.score_columns if eviction is not None else 1
    def zero():  # a buffer each: a donated state must not hold one array twice
        return jnp.zeros((), jnp.int32)

    return HashTable(
        slot_keys=jnp.full((n,), EMPTY_KEY, jnp.int64),
        slot_rows=jnp.full((n,), -1, jnp.int32),
        scratch=jnp.zeros((n,), jnp.int32),
        size=zero(),
        overflow=zero(),
        free_rows=jnp.zeros((capacity,), jnp.int32),
        free_count=zero(),
        row_slots=jnp.full((tracked,), -1, jnp.int32),
        row_score=jnp.zeros((tracked, columns), jnp.int32),
        clock=zero(),
        evicted=zero(),
        tombstones=zero(),
    )


class Lookup(NamedTuple):
    """Where the keys of a batch live."""

    rows: jax.Array  # int32 [n], -1 for padding and unknown keys
    rep: jax.Array  # int32 [n], position of one occurrence of the same row (-1 if none)
    fresh: jax.Array  # bool [n], the position that was just given a new row (one per new key)
    # int64 [n] (an evicting training lookup): the key whose row the position's new key took
    # (EMPTY_KEY elsewhere); the row is ``rows`` there
    evicted: jax.Array | None = None


def lookup(table: HashTable, keys: jax.Array, valid: jax.Array, capacity: int, *,
           insert: bool, dedupe: bool = True, eviction: EvictionConfig | None = None
           ) -> tuple[HashTable, Lookup]:
    """Rows of ``keys``; with ``insert`` unseen keys get fresh rows (training).

    ``dedupe`` computes ``rep`` for every key (optimizers that sum a row's gradients need it);
    without it ``rep`` is all -1, and an insert finds the one representative of each *new* key
    only among the keys without a row (few in steady state: the scatter and gather of the
    dedupe touch memory only for them).

    A key that finds the table full gets row -1 (its embedding reads as the default, zeros)
    and is counted in ``table.overflow``; the trainer turns that into a :class:`TableFullError`.
    With ``eviction`` (training) it takes the row of a key the policy ranks lowest instead
    (:func:`_evict`); such rows are ``fresh`` too.
    """
    evicting = insert and eviction is not None
    arriving = jnp.sum(valid, dtype=jnp.int32)
    if evicting:  # a plain table's tombstones come from erase, whose caller rebuilds
        table = _rehash_if_crowded(table, capacity, arriving)
        table = table._replace(clock=table.clock + 1)
    if not insert:
        _, slots = find_slots(table.slot_keys, keys, valid, insert=False)
        rows = jnp.where(slots >= 0,
                         table.slot_rows.at[slots].get(mode="fill", fill_value=-1), -1)
        if not dedupe:
            return table, Lookup(rows=rows, rep=jnp.full(slots.shape, -1, jnp.int32),
                                 fresh=jnp.zeros(keys.shape, bool))
        scratch, rep = representatives(table.scratch, slots)
        return table._replace(scratch=scratch), Lookup(
            rows=rows, rep=jnp.where(rows >= 0, rep, -1), fresh=jnp.zeros(keys.shape, bool))
    # the slots taken (keys with rows, tombstones and, in a plain table, refused keys) and
    # the batch's keys may exceed the slots: which keys get one must not follow a GPU's race
    taken = table.size - table.free_count + table.tombstones
    if not evicting:
        taken = taken + table.overflow
    slot_keys, slots, slot_rows, scratch, rows, rep, new, granted, size, free_count = \
        find_and_assign(table.slot_keys, table.slot_rows, table.scratch, table.free_rows,
                        table.size, table.free_count, keys, valid, capacity, dedupe=dedupe,
                        scarce=taken + arriving > table.num_slots)
    n_new = jnp.sum(new, dtype=jnp.int32)
    row_slots = table.row_slots
    if row_slots.shape[0]:  # tracked (eviction): each granted row's slot
        row_slots = row_slots.at[jnp.where(granted, rows, capacity)].set(slots, mode="drop")
    table = table._replace(slot_keys=slot_keys, slot_rows=slot_rows, scratch=scratch,
                           size=size, free_count=free_count, row_slots=row_slots)
    if evicting:
        # *lfu counts start again for rows new to their key, and (epoch_lfu) for found rows
        # last touched in an earlier epoch (read before this step stamps them)
        restart = granted
        if eviction.policy == "epoch_lfu":
            last = table.row_score.at[jnp.where(rows >= 0, rows, capacity), 0].get(
                mode="fill", fill_value=0)
            restart = restart | ((rows >= 0) & (last // eviction.epoch_steps
                                                != table.clock // eviction.epoch_steps))
        needy = new & ~granted

        def evict(t: HashTable):
            t, placed, gone = _evict(t, keys, slots, rows, needy, eviction, capacity)
            # a key left without a row gives its slot back (a tombstone: probes of keys
            # placed after it go on), or refused keys would fill the slots step by step
            left = needy & ~placed
            return t._replace(
                slot_keys=t.slot_keys.at[jnp.where(left, slots, t.num_slots)].set(
                    TOMBSTONE, mode="drop"),
                tombstones=t.tombstones + jnp.sum(left, dtype=jnp.int32)), placed, gone

        # a step whose new keys all found free rows (a table not yet full) skips it all (a
        # loop run at most once: a cond would copy the table in its untaken branch)
        _, table, placed, evicted = jax.lax.while_loop(
            lambda c: c[0], lambda c: (False, *evict(c[1])),
            (jnp.any(needy), table, jnp.zeros_like(needy), jnp.full(keys.shape, EMPTY_KEY)))
        granted = granted | placed
        rows = jnp.where(slots >= 0,
                         table.slot_rows.at[slots].get(mode="fill", fill_value=-1), -1)
        table = table._replace(row_score=_count_touches(table, rows, restart | placed,
                                                        eviction, capacity))
    # refused: new keys left without a row, and keys that found no free slot at all (the
    # slots full of refused keys: each occurrence counts)
    refused = n_new - jnp.sum(granted, dtype=jnp.int32) + jnp.sum(valid & (slots < 0),
                                                                   dtype=jnp.int32)
    table = table._replace(overflow=table.overflow + refused)
    rep = jnp.where(rows >= 0, rep, -1) if dedupe else jnp.full(slots.shape, -1, jnp.int32)
    return table, Lookup(rows=rows, rep=rep, fresh=granted,
                         evicted=evicted if evicting else None)


# -- eviction ----------------------------------------------------------------------------------
_ROUNDS = 4  # sampling rounds per new key: a key whose choice another took samples again
_NEVER = np.int64(np.iinfo(np.int64).max)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _rank(score: jax.Array, clock: jax.Array, eviction: EvictionConfig) -> jax.Array:
    """int64 rank of rows by their ``score`` columns (lowest goes first); rows touched at
    ``clock`` (this step) rank ``_NEVER``."""
    last = score[..., 0].astype(jnp.int64)
    policy = eviction.policy
    if policy == "lru":
        rank = last
    elif policy == "lfu":
        rank = (score[..., 1].astype(jnp.int64) << 32) | last
    elif policy == "epoch_lru":
        rank = ((last // eviction.epoch_steps) << 32) | last
    else:  # epoch_lfu: the epoch of the last touch, then the touches within it
        rank = ((last // eviction.epoch_steps) << 32) | score[..., 1].astype(jnp.int64)
    return jnp.where(last == clock, _NEVER, rank)


def _evict(table: HashTable, keys, slots, rows, needy, eviction: EvictionConfig,
           capacity: int) -> tuple[HashTable, jax.Array, jax.Array]:
    """Rows for the ``needy`` positions (new keys that found no free row): each samples
    ``eviction.samples`` rows by its hash and takes the lowest-ranked one; of new keys that
    chose the same row the first position wins and the others sample again (``_ROUNDS``
    rounds; a key left without a row is refused, counted as overflow). The taken row's old
    key leaves (its slot becomes a tombstone). Rows this step touches (found keys, granted
    rows, rows taken already) are never chosen. Compacted chunks: the cost follows the
    needy keys, not the batch. On CPU a native kernel makes the same choices
    (:func:`jctr.ops.cpu_ffi.evict`). Returns the table, which positions got a row and the key each
    of them evicted (``EMPTY_KEY`` elsewhere)."""
    n = keys.shape[0]
    n_slots = table.slot_keys.shape[0]
    clock = table.clock
    # found keys' rows and granted rows are this step's: stamped first, so none is chosen
    score = table.row_score.at[jnp.where(rows >= 0, rows, capacity), 0].set(clock,
                                                                           mode="drop")
    chunk = min(n, max(64, n // 8))
    samples = eviction.samples
    ar = jnp.arange(chunk, dtype=jnp.int32)

    def reference(slot_keys, slot_rows, row_slots, score, keys, slots, needy, clock):
        def body(c):
            slot_keys, slot_rows, row_slots, score, todo, placed, gone_keys = c
            idx = jnp.nonzero(todo, size=chunk, fill_value=n)[0]
            sub_keys = keys.at[idx].get(mode="fill", fill_value=0)
            sub_slots = slots.at[idx].get(mode="fill", fill_value=-1)
            h = hash_keys(sub_keys)

            def round_(rc):
                # a round samples again only for keys whose choice another key took: most
                # chunks need one round, so the rounds stop when every key has its row
                rnd, slot_keys, slot_rows, row_slots, score, pending, got, gone = rc
                salt = (jnp.arange(samples, dtype=jnp.uint64)
                        + (rnd * samples + 1).astype(jnp.uint64)) * _GOLDEN
                cand = (hash_keys((h[:, None] ^ salt[None, :]).astype(jnp.int64))
                        % np.uint64(capacity)).astype(jnp.int32)  # [chunk, samples]
                rank = _rank(score.at[cand].get(mode="clip"), clock, eviction)
                best = jnp.argmin(rank, axis=1)
                victim = jnp.take_along_axis(cand, best[:, None], axis=1)[:, 0]
                ok = pending & (jnp.min(rank, axis=1) < _NEVER)
                at = jnp.where(ok, victim, capacity)  # claims: the first position wins
                claims = jnp.full((capacity,), chunk, jnp.int32).at[at].min(ar, mode="drop")
                win = ok & (claims.at[at].get(mode="fill", fill_value=-1) == ar)
                vr = jnp.where(win, victim, capacity)
                old = jnp.where(win, row_slots.at[vr].get(mode="fill", fill_value=-1), -1)
                old = jnp.where(old >= 0, old, n_slots)
                gone = jnp.where(win, slot_keys.at[old].get(mode="fill", fill_value=EMPTY_KEY),
                                 gone)  # the evicted key (its row is the winner's now)
                slot_keys = slot_keys.at[old].set(TOMBSTONE, mode="drop")
                slot_rows = slot_rows.at[old].set(-1, mode="drop")
                slot_rows = slot_rows.at[jnp.where(win, sub_slots, n_slots)].set(victim,
                                                                                 mode="drop")
                row_slots = row_slots.at[vr].set(sub_slots, mode="drop")
                score = score.at[vr, 0].set(clock, mode="drop")  # taken: no later key takes it
                return (rnd + 1, slot_keys, slot_rows, row_slots, score, pending & ~win,
                        got | win, gone)

            _, slot_keys, slot_rows, row_slots, score, _, got, gone = jax.lax.while_loop(
                lambda rc: (rc[0] < _ROUNDS) & jnp.any(rc[5]), round_,
                (jnp.int32(0), slot_keys, slot_rows, row_slots, score, idx < n,
                 jnp.zeros((chunk,), bool), jnp.full((chunk,), EMPTY_KEY, jnp.int64)))
            todo = todo.at[idx].set(False, mode="drop")
            placed = placed.at[idx].set(got, mode="drop")
            gone_keys = gone_keys.at[idx].set(gone, mode="drop")
            return slot_keys, slot_rows, row_slots, score, todo, placed, gone_keys

        slot_keys, slot_rows, row_slots, score, _, placed, gone_keys = jax.lax.while_loop(
            lambda c: jnp.any(c[4]), body,
            (slot_keys, slot_rows, row_slots, score, needy, jnp.zeros((n,), bool),
             jnp.full((n,), EMPTY_KEY, jnp.int64)))
        return slot_keys, slot_rows, row_slots, score, placed, gone_keys

    slot_keys, slot_rows, row_slots, score, placed, gone_keys = evict_rows(
        reference, table.slot_keys, table.slot_rows, table.row_slots, score, keys, slots, needy,
        clock, policy=eviction.policy, epoch_steps=eviction.epoch_steps, samples=samples,
        chunk=chunk)
    n_placed = jnp.sum(placed, dtype=jnp.int32)
    table = table._replace(slot_keys=slot_keys, slot_rows=slot_rows, row_slots=row_slots,
                           row_score=score, evicted=table.evicted + n_placed,
                           tombstones=table.tombstones + n_placed)
    return table, placed, gone_keys


def _count_touches(table: HashTable, rows, restart, eviction: EvictionConfig, capacity: int):
    """The step's touches in the score columns: the last step of every row in ``rows``
    (every occurrence, -1 ignored), and for ``*lfu`` one touch per occurrence, counted from
    0 for the rows of the ``restart`` positions."""
    score, clock = table.row_score, table.clock
    at = jnp.where(rows >= 0, rows, capacity)
    if eviction.score_columns > 1:
        score = score.at[jnp.where(restart, at, capacity), 1].set(0, mode="drop")
        score = score.at[at, 1].add(1, mode="drop")
    return score.at[at, 0].set(clock, mode="drop")


def _rehash_if_crowded(table: HashTable, capacity: int, arriving: jax.Array) -> HashTable:
    """The slots built again from the keys that hold a row when keys, tombstones and the
    ``arriving`` keys (at most that many new ones) would fill more than ``MAX_OCCUPIED`` of
    them (erased and evicted keys leave a tombstone each): probes stay short and new keys
    find free slots. Rows, values and scores do not move; the cost is one pass over the
    slots, once in a while, and a step that does not need it skips it."""
    n_slots = table.slot_keys.shape[0]
    in_use = table.size - table.free_count
    crowded = (table.tombstones > 0) & (
        (in_use + table.tombstones + arriving).astype(jnp.float32) > MAX_OCCUPIED * n_slots)
    # a loop run at most once, not a cond: a cond's untaken branch copies the whole table
    # (~10 ms a step at 2M rows), a loop's state stays in place
    return jax.lax.while_loop(lambda c: c[0], lambda c: (False, rebuild_slots(c[1], capacity)),
                              (crowded, table))[1]


def rebuild_slots(table: HashTable, capacity: int) -> HashTable:
    """The slots built again from the keys that hold a row: tombstones (and keys refused a
    row) leave; rows, values and scores do not move. One pass over the slots."""
    n_slots = table.slot_keys.shape[0]
    live = table.slot_rows >= 0
    slot_keys, slots = find_slots(jnp.full((n_slots,), EMPTY_KEY, jnp.int64), table.slot_keys,
                                  live, insert=True)
    slot_rows = jnp.full((n_slots,), -1, jnp.int32).at[
        jnp.where(live, slots, n_slots)].set(table.slot_rows, mode="drop")
    row_slots = table.row_slots
    if row_slots.shape[0]:  # tracked (eviction): each row's new slot
        row_slots = jnp.full_like(row_slots, -1).at[
            jnp.where(live, table.slot_rows, capacity)].set(slots, mode="drop")
    return table._replace(slot_keys=slot_keys, slot_rows=slot_rows, row_slots=row_slots,
                          tombstones=jnp.zeros((), jnp.int32))


# keys and tombstones together in at most this share of the slots, or the slots are built
# again (a plain table's keys fill at most MAX_LOAD of them; an evicting table's half)
MAX_OCCUPIED = 0.92


def erase(table: HashTable, keys: jax.Array, valid: jax.Array) -> tuple[HashTable, jax.Array]:
    """``table`` without ``keys`` (invalid or absent ones are skipped; a key given twice is
    erased once): their slots become tombstones and their rows go on the free list. Returns
    the table and each key's freed row (-1 where nothing was erased: one position of a key
    given twice). Costs the keys' probes, not the table's size."""
    _, slots = find_slots(table.slot_keys, keys, valid, insert=False)
    n_slots = table.slot_keys.shape[0]
    scratch, rep = representatives(table.scratch, slots)  # one position per key
    slots = jnp.where(rep == jnp.arange(keys.shape[0], dtype=jnp.int32), slots, -1)
    rows = jnp.where(slots >= 0, table.slot_rows.at[slots].get(mode="fill", fill_value=-1), -1)
    hit = rows >= 0
    at = jnp.where(hit, slots, n_slots)
    slot_keys = table.slot_keys.at[at].set(TOMBSTONE, mode="drop")
    slot_rows = table.slot_rows.at[at].set(-1, mode="drop")
    k = jnp.cumsum(hit, dtype=jnp.int32) - 1
    free_rows = table.free_rows.at[jnp.where(hit, table.free_count + k,
                                             table.free_rows.shape[0])].set(rows, mode="drop")
    erased = jnp.sum(hit, dtype=jnp.int32)
    return table._replace(slot_keys=slot_keys, slot_rows=slot_rows, free_rows=free_rows,
                          free_count=table.free_count + erased, scratch=scratch,
                          tombstones=table.tombstones + erased), rows


def occupied_slots(table: HashTable) -> jax.Array:
    """Slots that are not empty (keys and tombstones), per device part of a sharded table
    (its leading axis): probes stay short while this is at most about half of the slots;
    past that the table should be built again."""
    return jnp.sum(table.slot_keys != EMPTY_KEY, axis=-1, dtype=jnp.int32)


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
