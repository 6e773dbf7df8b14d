"""Evicted rows written to a database and taken back when their key returns (an embedding
layer's ``"eviction": {..., "spill": "<folder>"}``; issue 36).

A table that evicts (:func:`jctr.embedding.hash_table.lookup`) gives a new key the row of a
key its policy ranks lowest. With a spill folder, the step hands every evicted key's row --
its vector, optimizer state and slot -- to the host before the new key's row overwrites it
(:func:`spill_rows`), and a new key the database holds takes its stored row instead of an
initial vector (:func:`fetch_rows`). A row is the same whether it stayed in the table or went
through the database, so a small table trains the model a table with room for every key
trains. Evaluation reads the stored vector of a key that is not in the table.

The database is RocksDB (``spill_type`` ``"rocks_db"``, the default; a table is a column
family) or plain memory-mapped row files (``"row_file"``, :mod:`jctr.stores.row_file`, not
flushed after each write: the folder is the run's scratch, a checkpoint holds its rows).
The database holds every key evicted so far, each as of its last eviction (a key that came
back keeps its stale stored row until it is evicted again; only keys outside the table are
ever read, and those were stored at their last eviction). Which keys it holds is kept in
memory (:class:`jctr.ops.host_index.KeySet`), so rows a database holds from before this
process are never read: a checkpoint restores the spilled rows it saved
(:func:`with_spilled` / :func:`restore_spilled`).

Any number of devices and processes: on a mesh every device writes the rows its own shard
evicted and reads back its own new keys' (a key lives on one device), into its process's
database (``<folder>/process<i>`` with several processes); the devices of a replicated
table make the same evictions, which each process's first device writes, and each reads
back the same rows. A checkpoint gathers every process's
spilled rows; a restore gives each process's database its own devices' keys. The calls
are :func:`jctr.ops.host_callback` (on CPU the step's buffers read in place: ``io_callback``'s
copy onto CPU device 0 can wait forever on the other devices' collectives).

Example (a layer's JSON)::

    "eviction": {"policy": "lru", "spill": "runs/spill"}
"""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jctr.config.hps import PersistentDatabaseParams
from jctr.embedding import row_optimizers as row_opt
from jctr.errors import UserError
from jctr.ops import host_callback
from jctr.ops.host_index import KeySet

_LOCK = threading.Lock()
# the devices of a mesh call back from their own threads: a table's key set and its rows in
# the database are read and written under this lock (KeySet's compiled code runs without the
# interpreter's lock)
_IO_LOCK = threading.RLock()
_DATABASES: dict[str, tuple[str, object]] = {}  # folder -> (spill_type, its store)
_HELD: dict[tuple[str, str], KeySet] = {}  # (folder, table) -> keys stored by this process


def _database(spec):
    """The store of ``spec``'s spill folder (one per folder and process)."""
    folder, kind = os.path.abspath(spec.eviction.spill), spec.eviction.spill_type
    if jax.process_count() > 1:  # a database each: processes hold their own devices' keys
        folder = os.path.join(folder, f"process{jax.process_index()}")
    with _LOCK:
        if folder not in _DATABASES:
            if kind == "row_file":
                from jctr.stores.row_file import RowFileStore

                store = RowFileStore(folder, label="eviction.spill", durable=False)
            else:
                from jctr.stores.rocksdb import RocksDBStore

                store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=folder),
                                     label="eviction.spill", bulk=True)
            _DATABASES[folder] = (kind, store)
        have, store = _DATABASES[folder]
        if have != kind:
            raise UserError(f"embedding \"{spec.name}\": eviction.spill {folder} is a "
                            f"{have} folder of another table; spill_type \"{kind}\" needs a "
                            "folder of its own")
        return store


def _held(folder: str, table: str) -> KeySet:
    with _LOCK:
        return _HELD.setdefault((os.path.abspath(folder), table), KeySet())


def _family(spec) -> str:
    return f"spill.{spec.name}"


def _layout(spec) -> list[tuple[str, tuple[int, ...]]]:
    """The columns of a stored row: vector, each optimizer slot (by name, its shape a row), the
    input slot (from the spec: a placed table's arrays may carry a device axis first)."""
    slots = row_opt.init_slots(spec.optimizer, 1, spec.dim)
    return ([("values", (spec.dim,))] + [(name, tuple(slots[name].shape[1:]))
                                          for name in sorted(slots)] + [("row_slot", ())])


def _width(layout) -> int:
    return sum(int(np.prod(shape)) for _, shape in layout)


