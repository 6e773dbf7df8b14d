"""The device embedding cache: a set-associative cache of embedding rows in device memory.

``capacity`` rows are ``sets x WAYS``; a key lives only in the set its hash picks, in any of
the set's ways. A lookup compares the key with the set's ways (one gather), a hit refreshes the
way's use stamp; an insert puts each key into the least recently used way of its set (several
keys of one set in one call: one per round, ``WAYS`` rounds at most; keys left over are simply
not cached). All of it is jitted with static shapes: keys are padded to a fixed count.

Example::

    cache = DeviceCache(capacity=100_000, dim=16, max_keys=8192)
    hit, vectors = cache.query(keys)              # numpy in, device arrays out
    cache.insert(keys[~hit], found_vectors)
"""

from __future__ import annotations

import threading
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.ops import hash_keys
from jctr.ops.clocks import CLOCK_LIMIT, CLOCK_SHIFT, at_most_once

WAYS = 8


class CacheState(NamedTuple):
    keys: jax.Array  # int64 [sets, WAYS]
    stamps: jax.Array  # int32 [sets, WAYS], last use; -1 where empty
    values: jax.Array  # float32 [sets, WAYS, dim]
    clock: jax.Array  # int32 [], advances once per call (turned back at CLOCK_LIMIT)


def _sets_of(keys: jax.Array, num_sets: int) -> jax.Array:
    return (hash_keys(keys) % np.uint64(num_sets)).astype(jnp.int32)


def _find(state: CacheState, keys: jax.Array, valid: jax.Array):
    """(set, hit, way) of each key."""
    sets = _sets_of(keys, state.keys.shape[0])
    match = (state.keys[sets] == keys[:, None]) & (state.stamps[sets] >= 0) & valid[:, None]
    return sets, jnp.any(match, axis=1), jnp.argmax(match, axis=1).astype(jnp.int32)


# the clock and stamps are 32-bit, and a busy server calls a table's cache thousands of times
# a second (2**31 calls within days; past them every stamp would read as empty): once the
# clock reaches CLOCK_LIMIT it goes back by CLOCK_SHIFT, every stamp with it (stamps older
# than that become 0, still cached): the LRU order is unchanged but among ways untouched for
# half a billion calls (jctr.ops.clocks)


def _turned_back(state: CacheState) -> CacheState:
    """``state``, its clock and stamps turned back once the clock reached ``CLOCK_LIMIT``
    (after the call's own writes to the stamps: before them, the loop cost a query of 8,192
    keys a third more)."""
    stamps, clock = at_most_once(
        state.clock >= CLOCK_LIMIT,
        lambda stamps, clock: (jnp.where(stamps >= 0, jnp.maximum(stamps - CLOCK_SHIFT, 0), -1),
                               clock - CLOCK_SHIFT),
        (state.stamps, state.clock))
    return state._replace(stamps=stamps, clock=clock)


@partial(jax.jit, donate_argnums=0)
def _query(state: CacheState, keys: jax.Array, valid: jax.Array):
    sets, hit, way = _find(state, keys, valid)
    values = jnp.where(hit[:, None], state.values[sets, way], 0.0)
    clock = state.clock + 1
    stamps = state.stamps.at[jnp.where(hit, sets, state.keys.shape[0]), way].set(
        clock, mode="drop")
    return _turned_back(state._replace(stamps=stamps, clock=clock)), hit, values


@partial(jax.jit, donate_argnums=0)
def _insert(state: CacheState, keys: jax.Array, values: jax.Array, valid: jax.Array):
    num_sets = state.keys.shape[0]
    sets = _sets_of(keys, num_sets)
    idx = jnp.arange(keys.shape[0], dtype=jnp.int32)
    clock = state.clock + 1

    def round_(_, carry):
        st, pending = carry
        # one key per set this round: the highest pending index claims it
        claim = jnp.full((num_sets,), -1, jnp.int32).at[sets].max(jnp.where(pending, idx, -1))
        won = pending & (claim[sets] == idx)
        victim = jnp.argmin(st.stamps[sets], axis=1).astype(jnp.int32)  # LRU (empty: -1)
        row = jnp.where(won, sets, num_sets)
        st = st._replace(
            keys=st.keys.at[row, victim].set(keys, mode="drop"),
            stamps=st.stamps.at[row, victim].set(clock, mode="drop"),
            values=st.values.at[row, victim].set(values, mode="drop"))
        return st, pending & ~won

    state, _ = jax.lax.fori_loop(0, WAYS, round_, (state, valid))
    return _turned_back(state._replace(clock=clock))


@partial(jax.jit, donate_argnums=0)
def _refresh(state: CacheState, keys: jax.Array, values: jax.Array, valid: jax.Array):
    """New values for keys still cached (no stamp change: a refresh is not a use)."""
    sets, hit, way = _find(state, keys, valid)
    row = jnp.where(hit, sets, state.keys.shape[0])
    return state._replace(values=state.values.at[row, way].set(values, mode="drop"))


@partial(jax.jit, donate_argnums=0)
def _forget(state: CacheState, keys: jax.Array, valid: jax.Array):
    """Keys still cached made empty ways (the set's least recent: the next insert's)."""
    sets, hit, way = _find(state, keys, valid)
    row = jnp.where(hit, sets, state.keys.shape[0])
    return state._replace(stamps=state.stamps.at[row, way].set(-1, mode="drop"))


