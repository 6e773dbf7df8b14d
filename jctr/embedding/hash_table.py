"""A fixed-capacity hash table from 64-bit keys to embedding rows (functional, jittable).

``capacity`` rows (``max_vocabulary_size_per_gpu``) live in a dense value array; keys map to rows
through an open-addressing slot array in buckets of eight (:mod:`jctr.ops.hashing`), at most
85% full, so a probe mostly reads one cache line. Rows are handed out in insertion order;
training inserts unseen keys, evaluation never does.

:func:`erase` deletes keys at a cost proportional to them: a deleted key's slot becomes a
tombstone (``TOMBSTONE``: probes pass over it, inserts never take it) and its row goes on a free
list that later inserts take first (an evicted key is mostly replaced in place, leaving
none: :func:`_evict`). Tombstones leave when the slots are built again
(:func:`rebuild_slots`; on CPU one sweep in place): an evicting table's training lookup does it
when keys and tombstones would pass ``MAX_OCCUPIED`` of the slots or tombstones alone
``MAX_TOMBSTONES``, the shrink (:func:`jctr.sharding.rows.drop_keys`) when a refill would crowd
them.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
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
    representatives,
)
from jctr.ops import (
    rebuild_slots as rebuild,  # this module's rebuild_slots wraps it
)
from jctr.ops.clocks import CLOCK_LIMIT, CLOCK_SHIFT, at_most_once
from jctr.ops.hashing import (
    BUCKET,
    MAX_LOAD,
    UNPASSED_REACH,
    home_slots,
    rebuild_start,
    window_start,
)

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
    # the two counts are 64-bit: an evicting table under a stream of new keys passes 2**31
    # evictions within hours (100k a step: ~21k steps)
    overflow: jax.Array  # int64 [], keys refused because the table was full (sticky)
    free_rows: jax.Array  # int32 [capacity], a stack of rows freed by erase
    free_count: jax.Array  # int32 [], rows on that stack
    # eviction (an empty [0, 1] array for a table without it): what the policy ranks keys
    # by, kept beside their slots (a bucket's keys rank from one or two cache lines)
    slot_score: jax.Array  # int32 [num_slots, columns], last step touched (and touches: *lfu)
    clock: jax.Array  # int32 [], training lookups so far (the steps the scores count in; it
    # goes back by half a billion once past a billion, its stamps with it:
    # _keep_scores_in_range)
    evicted: jax.Array  # int64 [], keys evicted so far
    tombstones: jax.Array  # int32 [], erased or evicted keys' slots since the last rehash

    @property
    def num_slots(self) -> int:
        return self.slot_keys.shape[0]

    @property
    def evicts(self) -> bool:
        """The table keeps eviction scores (it was made with an eviction policy)."""
        return self.slot_score.shape[0] > 0


def num_slots_for(capacity: int, eviction: EvictionConfig | None = None) -> int:
    """Slots for a capacity, in whole buckets: keys fill at most ``MAX_LOAD`` (85%) of them
    (bucketed probing stays short there: :mod:`jctr.ops.hashing`); a table that evicts gets
    twice its rows: a full table's new keys need free slots to compete for rows (a step
    places at most as many as there are free slots: its rows' worth after the slots are built
    again), and its evicted keys leave tombstones until then."""
    need = 2 * capacity if eviction is not None else -(-capacity * 100 // int(MAX_LOAD * 100))
    return max(2 * BUCKET, -(-need // BUCKET) * BUCKET)


def create_table(capacity: int, eviction: EvictionConfig | None = None) -> HashTable:
    """An empty table; with ``eviction`` it keeps what its policy ranks keys by."""
    n = num_slots_for(capacity, eviction)
    tracked = n if eviction is not None else 0
    columns = eviction.score_columns if eviction is not None else 1
    def zero(dtype=jnp.int32):  # a buffer each: a donated state must not hold one array twice
        return jnp.zeros((), dtype)

    return HashTable(
        slot_keys=jnp.full((n,), EMPTY_KEY, jnp.int64),
        slot_rows=jnp.full((n,), -1, jnp.int32),
        scratch=jnp.zeros((n,), jnp.int32),
        size=zero(),
        overflow=zero(jnp.int64),
        free_rows=jnp.zeros((capacity,), jnp.int32),
        free_count=zero(),
        slot_score=jnp.zeros((tracked, columns), jnp.int32),
        clock=zero(),
        evicted=zero(jnp.int64),
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
        table = _rehash_if_crowded(table, arriving)
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
    table, slots, rows, rep, new, granted, counts = _place(table, keys, valid, arriving,
                                                           capacity, evicting, dedupe)
    n_new, n_granted, unslotted = counts[0], counts[1], counts[2]
    if evicting:
        # *lfu counts start again for keys new to their row, and (epoch_lfu) for found keys
        # last touched in an earlier epoch (read before this step stamps them)
        restart = granted
        if eviction.policy == "epoch_lfu":
            last = table.slot_score.at[jnp.where(rows >= 0, slots, table.num_slots), 0].get(
                mode="fill", fill_value=0)
            restart = restart | ((rows >= 0) & (last // eviction.epoch_steps
                                                != table.clock // eviction.epoch_steps))
        needy = new & ~granted
        # found keys and granted ones are this step's: stamped before any eviction, so that
        # none is chosen (a key that takes an evicted row is stamped as it takes it: every
        # key with a row is this step's after the eviction, with one scatter a step)
        table = table._replace(slot_score=table.slot_score.at[
            jnp.where(rows >= 0, slots, table.num_slots), 0].set(table.clock, mode="drop"))

        def evict(t: HashTable):
            return _evict(t, keys, slots, rows, rep, needy, eviction)

        # a step whose new keys all found free rows (a table not yet full) skips it all (a
        # loop run at most once: a cond would copy the table in its untaken branch); rows
        # found or granted stay (no key of this step is evicted): the positions of keys
        # that took an evicted row get it from the eviction
        _, table, placed, evicted, slots, rows, n_placed = jax.lax.while_loop(
            lambda c: c[0], lambda c: (False, *evict(c[1])),
            (jnp.any(needy), table, jnp.zeros_like(needy), jnp.full(keys.shape, EMPTY_KEY),
             slots, rows, jnp.int32(0)))
        granted = granted | placed
        n_granted = n_granted + n_placed
        table = table._replace(slot_score=_count_touches(table, keys, slots, rows,
                                                         restart | placed, eviction))
        # after the step's writes to the scores (no copy of them)
        table = _keep_scores_in_range(table, eviction, keys.shape[0])
    # refused: new keys left without a row, and keys that found no free slot at all (the
    # slots full of refused keys: each occurrence counts)
    refused = n_new - n_granted + unslotted
    table = table._replace(overflow=table.overflow + refused)
    rep = jnp.where(rows >= 0, rep, -1) if dedupe else jnp.full(rows.shape, -1, jnp.int32)
    return table, Lookup(rows=rows, rep=rep, fresh=granted,
                         evicted=evicted if evicting else None)


def _place(table: HashTable, keys, valid, arriving, capacity: int, evicting: bool,
           dedupe: bool):
    """A training lookup's find-or-insert: every valid key's slot, and rows for new keys
    while free ones last (``arriving``: the valid keys). Returns (table, slots, rows, rep,
    new, granted, counts): the new keys, those granted a row, and the valid keys that found
    no slot (:func:`jctr.ops.find_and_assign`); ``slots``, ``rep`` and ``new`` are None
    for a table that does not evict, looked up without ``dedupe``."""
    # the slots taken (keys with rows, tombstones and, in a plain table, refused keys) and
    # the batch's keys may exceed the slots: which keys get one must not follow a GPU's race;
    # nor, in a deterministic run, where an evicting table's keys sit (which windows rank them)
    taken = table.size - table.free_count + table.tombstones
    if not evicting:
        taken = taken + table.overflow
    slot_keys, slots, slot_rows, scratch, rows, rep, new, granted, size, free_count, counts = \
        find_and_assign(table.slot_keys, table.slot_rows, table.scratch, table.free_rows,
                        table.size, table.free_count, keys, valid, capacity, dedupe=dedupe,
                        scarce=taken + arriving > table.num_slots, exact=table.evicts,
                        # a table that does not evict reads no slots, nor (without dedupe)
                        # representatives or new keys' positions: none are written
                        lean=not evicting and not dedupe)
    table = table._replace(slot_keys=slot_keys, slot_rows=slot_rows, scratch=scratch,
                           size=size, free_count=free_count)
    return table, slots, rows, rep, new, granted, counts


# -- eviction ----------------------------------------------------------------------------------
_ROUNDS = 8  # windows per new key: one with no key to take there (or, in a chunk of several,
# whose choice another took) ranks other slots
# needy keys ranked together (the XLA formulation's chunk): one, each claims in turn, as the
# native CPU kernel does (a GPU takes larger chunks: jctr.ops.dispatch.evict_rows)
EVICT_CHUNK = 1
_NEVER = np.int64(np.iinfo(np.int64).max)


# the clock and the stamps beside the slots are 32-bit: past 2**31 steps (~8 months at 100
# steps a second) the clock would wrap and the newest keys rank lowest. Once it reaches
# CLOCK_LIMIT it goes back by a whole number of epochs near CLOCK_SHIFT, every stamp with it
# (stamps older than that become 0, the oldest there is): the ranking is unchanged but among
# keys untouched for half a billion steps (jctr.ops.clocks).
# *lfu's touch counts are int32 too, and a step adds at most one a key position: wrapped, a
# hot key's count ranks lowest and the key is the next evicted (a key in a sixth of a
# power-law stream's lookups passes 2**31 in ~1.5M steps of 8,192 samples). Every
# _CUT_STEPS steps a pass over the counts cuts them to touches_cap (the ranking unchanged
# but among keys touched over ~2 billion times); a saturating add in each step's scatter,
# or a second pass over the batch's slots, cost an lfu step 9-20% (docs/performance.md)
_CUT_STEPS = 256
_TOUCHES_MAX = int(np.iinfo(np.int32).max)


def clock_shift(eviction: EvictionConfig) -> int:
    """How far the clock goes back at ``CLOCK_LIMIT``: whole epochs (the epoch
    policies' epochs stay aligned)."""
    return max(1, CLOCK_SHIFT // eviction.epoch_steps) * eviction.epoch_steps


def touch_cut_steps(n: int) -> int:
    """Steps between two cuts of ``*lfu``'s touch counts for a lookup of ``n`` keys."""
    return max(1, min(_CUT_STEPS, (1 << 28) // max(n, 1)))


def touches_cap(n: int) -> int:
    """Where the cut leaves ``*lfu``'s touch counts for a lookup of ``n`` keys: low enough
    that two cuts' worth of steps (the clock's turn-back may stretch one gap to that) of
    one touch a position stay within int32."""
    return _TOUCHES_MAX - 2 * touch_cut_steps(n) * n


def _keep_scores_in_range(table: HashTable, eviction: EvictionConfig, n: int) -> HashTable:
    """``table`` with its clock and stamps moved back once its clock reached
    ``CLOCK_LIMIT``, and ``*lfu``'s touch counts cut to :func:`touches_cap` every
    :func:`touch_cut_steps` steps (:func:`jctr.ops.clocks.at_most_once`, after the step's
    writes to the scores)."""
    shift = clock_shift(eviction)
    counting = eviction.policy.endswith("lfu")
    every, cap = touch_cut_steps(n), touches_cap(n)

    def upkeep(score, clock):
        turn = clock >= CLOCK_LIMIT
        last = jnp.where(turn, jnp.maximum(score[:, 0] - shift, 0), score[:, 0])
        score = score.at[:, 0].set(last.astype(score.dtype))
        if counting:
            score = score.at[:, 1].set(jnp.minimum(score[:, 1], cap))
        return score, jnp.where(turn, clock - shift, clock)

    due = table.clock >= CLOCK_LIMIT
    if counting:
        due = due | (table.clock % every == 0)
    score, clock = at_most_once(due, upkeep, (table.slot_score, table.clock))
    return table._replace(slot_score=score, clock=clock)


def _rank(score: jax.Array, clock: jax.Array, eviction: EvictionConfig) -> jax.Array:
    """int64 rank of keys by their ``score`` columns (lowest goes first); keys touched at
    ``clock`` (this step) rank ``_NEVER``."""
    last = score[..., 0].astype(jnp.int64)
    policy = eviction.policy
    if policy == "lru":
        rank = last
    elif policy in ("lfu", "score"):  # touches, or the caller's score; ties: least recently
        rank = (score[..., 1].astype(jnp.int64) << 32) | last
    elif policy == "epoch_lru":
        rank = ((last // eviction.epoch_steps) << 32) | last
    else:  # epoch_lfu: the epoch of the last touch, then the touches within it
        rank = ((last // eviction.epoch_steps) << 32) | score[..., 1].astype(jnp.int64)
    return jnp.where(last == clock, _NEVER, rank)


def _evict(table: HashTable, keys, slots, rows, rep, needy, eviction: EvictionConfig
           ) -> tuple[HashTable, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Rows for the ``needy`` positions (new keys that found no free row, each in its slot
    already). A new key ranks the keys of the ``eviction.samples`` slots from the first slot
    of its home bucket on (where its probe began: keys of every age, their scores beside the
    slots in one or two cache lines, as NVIDIA HierarchicalKV ranks a bucket) and takes the
    lowest-ranked one. The needy keys go in chunks, in batch order: the keys of a chunk rank
    from the table as a round starts, of keys that chose the same key the first position
    wins, and the others, and keys whose windows held no key to take, rank ``samples`` slots
    from another bucket in the next round (:func:`jctr.ops.hashing.window_start`;
    ``_ROUNDS`` rounds; a key left without a row is refused, counted as overflow). Keys
    touched this step (found, granted, placed) are never chosen.

    A chunk is one key (:data:`EVICT_CHUNK`): each new key claims in turn, and the key it
    took is this step's at once, so no later key chooses it and none loses a claim; the
    native CPU kernel does that in one pass (:func:`jctr.ops.cpu_ffi.evict`). A GPU ranks up
    to ``dispatch.GPU_EVICT_CHUNK`` keys together, as its rounds are a few launch-bound
    kernels each: its choices differ from the CPU's (the same in every run).

    Where the chosen key sits on the new key's probe before the slot the new key took (in
    its home bucket, mostly), the new key replaces it in place, as HierarchicalKV does: it
    takes the slot, the row and the scores stay, and the slot the new key had taken is given
    back. Otherwise the chosen key's row moves to the new key's slot and the chosen key's
    slot is given back. A slot given back becomes a tombstone, empty again where no probe
    passes it (:func:`_give_back`: an empty slot ends its run of tombstones, or every key
    after it up to an empty slot has its home after it). A stream of new keys leaves few
    tombstones, so buckets stay open to probes and the slots are built again far less
    often.

    A key left without a row gives its slot back as a tombstone (probes of keys placed
    after it go on), or refused keys would fill the slots step by step.

    The needy positions are compacted once: the cost follows them, not the batch. Returns
    the table, which positions got a row, the key each of them evicted (``EMPTY_KEY``
    elsewhere), the slot each position's key holds after it (``slots`` but where a key
    replaced another in place: its repeats too, by ``rep``, their representative, -1:
    itself), each position's row after it (``rows`` where it had one) and the keys placed.
    The keys with ``rows`` (found, granted) must carry this step in their scores already
    (:func:`lookup` stamps them), so that none is chosen."""
    n = slots.shape[0]
    n_slots = table.num_slots
    clock = table.clock
    score = table.slot_score
    chunk = EVICT_CHUNK
    width = eviction.samples
    offsets = jnp.arange(width, dtype=jnp.int32)

    def reference(slot_keys, slot_rows, score, scratch, keys, slots, needy, clock, rows, rep,
                  *, chunk: int = chunk):
        ar = jnp.arange(chunk, dtype=jnp.int32)

        # the needy positions in batch order, compacted once (then padded for the last chunk)
        order = jnp.concatenate([jnp.nonzero(needy, size=n, fill_value=n)[0].astype(jnp.int32),
                                 jnp.full((chunk,), n, jnp.int32)])
        count = jnp.sum(needy, dtype=jnp.int32)

        def body(c):
            slot_keys, slot_rows, score, scratch, start, placed, gone_keys, to_slots, added = c
            idx = jax.lax.dynamic_slice(order, (start,), (chunk,))
            sub_slots = slots.at[idx].get(mode="fill", fill_value=0)
            sub_keys = keys.at[idx].get(mode="fill", fill_value=0)
            home = window_start(sub_keys, 0, n_slots)
            # the slots of the key's probe before the one it took (none of them empty)
            reach = (sub_slots - home) % n_slots

            def round_(rc):
                # a round ranks again only for keys whose choice another key took (or that
                # found no candidate): most chunks need one round
                (rnd, slot_keys, slot_rows, score, scratch, pending, got, gone, to, freed,
                 added) = rc
                cand = (window_start(sub_keys, rnd, n_slots)[:, None] + offsets[None, :]
                        ) % n_slots
                live = slot_rows.at[cand].get(mode="clip") >= 0
                rank = jnp.where(live, _rank(score.at[cand].get(mode="clip"), clock, eviction),
                                 _NEVER)
                best = jnp.argmin(rank, axis=1)
                victim = jnp.take_along_axis(cand, best[:, None], axis=1)[:, 0]
                ok = pending & (jnp.min(rank, axis=1) < _NEVER)
                # claims: the first position wins (the entries read are set first, so the
                # scratch's old contents never matter: no array of the slots filled a round)
                at = jnp.where(ok, victim, n_slots)
                scratch = scratch.at[at].set(chunk, mode="drop").at[at].min(ar, mode="drop")
                win = ok & (scratch.at[at].get(mode="fill", fill_value=-1) == ar)
                within = win & ((victim - home) % n_slots < reach)
                moved = win & ~within
                vs = jnp.where(win, victim, n_slots)
                row = slot_rows.at[vs].get(mode="fill", fill_value=-1)
                gone = jnp.where(win, slot_keys.at[vs].get(mode="fill", fill_value=EMPTY_KEY),
                                 gone)  # the evicted key (its row is the winner's now)
                # in place: the new key in the chosen key's slot (row and scores stay), its
                # own slot given back; moved: the chosen slot a tombstone, its row moved
                slot_keys = slot_keys.at[vs].set(jnp.where(within, sub_keys, TOMBSTONE),
                                                 mode="drop")
                slot_keys = slot_keys.at[jnp.where(within, sub_slots, n_slots)].set(
                    TOMBSTONE, mode="drop")
                slot_rows = slot_rows.at[jnp.where(moved, victim, n_slots)].set(-1, mode="drop")
                to = jnp.where(within, victim, to)
                freed = jnp.where(within, sub_slots, jnp.where(moved, victim, freed))
                slot_rows = slot_rows.at[jnp.where(moved, sub_slots, n_slots)].set(
                    row, mode="drop")
                # taken: no later key takes it
                score = score.at[jnp.where(win, to, n_slots), 0].set(clock, mode="drop")
                added = added + jnp.sum(win, dtype=jnp.int32)
                return (rnd + 1, slot_keys, slot_rows, score, scratch, pending & ~win,
                        got | win, gone, to, freed, added)

            _, slot_keys, slot_rows, score, scratch, _, got, gone, to, freed, added = \
                jax.lax.while_loop(
                    lambda rc: (rc[0] < _ROUNDS) & jnp.any(rc[5]), round_,
                    (jnp.int32(0), slot_keys, slot_rows, score, scratch, idx < n,
                     jnp.zeros((chunk,), bool), jnp.full((chunk,), EMPTY_KEY, jnp.int64),
                     sub_slots, sub_slots, added))
            # the chunk's slots given back (a new key's own, or the chosen key's where its
            # row moved): empty again where no probe passes them
            slot_keys, scratch, cleared = _give_back(slot_keys, scratch,
                                                     jnp.where(got, freed, -1))
            added = added - cleared
            placed = placed.at[idx].set(got, mode="drop")
            gone_keys = gone_keys.at[idx].set(gone, mode="drop")
            to_slots = to_slots.at[idx].set(to, mode="drop")
            return (slot_keys, slot_rows, score, scratch, start + chunk, placed, gone_keys,
                    to_slots, added)

        slot_keys, slot_rows, score, scratch, _, placed, gone_keys, to_slots, added = \
            jax.lax.while_loop(
                lambda c: c[4] < count, body,
                (slot_keys, slot_rows, score, scratch, jnp.int32(0), jnp.zeros((n,), bool),
                 jnp.full((n,), EMPTY_KEY, jnp.int64), slots, jnp.zeros((), jnp.int32)))
        left = needy & ~placed
        slot_keys = slot_keys.at[jnp.where(left, slots, n_slots)].set(TOMBSTONE, mode="drop")
        # a key that replaced another in place holds that key's slot: so do its repeats
        at = to_slots.at[jnp.where(rep >= 0, rep, jnp.arange(n, dtype=jnp.int32))].get(
            mode="clip")
        missing = (rows < 0) & (at >= 0)
        rows = jnp.where(missing, slot_rows.at[jnp.where(missing, at, n_slots)].get(
            mode="fill", fill_value=-1), rows)
        return (slot_keys, slot_rows, score, scratch, placed, gone_keys, at, rows,
                added + jnp.sum(left, dtype=jnp.int32), jnp.sum(placed, dtype=jnp.int32))

    slot_keys, slot_rows, score, scratch, placed, gone_keys, at, rows, added, n_placed = \
        evict_rows(reference, table.slot_keys, table.slot_rows, score, table.scratch, keys,
                   slots, needy, clock, rows, rep, policy=eviction.policy,
                   epoch_steps=eviction.epoch_steps, samples=width, chunk=chunk)
    table = table._replace(slot_keys=slot_keys, slot_rows=slot_rows, slot_score=score,
                           scratch=scratch, evicted=table.evicted + n_placed,
                           tombstones=table.tombstones + added)
    return table, placed, gone_keys, at, rows, n_placed


def _give_back(slot_keys, scratch, starts):
    """Slots an evicting step's keys left (``starts``, int32 [n], -1: none; tombstones now)
    empty again where no probe passes them: where an empty slot ends their run of
    tombstones (:func:`_clear_runs`), or else where every key after one up to an empty slot
    within ``UNPASSED_REACH`` slots has its home after it (no key's probe passes it: the
    check of linear probing's deletion), with the tombstones just before it. An evicted
    key's slot mostly lies in a run of keys, so without the second rule its tombstone stays
    and fills its bucket until the slots are built again (docs/performance.md). Judged on
    the slots as they are on entry (keys do not move, so each judgement holds whatever the
    others empty). Returns (slot_keys, scratch, tombstones cleared); the native eviction
    does the same after each key (:func:`jctr.ops.cpu_ffi._give_back`)."""
    n_slots = slot_keys.shape[0]
    slot_keys, scratch, cleared = _clear_runs(slot_keys, scratch, starts)
    still = (starts >= 0) & (slot_keys.at[jnp.maximum(starts, 0)].get() == TOMBSTONE)
    steps = jnp.arange(1, UNPASSED_REACH + 1, dtype=jnp.int32)
    after = slot_keys.at[(jnp.maximum(starts, 0)[:, None] + steps[None, :]) % n_slots].get()
    empty = after == EMPTY_KEY
    held = (after != EMPTY_KEY) & (after != TOMBSTONE)
    # the home's distance after the start, in 1 .. n_slots (n_slots: the start itself)
    d = (home_slots(after, n_slots) - starts[:, None]) % n_slots
    d = jnp.where(d == 0, n_slots, d)
    first_empty = jnp.argmax(empty, axis=1)
    passes = held & (d > steps[None, :]) & (steps[None, :] - 1 < first_empty[:, None])
    ok = still & jnp.any(empty, axis=1) & ~jnp.any(passes, axis=1)
    slot_keys = slot_keys.at[jnp.where(ok, starts, n_slots)].set(EMPTY_KEY, mode="drop")
    slot_keys, cleared = _empty_back(slot_keys, jnp.where(ok, (starts - 1) % n_slots, -1),
                                     cleared + jnp.sum(ok, dtype=jnp.int32))
    return slot_keys, scratch, cleared


def _empty_back(slot_keys, pos, cleared):
    """The tombstones from each ``pos`` (-1: none) backwards emptied, up to the first slot
    that is not one; returns (slot_keys, ``cleared`` plus their count)."""
    n_slots = slot_keys.shape[0]

    def clear(c):
        slot_keys, pos, cleared = c
        on = (pos >= 0) & (slot_keys.at[jnp.maximum(pos, 0)].get() == TOMBSTONE)
        slot_keys = slot_keys.at[jnp.where(on, pos, n_slots)].set(EMPTY_KEY, mode="drop")
        return (slot_keys, jnp.where(on, (pos - 1) % n_slots, -1),
                cleared + jnp.sum(on, dtype=jnp.int32))

    slot_keys, _, cleared = jax.lax.while_loop(lambda c: jnp.any(c[1] >= 0), clear,
                                               (slot_keys, pos, cleared))
    return slot_keys, cleared


def _clear_runs(slot_keys, scratch, starts):
    """Empty again every run of tombstones that holds a slot of ``starts`` (int32 [n], -1:
    none) and ends at an empty slot: no probe goes past an empty slot, so none needs the run
    (linear probing's deletion without a tombstone, for a run at a time). The result follows
    from the runs, not from the order of ``starts``. Returns (slot_keys, scratch, tombstones
    cleared). The XLA formulation; the native eviction does the same after each key's
    rounds, as :func:`_evict` calls this after a chunk's."""
    n_slots = slot_keys.shape[0]
    n = starts.shape[0]

    def past(c):  # from each start, along tombstones, to the slot that ends the run
        pos, on = c
        on = on & (slot_keys.at[pos].get(mode="fill", fill_value=0) == TOMBSTONE)
        return jnp.where(on, (pos + 1) % n_slots, pos), on

    end = jax.lax.while_loop(lambda c: jnp.any(c[1]), past, (starts, starts >= 0))[0]
    ends = (starts >= 0) & (slot_keys.at[jnp.where(starts >= 0, end, n_slots)].get(
        mode="fill", fill_value=0) == EMPTY_KEY)
    # one start clears a run (the first position among those that end at the same slot)
    at = jnp.where(ends, end, n_slots)
    ar = jnp.arange(n, dtype=jnp.int32)
    scratch = scratch.at[at].set(n, mode="drop").at[at].min(ar, mode="drop")
    first = ends & (scratch.at[at].get(mode="fill", fill_value=-1) == ar)
    slot_keys, cleared = _empty_back(slot_keys, jnp.where(first, (end - 1) % n_slots, -1),
                                     jnp.zeros((), jnp.int32))
    return slot_keys, scratch, cleared


def _count_touches(table: HashTable, keys, slots, rows, restart, eviction: EvictionConfig):
    """The step's touches in ``*lfu``'s second score column: one per occurrence of a key with
    a row (``rows`` >= 0, at its ``slots`` entry), counted from 0 for the keys of the
    ``restart`` positions; ``score``'s: the caller's score of each such key (every key a step
    assigns). (Every such key's last step is stamped already: before the eviction, or as it
    took an evicted row.)"""
    score = table.slot_score
    if eviction.score_columns < 2:
        return score
    at = jnp.where(rows >= 0, slots, table.num_slots)
    if eviction.policy == "score":
        return score.at[at, 1].set(caller_scores(eviction, keys, table.clock), mode="drop")
    score = score.at[jnp.where(restart, at, table.num_slots), 1].set(0, mode="drop")
    # (kept within int32 by a cut every few steps: _keep_scores_in_range)
    return score.at[at, 1].add(1, mode="drop")


def score_function(spec: str) -> Callable:
    """The function a ``"module:function"`` string names (as entry points name objects:
    :func:`pkgutil.resolve_name`), e.g. ``score_function("my_scores:by_age")``: the ``score``
    policy's ``score_fn``. Raises ValueError saying what was wrong (a malformed name, a
    module that does not import, a missing or uncallable attribute)."""
    module, sep, name = spec.partition(":")
    if not sep or not module.strip() or not name.strip():
        raise ValueError(f'expected "module:function", got {spec!r}')
    try:
        obj = pkgutil.resolve_name(f"{module.strip()}:{name.strip()}")
    except (ImportError, AttributeError) as e:
        raise ValueError(str(e)) from None
    if not callable(obj):
        raise ValueError(f"{spec!r} is not a function ({type(obj).__name__})")
    return obj


def caller_scores(eviction: EvictionConfig, keys: jax.Array, step: jax.Array) -> jax.Array:
    """The ``score`` policy's scores of ``keys`` (int32 [n]) from its ``score_fn``, called with
    the keys (int64 [n]) and the table's step (int32 []) inside the traced step: jnp code
    (HierarchicalKV's customized scores; TFRA's ``gen_scores_fn``). Example, keys of a
    user-id range kept before others::

        def by_range(keys, step):
            return jnp.where(keys < 1_000_000, 1000, 0).astype(jnp.int32)
    """
    try:
        fn = score_function(eviction.score_fn or "")
    except ValueError as e:
        raise UserError(f"eviction.score_fn: {e}") from None
    out = jnp.asarray(fn(keys, step))
    if out.shape != keys.shape or not (jnp.issubdtype(out.dtype, jnp.integer)
                                       or jnp.issubdtype(out.dtype, jnp.floating)):
        raise UserError(f"eviction.score_fn {eviction.score_fn!r}: expected one number per "
                        f"key ({keys.shape[0]}), got {out.dtype} {tuple(out.shape)}")
    return out.astype(jnp.int32)


def scores_by_row(table: HashTable, rows: np.ndarray, capacity: int) -> np.ndarray:
    """The eviction scores (int32 [len(rows), columns], host numpy) of the keys held at
    ``rows``: what a checkpoint stores with the rows (scores live beside the slots)."""
    slot_rows = np.asarray(table.slot_rows)
    score = np.asarray(table.slot_score)
    live = slot_rows >= 0
    by_row = np.zeros((capacity, score.shape[1]), np.int32)
    by_row[slot_rows[live]] = score[live]
    return by_row[np.asarray(rows, np.int64)]


def with_row_scores(table: HashTable, rows: np.ndarray, score: np.ndarray,
                    capacity: int) -> HashTable:
    """``table`` with the eviction ``score`` of the keys held at ``rows`` set beside their
    slots (the inverse of :func:`scores_by_row`; other keys' scores stay)."""
    by_row = jnp.zeros((capacity + 1, score.shape[1]), jnp.int32).at[
        jnp.asarray(rows, jnp.int32)].set(jnp.asarray(score, jnp.int32))
    given = jnp.zeros((capacity + 1,), bool).at[jnp.asarray(rows, jnp.int32)].set(True)
    at = jnp.where(table.slot_rows >= 0, table.slot_rows, capacity)
    put = given[at][:, None]
    return table._replace(slot_score=jnp.where(put, by_row[at], table.slot_score))


def with_layout(table: HashTable, layout: np.ndarray) -> HashTable:
    """``table`` (host or device arrays of one device part) with its keys moved to the slots
    they held in ``layout``, a saved ``slot_keys`` array with its tombstones: a restored
    evicting table then ranks the same keys in each window, and inserts where the saved one
    did, as the table that was saved (its keys, rows and scores came back by row; where keys
    sat in the slots did not). ``table`` as it is when ``layout`` does not hold exactly its
    keys in as many slots (another capacity, or rows saved from elsewhere)."""
    layout = np.asarray(layout, np.int64)
    keys, rows = np.asarray(table.slot_keys), np.asarray(table.slot_rows)
    if layout.shape != keys.shape:
        return table
    score = np.asarray(table.slot_score)
    live = rows >= 0
    held = (layout != EMPTY_KEY) & (layout != TOMBSTONE)
    if int(held.sum()) != int(live.sum()):
        return table
    order = np.argsort(keys[live], kind="stable")
    by_key = keys[live][order]
    at = np.searchsorted(by_key, layout[held]).clip(0, max(by_key.size - 1, 0))
    if by_key.size and not np.array_equal(by_key[at], layout[held]):
        return table
    slot_rows = np.full_like(rows, -1)
    slot_rows[held] = rows[live][order][at]
    slot_score = np.zeros_like(score)
    if score.shape[0]:
        slot_score[held] = score[live][order][at]
    return table._replace(slot_keys=jnp.asarray(layout), slot_rows=jnp.asarray(slot_rows),
                          slot_score=jnp.asarray(slot_score),
                          tombstones=jnp.asarray(int((layout == TOMBSTONE).sum()), jnp.int32))


def _rehash_if_crowded(table: HashTable, arriving: jax.Array) -> HashTable:
    """The slots built again from the keys that hold a row when keys, tombstones and the
    ``arriving`` keys (at most that many new ones) would fill more than ``MAX_OCCUPIED`` of
    them, or tombstones alone more than ``MAX_TOMBSTONES`` (erased and evicted keys leave a
    tombstone each): probes stay short and new keys find free slots. Rows, values and scores
    do not move; the cost is one pass over the slots (in place on CPU), once in a while, and
    a step that does not need it skips it."""
    n_slots = table.slot_keys.shape[0]
    in_use = table.size - table.free_count
    crowded = (table.tombstones > 0) & (
        ((in_use + table.tombstones + arriving).astype(jnp.float32) > MAX_OCCUPIED * n_slots)
        | (table.tombstones.astype(jnp.float32) > MAX_TOMBSTONES * n_slots))
    # a loop run at most once, not a cond: a cond's untaken branch copies the whole table
    # (~10 ms a step at 2M rows), a loop's state stays in place
    return jax.lax.while_loop(lambda c: c[0], lambda c: (False, rebuild_slots(c[1])),
                              (crowded, table))[1]


def rebuild_slots(table: HashTable) -> HashTable:
    """The slots built again from the keys that hold a row: tombstones (and keys refused a
    row) leave; rows and values do not move (eviction scores move with their keys). The keys
    go in anew in slot order from :func:`jctr.ops.hashing.rebuild_start`; on CPU one native
    sweep does it in place, each key moved back to the first empty slot of its probe."""
    def reference(old_keys, old_rows, old_score):
        n_slots = old_keys.shape[0]
        # the keys in slot order from a bucket no probe goes past (the native sweep's order)
        order = (jnp.arange(n_slots, dtype=jnp.int32) + rebuild_start(old_keys)) % n_slots
        old_keys, old_rows = old_keys[order], old_rows[order]
        live = old_rows >= 0
        slot_keys, slots = find_slots(jnp.full((n_slots,), EMPTY_KEY, jnp.int64), old_keys,
                                      live, insert=True, exact=table.evicts)
        slot_rows = jnp.full((n_slots,), -1, jnp.int32).at[
            jnp.where(live, slots, n_slots)].set(old_rows, mode="drop")
        slot_score = old_score
        if slot_score.shape[0]:  # eviction: the scores move with their keys
            slot_score = jnp.zeros_like(slot_score).at[jnp.where(live, slots, n_slots)].set(
                slot_score[order], mode="drop")
        return slot_keys, slot_rows, slot_score

    slot_keys, slot_rows, slot_score = rebuild(reference, table.slot_keys, table.slot_rows,
                                               table.slot_score)
    return table._replace(slot_keys=slot_keys, slot_rows=slot_rows, slot_score=slot_score,
                          tombstones=jnp.zeros((), jnp.int32))


# keys and tombstones together in at most this share of the slots, or the slots are built
# again (a plain table's keys fill at most MAX_LOAD of them; an evicting table's half)
MAX_OCCUPIED = 0.92
# tombstones in at most this share of an evicting table's slots, or its slots are built again
# (probes lengthen as they pile up; the native rebuild of a 2M-row table takes about one step,
# 25-30 ms). Most evicted keys are replaced in place (:func:`_evict`) and most slots given
# back are empty again (:func:`_give_back`): a uniform stream of new keys through 2M rows
# leaves a tombstone for ~1 in 50 of them, and 80 steps of the benchmark build the slots again
# not once (every ~6 steps when each evicted key left one; docs/performance.md)
MAX_TOMBSTONES = 0.15


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
