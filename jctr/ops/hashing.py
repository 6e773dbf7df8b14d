"""Open-addressing hash probing of 64-bit keys (jnp reference implementation).

The table is an int64 array of slots in buckets of ``BUCKET`` (8 keys: one 64-byte cache line);
``EMPTY_KEY`` (the smallest int64) marks a free slot and is therefore the one key value users
cannot store. A key's probe starts at the first slot of its bucket (picked by a multiply-shift
of the hash, so any number of buckets works) and goes on slot by slot, into the next buckets,
wrapping at the end: bucketed linear probing. A bucket is read in one memory access and holds
most of its keys' probes even with 85% of the slots taken (``MAX_LOAD``), so a table needs
about 1.18 slots per key instead of a power of two at least twice its keys.

Find-or-insert resolves the whole batch in a few dense probe rounds, then finishes the rare long
chains on a compacted remainder, so the cost stays linear in the batch.
Concurrent inserts of one key within a batch get one slot: free slots are claimed by a scatter-max
and every claimant reads the winner back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

EMPTY_KEY = np.int64(np.iinfo(np.int64).min)
BUCKET = 8  # slots per bucket: eight int64 keys fill a 64-byte cache line
MAX_LOAD = 0.85  # keys in at most this share of the slots (jctr.embedding.hash_table sizes)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """The same splitmix64 finaliser as :func:`hash_keys`, in numpy (host-side data work)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x).astype(np.uint64)
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def hash_keys(keys: jax.Array) -> jax.Array:
    """splitmix64 finaliser: a well-mixed uint64 for every int64 key."""
    z = keys.astype(jnp.uint64)
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def owner_shards(keys: jax.Array, num_shards: int) -> jax.Array:
    """The shard (device) owning each key when a table is spread row-wise by key hash.

    Uses the low bits of the mixed hash: the home slot inside a shard uses the top bits, so the
    keys one shard receives still spread over its whole slot array.
    """
    if num_shards == 1:
        return jnp.zeros(keys.shape, jnp.int32)
    return (hash_keys(keys) % np.uint64(num_shards)).astype(jnp.int32)