def _pad(n: int) -> int:
    """Padded key count: the next power of two (few compiled shapes)."""
    return max(64, 1 << (max(n, 1) - 1).bit_length())


# keys per refresh call for rows of any count (online updates): one compiled shape. A shape
# first met compiles for ~0.2 s, under the cache's lock, which requests wait on; a 65,536-row
# update refreshes in 8.8 ms in chunks of this size against 6.8 ms in one call
# (docs/performance.md)
REFRESH_ROWS = 4096


class DeviceCache:
    """One table's cache (see the module docstring). Thread-safe: lookups, inserts and refreshes
    may come from the request thread, the asynchronous insert worker and the refresher."""

    def __init__(self, capacity: int, dim: int, device=None):
        self.num_sets = max(1, -(-capacity // WAYS))
        self.capacity = self.num_sets * WAYS
        self.dim = dim
        self._lock = threading.Lock()
        with jax.default_device(device or jax.local_devices()[0]):
            self.state = CacheState(
                keys=jnp.zeros((self.num_sets, WAYS), jnp.int64),
                stamps=jnp.full((self.num_sets, WAYS), -1, jnp.int32),
                values=jnp.zeros((self.num_sets, WAYS, dim), jnp.float32),
                clock=jnp.zeros((), jnp.int32))

    @staticmethod
    def bytes_for(capacity: int, dim: int) -> int:
        """Device memory a cache of ``capacity`` rows of ``dim`` floats holds (its updates
        donate it: no second copy)."""
        return max(1, -(-int(capacity) // WAYS)) * WAYS * (8 + 4 + 4 * int(dim))

    @staticmethod
    def _padded(keys: np.ndarray, values: np.ndarray | None = None, dim: int = 0,
                size: int | None = None):
        n = keys.size
        size = size or _pad(n)
        k = np.zeros(size, np.int64)
        k[:n] = keys
        valid = np.zeros(size, bool)
        valid[:n] = True
        if values is None:
            return k, valid, None
        v = np.zeros((size, dim), np.float32)
        v[:n] = values
        return k, valid, v

    def query(self, keys: np.ndarray, size: int | None = None) -> tuple[np.ndarray, jax.Array]:
        """``(hit [n] numpy bool, vectors [size, dim] device array)`` for distinct keys, padded
        to ``size`` (default: the next power of two); rows past ``n`` and misses are zeros."""
        k, valid, _ = self._padded(keys, size=size)
        with self._lock:
            self.state, hit, values = _query(self.state, k, valid)
        return np.asarray(hit)[:keys.size], values

    def insert(self, keys: np.ndarray, values: np.ndarray, size: int | None = None) -> None:
        """Cache distinct keys that are not cached (each evicts its set's least recent way);
        ``size`` pads them to a fixed count (one compiled shape)."""
        if not keys.size:
            return
        k, valid, v = self._padded(keys, values, self.dim, size)
        with self._lock:
            self.state = _insert(self.state, k, v, valid)

    def refresh(self, keys: np.ndarray, values: np.ndarray, size: int | None = None) -> None:
        """New values for those of ``keys`` that are still cached."""
        if not keys.size:
            return
        k, valid, v = self._padded(keys, values, self.dim, size)
        with self._lock:
            self.state = _refresh(self.state, k, v, valid)

    def refresh_rows(self, keys: np.ndarray, values: np.ndarray) -> None:
        """:meth:`refresh` of any number of keys in calls of ``REFRESH_ROWS`` (one compiled
        shape whatever the sizes of the updates that come)."""
        for s in range(0, keys.size, REFRESH_ROWS):
            self.refresh(keys[s:s + REFRESH_ROWS], values[s:s + REFRESH_ROWS], REFRESH_ROWS)

    def forget_rows(self, keys: np.ndarray) -> None:
        """Those of ``keys`` that are cached, no longer (erased from the model), in calls of
        ``REFRESH_ROWS`` keys."""
        for s in range(0, keys.size, REFRESH_ROWS):
            k, valid, _ = self._padded(keys[s:s + REFRESH_ROWS], size=REFRESH_ROWS)
            with self._lock:
                self.state = _forget(self.state, k, valid)

    def compile_refresh(self) -> None:
        """Compile :meth:`refresh_rows`' step now, without holding the lock requests take
        (it changes nothing): the first update then waits for no compile, and no request
        waits behind one."""
        with self._lock:
            state = self.state
        k, valid, v = self._padded(np.zeros(0, np.int64), np.zeros((0, self.dim), np.float32),
                                   self.dim, REFRESH_ROWS)
        # lowered from the arrays themselves (their shapes and device; a call that donated
        # them meanwhile leaves them readable for this): shape structs with a sharding lower
        # to a program the call does not find
        _refresh.lower(state, k, v, valid).compile()

    def cached_keys(self, first_set: int, num_sets: int) -> np.ndarray:
        """The keys cached in sets ``[first_set, first_set + num_sets)`` (for refreshes)."""
        with self._lock:
            keys = np.asarray(self.state.keys[first_set:first_set + num_sets])
            used = np.asarray(self.state.stamps[first_set:first_set + num_sets]) >= 0
        return keys[used]

    def size(self) -> int:
        with self._lock:
            return int(jnp.sum(self.state.stamps >= 0))