def _put(spec, layout, keys: np.ndarray, columns: dict[str, np.ndarray],
         at: np.ndarray | None = None) -> None:
    """Store ``keys``' rows: each column's rows (its positions ``at`` where given) packed
    side by side, one gather a column."""
    if not keys.size:
        return
    n = keys.size
    packed = np.empty((n, _width(layout)), np.float32)
    col = 0
    for name, _ in layout:
        c = np.asarray(columns[name])
        c = c.reshape(c.shape[0], -1)
        packed[:, col:col + c.shape[1]] = c if at is None else np.take(c, at, axis=0)
        col += c.shape[1]
    with _IO_LOCK:
        _database(spec).insert(_family(spec), keys, packed)
        _held(spec.eviction.spill, spec.name).add(keys)


def _get(spec, layout, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(found [n], the found keys' stored rows packed [n, width], zeros elsewhere)."""
    n = keys.size
    found = np.zeros(n, bool)
    packed = np.zeros((n, _width(layout)), np.float32)
    if n:
        with _IO_LOCK:
            held = _held(spec.eviction.spill, spec.name).contains(keys)
            rows = ok = None
            if held.any():
                rows, ok = _database(spec).lookup(_family(spec), keys[held], _width(layout))
        if rows is not None:
            at = np.flatnonzero(held)
            found[at] = ok
            packed[at[ok]] = rows[ok]
    return found, packed


def _split(layout, packed: np.ndarray) -> dict[str, np.ndarray]:
    """Packed rows [n, width] as their columns by name (views)."""
    out, col = {}, 0
    for name, shape in layout:
        w = int(np.prod(shape))
        out[name] = packed[:, col:col + w].reshape((packed.shape[0], *shape))
        col += w
    return out


def spill_rows(spec, state, lk, writes=None):
    """Hand the rows this step's new keys evicted (``lk.evicted``) to the database, read
    before the new keys' rows overwrite them; ``writes`` (a bool scalar, default true): whether
    this device writes them (a replicated table's copies evict alike: one writes). Returns a
    token the fetch waits on."""
    capacity = state.values.shape[0]
    gone = lk.evicted != jnp.int64(np.iinfo(np.int64).min)
    at = jnp.where(gone, lk.rows, capacity)

    def take(arr):
        return arr.at[at].get(mode="fill", fill_value=0).astype(jnp.float32)

    layout = _layout(spec)
    columns = {"values": take(state.values), "row_slot": take(state.row_slot),
               **{name: take(arr) for name, arr in state.slots.items()}}

    def write(writes, keys, gone, *cols):
        if writes:
            at = np.flatnonzero(gone)
            _put(spec, layout, keys[at], dict(zip((name for name, _ in layout), cols)), at)
        return (np.int32(0),)

    return host_callback(write, [jax.ShapeDtypeStruct((), jnp.int32)],
                         jnp.bool_(True) if writes is None else writes, lk.evicted, gone,
                         *[columns[name] for name, _ in layout])[0]


def fetch_rows(spec, keys, wanted, after=None):
    """(found [n], stored columns [n, ...] by name) for the ``wanted`` positions' keys the
    database holds; ``after`` (a token of :func:`spill_rows`) orders the read after the
    step's writes."""
    layout = _layout(spec)
    n = keys.shape[0]
    shapes = [jax.ShapeDtypeStruct((n,), jnp.bool_)] + [
        jax.ShapeDtypeStruct((n, *shape), jnp.float32) for _, shape in layout]

    def read(keys, wanted, _after):
        at = np.flatnonzero(wanted)  # only these keys are looked up
        got, packed = _get(spec, layout, keys[at])
        hit = at[got]
        found = np.zeros(n, bool)
        found[hit] = True
        rows = np.zeros((n, packed.shape[1]), np.float32)
        rows[hit] = packed[got]
        return [found, *_split(layout, rows).values()]

    out = host_callback(read, shapes, keys, wanted, jnp.int32(0) if after is None else after)
    return out[0], {name: col for (name, _), col in zip(layout, out[1:])}


def stored_vectors(spec, keys, missing):
    """float32 [n, dim]: the stored vector of each ``missing`` position's key (not in the
    table) that the database holds, zeros elsewhere (an evaluation reads spilled keys)."""
    found, cols = fetch_rows(spec, keys, missing)
    return jnp.where(found[:, None], cols["values"], 0.0)


def take_back(spec, state, keys, lk, after):
    """``state`` with the rows of this step's new keys that the database holds put back
    (vector, optimizer state, slot), over the initial rows they were given."""
    capacity = state.values.shape[0]
    found, cols = fetch_rows(spec, keys, lk.fresh, after)
    at = jnp.where(found, lk.rows, capacity)
    return state._replace(
        values=state.values.at[at].set(cols["values"], mode="drop"),
        row_slot=state.row_slot.at[at].set(cols["row_slot"].astype(jnp.int32), mode="drop"),
        slots={name: arr.at[at].set(cols[name].astype(arr.dtype), mode="drop")
               for name, arr in state.slots.items()})


def forget(specs) -> None:
    """Start these tables with no spilled rows in this process (a new run: rows a database
    holds from before are never read; a restored checkpoint puts its own back)."""
    for spec in specs:
        _held(spec.eviction.spill, spec.name).clear()


# -- checkpoints -------------------------------------------------------------------------------
SPILLED = "spilled"  # a stored-table column: 1 for a row that lives in the database


def with_spilled(spec, stored: dict[str, np.ndarray], *, gather: bool = False
                 ) -> dict[str, np.ndarray]:
    """An exported table (``jctr.sharding.rows`` stored-table dict) with the database's rows
    of keys outside the table appended, marked in a ``spilled`` column (a checkpoint then
    holds the whole model). ``gather``: every process's database rows (a table spread over
    several processes: each spilled its own devices' keys; called by every process)."""
    held = _held(spec.eviction.spill, spec.name).keys()
    table_keys = KeySet(max(1, stored["keys"].size))
    table_keys.add(stored["keys"])
    held = held[~table_keys.contains(held)] if held.size else held
    layout = _layout(spec)
    found, packed = _get(spec, layout, held)
    held, packed = held[found], packed[found]
    if gather:
        held, packed = _from_every_process(held, packed)
    cols = _split(layout, packed)
    n = stored["keys"].size
    out = {"keys": np.concatenate([stored["keys"], held])}
    for name, arr in stored.items():
        if name == "keys":
            continue
        if name == "slot":
            extra = cols["row_slot"].astype(arr.dtype)
        elif name in cols:
            extra = cols[name].astype(arr.dtype)
        else:  # eviction scores: a key that comes back starts as new
            extra = np.zeros((held.size, *arr.shape[1:]), arr.dtype)
        out[name] = np.concatenate([arr, extra])
    out[SPILLED] = np.concatenate([np.zeros(n, np.uint8), np.ones(held.size, np.uint8)])
    return out


def _from_every_process(keys: np.ndarray, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every process's (keys, rows), concatenated in process order, each key once."""
    from jax.experimental import multihost_utils

    counts = np.asarray(multihost_utils.process_allgather(np.array([keys.size], np.int64)))
    counts = counts.reshape(-1)
    top = max(1, int(counts.max()))
    padded_keys = np.zeros(top, np.int64)
    padded_keys[:keys.size] = keys
    padded_rows = np.zeros((top, packed.shape[1]), np.float32)
    padded_rows[:keys.size] = packed
    all_keys = np.asarray(multihost_utils.process_allgather(padded_keys)).reshape(-1, top)
    all_rows = np.asarray(multihost_utils.process_allgather(padded_rows)).reshape(
        -1, top, packed.shape[1])
    keys = np.concatenate([all_keys[p, :c] for p, c in enumerate(counts)])
    packed = np.concatenate([all_rows[p, :c] for p, c in enumerate(counts)])
    _, first = np.unique(keys, return_index=True)  # (a key is one process's: kept once)
    first.sort()
    return keys[first], packed[first]


def restore_spilled(spec, stored: dict[str, np.ndarray], held_here: np.ndarray | None = None
                    ) -> dict[str, np.ndarray]:
    """The table's part of a checkpoint's stored table; the ``spilled`` rows go into the
    database (which from now on holds exactly them for this process); ``held_here`` (bool
    per stored key): those this process's devices hold (a table spread over several
    processes: each database takes back its own devices' keys)."""
    if SPILLED not in stored:
        _held(spec.eviction.spill, spec.name).clear()
        return stored
    mark = np.asarray(stored[SPILLED]).astype(bool)
    out = {name: arr[~mark] for name, arr in stored.items() if name != SPILLED}
    _held(spec.eviction.spill, spec.name).clear()  # forget what this process wrote
    if held_here is not None:
        mark = mark & held_here
    keys = stored["keys"][mark]
    layout = _layout(spec)
    columns = {name: stored[name][mark] for name, _ in layout if name in stored}
    columns["row_slot"] = stored["slot"][mark] if "slot" in stored else np.full(keys.size, -1)
    _put(spec, layout, keys, columns)
    return out
