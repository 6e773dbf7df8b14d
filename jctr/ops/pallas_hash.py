"""Pallas kernels for hash tables of 64-bit keys (Triton on GPU; ``interpret=True`` on CPU):
one program per key walks its bucketed linear-probing chain (:mod:`jctr.ops.hashing`).

* lookup: until the key or a free slot;
* find-or-insert: a free slot is claimed atomically. Pallas' Triton ``atomic_cas`` (jax 0.10)
  takes a whole ref, not an element, so the compare-and-swap is built from two indexed atomics:
  an increment of a per-slot claim counter (the program that sees 0 owns the slot) and an
  atomic max that publishes the owner's key over ``EMPTY_KEY`` (the smallest int64). Concurrent
  inserts of one key therefore get one slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jctr.ops.hashing import EMPTY_KEY, home_slots, next_slot
from jctr.ops.pallas_bag import _params


def _probe_chain(home_ref, valid_ref, slots_ref, num_slots, probe):
    """Walk program ``i``'s key from its home slot: ``probe(pos) -> (found, stop)``; writes the
    slot where it was found, -1 if it stopped elsewhere or swept the whole table."""
    i = pl.program_id(0)

    def cond(c):
        _, done, _, steps = c
        return (~done) & (steps < num_slots)

    def body(c):
        pos, _, _, steps = c
        found, stop = probe(pos)
        slot = jnp.where(found, pos, jnp.int32(-1))
        nxt = jnp.where(stop, pos, next_slot(pos, num_slots))
        return nxt, stop, slot, steps + 1

    start = (home_ref[i], ~valid_ref[i], jnp.int32(-1), jnp.int32(0))
    _, _, slot, _ = jax.lax.while_loop(cond, body, start)
    slots_ref[i] = slot


def _lookup_kernel(keys_ref, home_ref, valid_ref, table_ref, slots_ref, *, num_slots):
    key = keys_ref[pl.program_id(0)]

    def probe(pos):  # stops at the key or at a free slot
        cur = table_ref[pos]
        found = cur == key
        return found, found | (cur == jnp.int64(EMPTY_KEY))

    _probe_chain(home_ref, valid_ref, slots_ref, num_slots, probe)


@functools.partial(jax.jit, static_argnames=("interpret",))
def lookup_slots_kernel(slot_keys, keys, valid, *, interpret: bool = False):
    """The slot of every valid key present in the table, -1 otherwise (no insertion); the
    contract of :func:`jctr.ops.hashing.find_slots` with ``insert=False``."""
    n = keys.shape[0]
    num_slots = slot_keys.shape[0]
    kernel = functools.partial(_lookup_kernel, num_slots=num_slots)
    return pl.pallas_call(
        kernel, grid=(n,), out_shape=jax.ShapeDtypeStruct((n,), jnp.int32),
        interpret=interpret, compiler_params=None if interpret else _params(),
        name="jctr_hash_lookup",
    )(keys, home_slots(keys, num_slots), valid, slot_keys)


def _insert_kernel(keys_ref, home_ref, valid_ref, _table_in, _claims_in, table_ref, claims_ref,
                   slots_ref, *, num_slots):
    """Find or claim the slot of one key. A free slot belongs to the first program whose atomic
    increment of its claim counter sees 0 (an indexed compare-and-swap in two steps: Pallas'
    ``atomic_cas`` only takes whole refs); the owner publishes its key atomically and other
    claimants wait for it, then either share the slot (same key) or probe on."""
    key = keys_ref[pl.program_id(0)]
    empty = jnp.int64(EMPTY_KEY)
    zero = jnp.int64(0)

    def read(pos):  # an atomic read: sees keys other programs published
        return plt.atomic_add(table_ref, pos, zero)

    def probe(pos):  # stops where the key is found or placed
        cur = read(pos)
        free = cur == empty
        # branch-free: occupied slots get +0 on their claim counter and max(key, EMPTY_KEY)
        ticket = plt.atomic_add(claims_ref, pos, free.astype(jnp.int32))
        owner = free & (ticket == 0)
        # publish: the slot holds EMPTY_KEY (the smallest int64) and only its owner writes it,
        # so an atomic max stores the key
        plt.atomic_max(table_ref, pos, jnp.where(owner, key, empty))
        waiting = free & ~owner
        cur = jax.lax.while_loop(lambda v: waiting & (v == empty), lambda v: read(pos), cur)
        found = owner | (cur == key)
        return found, found

    _probe_chain(home_ref, valid_ref, slots_ref, num_slots, probe)


@functools.partial(jax.jit, static_argnames=("interpret",))
def insert_slots_kernel(slot_keys, keys, valid, *, interpret: bool = False):
    """Find or insert every valid key: the contract of :func:`jctr.ops.hashing.find_slots` with
    ``insert=True`` (returns the new slot array and the slot of every key; -1 for invalid keys
    and keys that found the table full). Which of several contending keys gets a slot may differ
    from the XLA formulation; the set of (key, slot) pairs is a valid table either way."""
    n = keys.shape[0]
    num_slots = slot_keys.shape[0]
    kernel = functools.partial(_insert_kernel, num_slots=num_slots)
    claims = jnp.zeros((num_slots,), jnp.int32)
    table, _, slots = pl.pallas_call(
        kernel, grid=(n,),
        out_shape=(jax.ShapeDtypeStruct((num_slots,), jnp.int64),
                   jax.ShapeDtypeStruct((num_slots,), jnp.int32),
                   jax.ShapeDtypeStruct((n,), jnp.int32)),
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret, compiler_params=None if interpret else _params(),
        name="jctr_hash_insert",
    )(keys, home_slots(keys, num_slots), valid, slot_keys, claims)
    return table, slots
