"""Pallas kernel for hash-table lookups of 64-bit keys (Triton on GPU; ``interpret=True`` on
CPU): one program per key walks its linear-probing chain until the key or a free slot.

Inserts stay on the XLA formulation (:func:`jctr.ops.hashing.find_slots`): a concurrent insert
needs an indexed atomic compare-and-swap, and Pallas' Triton ``atomic_cas`` (jax 0.10) takes a
whole ref, not an element of one. An insert kernel therefore needs plain Triton (jax-triton),
which cannot be compiled or tested on a machine without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jctr.ops.hashing import EMPTY_KEY, home_slots
from jctr.ops.pallas_bag import _params


def _lookup_kernel(keys_ref, home_ref, valid_ref, table_ref, slots_ref, *, num_slots):
    i = pl.program_id(0)
    key = keys_ref[i]
    empty = jnp.int64(EMPTY_KEY)

    def cond(c):
        _, done, _, steps = c
        return (~done) & (steps < num_slots)

    def body(c):
        pos, _, _, steps = c
        cur = table_ref[pos]
        found = cur == key
        stop = found | (cur == empty)
        slot = jnp.where(found, pos, jnp.int32(-1))
        nxt = jnp.where(stop, pos, (pos + 1) & (num_slots - 1))
        return nxt, stop, slot, steps + 1

    start = (home_ref[i], ~valid_ref[i], jnp.int32(-1), jnp.int32(0))
    _, _, slot, _ = jax.lax.while_loop(cond, body, start)
    slots_ref[i] = slot


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