def owner_shards_host(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """:func:`owner_shards` in numpy."""
    if num_shards == 1:
        return np.zeros(np.shape(keys), np.int32)
    return (mix64(np.asarray(keys, np.int64).view(np.uint64)) % np.uint64(num_shards)).astype(
        np.int32)


UNIT_24 = np.float32(1.0 / (1 << 24))  # 24 random bits to [0, 1)


def seed_salt(seed: int) -> np.int64:
    """What :func:`key_uniform` xors a key with for ``seed`` (the native initial rows too)."""
    return np.uint64((seed * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF).view(np.int64)


def key_uniform(keys: jax.Array, dim: int, seed: int, bound: float) -> jax.Array:
    """[n, dim] float32 uniform in [-bound, bound), a pure function of (key, seed, column).

    New embedding rows start from this, so a key's initial vector does not depend on which row
    or device it lands in: any device count trains the same model.
    """
    h = hash_keys(keys ^ seed_salt(seed))
    cols = (jnp.arange(1, dim + 1, dtype=jnp.uint64) * _GOLDEN)[None, :]
    bits = hash_keys((h[:, None] + cols).astype(jnp.int64)) >> np.uint64(40)  # 24 random bits
    u = bits.astype(jnp.float32) * UNIT_24
    return (2.0 * u - 1.0) * np.float32(bound)


def bucket_width(num_slots: int) -> int:
    """Slots per bucket of a slot array: ``BUCKET``, or 1 for an array that is not a whole
    number of buckets (plain linear probing)."""
    return BUCKET if num_slots % BUCKET == 0 else 1


def home_slots(keys: jax.Array, num_slots: int) -> jax.Array:
    """First probe position of every key: the first slot of its bucket. The bucket is the top
    32 bits of the mixed hash scaled to the number of buckets (multiply-shift: no power of two
    needed; the low bits stay free for :func:`owner_shards`)."""
    width = bucket_width(num_slots)
    buckets = np.uint64(num_slots // width)
    top = hash_keys(keys) >> np.uint64(32)
    return (((top * buckets) >> np.uint64(32)) * np.uint64(width)).astype(jnp.int32)


# how far past a slot given back an evicting table looks for the empty slot that shows no
# probe passes it (:func:`jctr.embedding.hash_table._give_back`): two buckets
UNPASSED_REACH = 16


def window_start(keys: jax.Array, rnd, num_slots: int) -> jax.Array:
    """The first slot of the window an evicting table's new key ranks in eviction round
    ``rnd``: its home bucket's (round 0), then the home bucket of the key xored with ``rnd``
    times the golden ratio (windows spread over the table, independent of each other)."""
    salt = jnp.asarray(rnd).astype(jnp.uint64) * _GOLDEN
    return home_slots((keys.astype(jnp.uint64) ^ salt).astype(jnp.int64), num_slots)


def rebuild_start(slot_keys: jax.Array) -> jax.Array:
    """Where slots are built again from (:func:`jctr.embedding.hash_table.rebuild_slots`):
    the first slot of the bucket after the first bucket with an empty slot (no probe goes
    on past a bucket with an empty slot, so no key's probe wraps past it), 0 when no slot is
    empty."""
    num_slots = slot_keys.shape[0]
    width = bucket_width(num_slots)
    empty = slot_keys == EMPTY_KEY
    first = jnp.argmax(empty).astype(jnp.int32)
    return jnp.where(jnp.any(empty), (first - first % width + width) % num_slots, 0)


def next_slot(pos: jax.Array, num_slots: int) -> jax.Array:
    """The probe's next position (wrapping at the end of the slots)."""
    nxt = pos + 1
    return jnp.where(nxt == num_slots, 0, nxt)


def _probe_round(slot_keys, keys, pos, active, insert: bool):
    """One probe of every active key at ``pos``.

    Returns (slot_keys, pos, found, missing): ``found`` keys sit at ``pos``; ``missing`` keys met a
    free slot without inserting; the others moved one slot on.
    """
    num_slots = slot_keys.shape[0]
    # inactive keys read nothing: an out-of-range index skips the (cache-missing) table access
    cur = slot_keys.at[jnp.where(active, pos, num_slots)].get(mode="fill", fill_value=0)
    found = active & (cur == keys)
    free = active & (cur == EMPTY_KEY)
    if insert:
        slot_keys = slot_keys.at[jnp.where(free, pos, num_slots)].max(keys, mode="drop")
        found = found | (free & (slot_keys[pos] == keys))
        missing = jnp.zeros_like(found)
    else:
        missing = free
    moving = active & ~found & ~missing
    pos = jnp.where(moving, next_slot(pos, num_slots), pos)
    return slot_keys, pos, found, missing


def find_slots(slot_keys: jax.Array, keys: jax.Array, valid: jax.Array, *, insert: bool,
               dense_rounds: int = 3, chunk: int | None = None):
    """Find (and with ``insert`` claim) the slot of every valid key.

    Args:
      slot_keys: int64 [num_slots] (whole buckets), ``EMPTY_KEY`` where free.
      keys: int64 [n]; valid: bool [n] (invalid entries are ignored).
      insert: claim a free slot for keys not present (training); lookups never insert.
      dense_rounds: probe rounds over the whole batch before compacting the remainder.
      chunk: size of the compacted remainder arrays (default n // 8, at least 64).

    Returns:
      (slot_keys, slots): slots int32 [n], -1 for invalid keys, keys absent without insert, and
      keys that found no free slot (probing stops after a sweep of the whole table).
    """
    n = keys.shape[0]
    num_slots = slot_keys.shape[0]
    pos = home_slots(keys, num_slots)
    slots = jnp.full((n,), -1, jnp.int32)
    active = valid
    # The dense rounds only read: in steady state nearly every key already exists, and a
    # scatter over the whole batch per round would cost more than the lookups. Keys that meet a
    # free slot (new keys) stop there and claim it in the compacted remainder below.
    for _ in range(dense_rounds):
        _, pos, found, missing = _probe_round(slot_keys, keys, pos, active, False)
        slots = jnp.where(found, pos, slots)
        active = active & ~found
        if not insert:
            active = active & ~missing
    return probe_remaining(slot_keys, keys, pos, slots, active, insert=insert,
                           rounds_done=dense_rounds, chunk=chunk)


def probe_remaining(slot_keys: jax.Array, keys: jax.Array, pos: jax.Array | None,
                    slots: jax.Array, active: jax.Array, *, insert: bool, rounds_done: int = 0,
                    chunk: int | None = None):
    """Finish :func:`find_slots` for the ``active`` keys: probe on from ``pos`` (None: from
    each key's home slot, computed for the active keys only) in compacted chunks, with
    ``insert`` claiming free slots. ``slots`` holds the keys resolved already; ``rounds_done``
    probes were spent on each key before (a full sweep of the table bounds the probing).
    Returns (slot_keys, slots).

    With ``active`` all False this is one check, so a batch whose keys all exist costs nothing
    more here.
    """
    n = keys.shape[0]
    num_slots = slot_keys.shape[0]
    if chunk is None:
        chunk = max(64, n // 8)
    chunk = min(chunk, n)

    def outer_cond(carry):
        return jnp.any(carry[2])

    def outer_body(carry):
        # a chunk is probed to the end, so its keys leave ``active`` and their positions are
        # never needed again
        slot_keys, slots, active = carry
        idx = jnp.nonzero(active, size=chunk, fill_value=n)[0]
        sub_keys = keys.at[idx].get(mode="fill", fill_value=0)
        sub_pos = (home_slots(sub_keys, num_slots) if pos is None
                   else pos.at[idx].get(mode="fill", fill_value=0))
        sub_active = active.at[idx].get(mode="fill", fill_value=False)
        sub_slots = jnp.full((chunk,), -1, jnp.int32)

        # A full sweep of the table bounds the probing: keys still unresolved then have no
        # free slot (a full table) and keep slot -1.
        def inner_cond(c):
            return jnp.any(c[2]) & (c[4] < num_slots)

        def inner_body(c):
            sk, sp, sa, ss, rounds = c
            sk, sp, found, missing = _probe_round(sk, sub_keys, sp, sa, insert)
            ss = jnp.where(found, sp, ss)
            return sk, sp, sa & ~found & ~missing, ss, rounds + 1

        slot_keys, _, _, sub_slots, _ = jax.lax.while_loop(
            inner_cond, inner_body,
            (slot_keys, sub_pos, sub_active, sub_slots, jnp.int32(rounds_done)))
        slots = slots.at[idx].set(sub_slots, mode="drop")
        active = active.at[idx].set(False, mode="drop")
        return slot_keys, slots, active

    slot_keys, slots, _ = jax.lax.while_loop(outer_cond, outer_body,
                                             (slot_keys, slots, active))
    return slot_keys, slots


def representatives(scratch: jax.Array, slots: jax.Array):
    """For each position, the first position of the same slot (its representative).

    Linear and sort-free: positions are scattered into slot order with a minimum (``scratch``
    is a persistent int32 [num_slots] buffer; stale contents never matter because every slot
    read was just reset) and gathered back. Positions with slot -1 get -1. The first position,
    not whichever write lands last: a scatter's order among equal indices is unspecified (a
    GPU's differs run to run), and new keys take rows in the order of their representatives,
    so the rows a batch's new keys get are the same on every platform and in every run, and
    the native kernel's (:func:`jctr.ops.cpu_ffi.find_assign`).

    Returns (scratch, rep) with ``rep[i] == i`` exactly for the first position of each
    distinct slot.
    """
    n = slots.shape[0]
    num_slots = scratch.shape[0]
    ar = jnp.arange(n, dtype=jnp.int32)
    target = jnp.where(slots >= 0, slots, num_slots)
    scratch = scratch.at[target].set(n, mode="drop").at[target].min(ar, mode="drop")
    rep = jnp.where(slots >= 0, scratch.at[target].get(mode="fill", fill_value=-1), -1)
    return scratch, rep


def assign_rows(slot_rows: jax.Array, scratch: jax.Array, free_rows: jax.Array,
                size: jax.Array, free_count: jax.Array, slots: jax.Array, capacity: int, *,
                dedupe: bool = True):
    """Rows for the slots a find-or-insert gave a batch (jnp reference).

    ``slot_rows`` int32 [num_slots] holds each slot's row (-1: none yet); one position per
    distinct slot is its representative (:func:`representatives`); the representatives whose
    slot has no row are the new keys, which take rows in position order: the top of the
    ``free_rows`` stack (``free_count`` entries) first, then rows ``size, size + 1, ...``
    below ``capacity``; a new key left without one is refused (row -1).

    Returns (slot_rows, scratch, rows, rep, new, granted, size, free_count): every position's
    row after the assignment, its representative (without ``dedupe`` only the positions
    whose slot had no row get one: fewer scatters; others -1), which positions are new keys
    and which of those got a row, and the counters after.
    """
    n = slots.shape[0]
    before = jnp.where(slots >= 0, slot_rows.at[slots].get(mode="fill", fill_value=-1), -1)
    scratch, rep = representatives(scratch, slots if dedupe else jnp.where(before < 0, slots,
                                                                           -1))
    ar = jnp.arange(n, dtype=jnp.int32)
    new = (slots >= 0) & (before < 0) & (rep == ar)
    k = jnp.cumsum(new, dtype=jnp.int32) - 1  # rank among the new keys
    reused = k < free_count
    new_rows = jnp.where(reused,
                         free_rows.at[jnp.maximum(free_count - 1 - k, 0)].get(mode="clip"),
                         size + k - free_count)
    granted = new & (reused | (new_rows < capacity))
    slot_rows = slot_rows.at[jnp.where(granted, slots, slot_rows.shape[0])].set(new_rows,
                                                                               mode="drop")
    taken = jnp.minimum(jnp.sum(new, dtype=jnp.int32), free_count)
    size = size + jnp.sum(granted, dtype=jnp.int32) - taken
    rows = jnp.where(slots >= 0, slot_rows.at[slots].get(mode="fill", fill_value=-1), -1)
    return slot_rows, scratch, rows, rep, new, granted, size, free_count - taken
