import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jctr.embedding import create_table, export_items, lookup
from jctr.embedding.hash_table import num_slots_for
from jctr.ops.hashing import EMPTY_KEY, find_slots, home_slots
from tests.conftest import native_cpu_only


def _lookup(table, keys, capacity, insert, valid=None):
    keys = jnp.asarray(keys, jnp.int64)
    valid = jnp.ones(keys.shape, bool) if valid is None else jnp.asarray(valid)
    return jax.jit(lookup, static_argnames=("capacity", "insert", "dedupe"))(
        table, keys, valid, capacity=capacity, insert=insert)


def test_distinct_keys_get_distinct_rows_with_many_collisions():
    capacity = 5000
    table = create_table(capacity)
    n_slots = table.num_slots
    # keys that all share one home slot: the worst case for linear probing
    rng = np.random.default_rng(0)
    cand = rng.integers(-(2**62), 2**62, size=400_000, dtype=np.int64)
    homes = np.asarray(home_slots(jnp.asarray(cand), n_slots))
    colliding = np.unique(cand[homes == np.bincount(homes).argmax()])
    spread = np.unique(rng.integers(0, 2**63 - 1, size=3000, dtype=np.int64))
    keys = np.concatenate([colliding, spread])
    batch = np.concatenate([keys, keys[::-1], keys[:100]])  # duplicates within the batch
    table, lk = _lookup(table, batch, capacity, True)
    rows = np.asarray(lk.rows)
    n = len(keys)
    assert int(table.size) == n
    assert len(np.unique(rows)) == n and rows.min() == 0 and rows.max() == n - 1
    # the same key always maps to the same row
    assert np.array_equal(rows[:n], rows[n:2 * n][::-1])
    # lookups (no insert) return the same rows
    _, lk2 = _lookup(table, keys, capacity, False)
    assert np.array_equal(np.asarray(lk2.rows), rows[:n])
    ek, er = export_items(table)
    assert np.array_equal(np.sort(ek), np.sort(keys)) and np.array_equal(er, np.arange(n))


def test_representatives_mark_one_position_per_row():
    table = create_table(100)
    keys = np.array([5, 7, 5, 5, 9, 7, -3, 2**62], np.int64)
    table, lk = _lookup(table, keys, 100, True)
    rep = np.asarray(lk.rep)
    rows = np.asarray(lk.rows)
    for i in range(len(keys)):
        assert rows[rep[i]] == rows[i]
    assert (rep == np.arange(len(keys))).sum() == len(np.unique(keys))


def test_unknown_keys_at_eval_are_not_inserted():
    table = create_table(64)
    table, _ = _lookup(table, [1, 2, 3], 64, True)
    table2, lk = _lookup(table, [2, 99, 3, -7], 64, False)
    rows = np.asarray(lk.rows)
    assert rows[1] == -1 and rows[3] == -1 and rows[0] >= 0 and rows[2] >= 0
    assert int(table2.size) == 3
    assert np.array_equal(np.asarray(table2.slot_keys), np.asarray(table.slot_keys))


def test_padding_keys_are_ignored():
    table = create_table(16)
    table, lk = _lookup(table, [4, 4, 8], 16, True, valid=[True, False, False])
    assert int(table.size) == 1 and list(np.asarray(lk.rows)) == [0, -1, -1]


def test_capacity_overflow_is_counted_and_never_corrupts():
    capacity = 10
    table = create_table(capacity)
    table, lk = _lookup(table, np.arange(25), capacity, True)
    rows = np.asarray(lk.rows)
    assert int(table.size) == capacity and int(table.overflow) == 15
    assert sorted(rows[rows >= 0]) == list(range(capacity))
    assert (rows < capacity).all()


def test_full_table_raises_in_training(tmp_path):
    from jctr.embedding import TableFullError
    from jctr.train.trainer import Trainer
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, "dlrm", max_iter=5, display=100, eval_interval=1000)
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = 50
    with pytest.raises(TableFullError, match="sparse_embedding1.*50 rows"):
        Trainer.from_config(cfg).fit()


def test_num_slots_are_whole_buckets_at_most_85_percent_full():
    """Issue 36 point 4: about 1.18 slots per row (was a power of two >= 2x), in whole
    buckets; an evicting table keeps two slots a row (room for new keys and tombstones)."""
    from jctr.config.schema import EvictionConfig
    from jctr.ops.hashing import BUCKET

    for cap in (1, 7, 8, 1000, 1 << 20, 3_000_000):
        n = num_slots_for(cap)
        assert n % BUCKET == 0 and cap <= 0.85 * n and (n < 32 or n < 1.2 * cap), (cap, n)
        e = num_slots_for(cap, EvictionConfig("lru"))
        assert e % BUCKET == 0 and e >= 2 * cap
    assert num_slots_for(1 << 20) * 16 <= 0.6 * (1 << 21) * 16  # slot bytes vs the old layout


def test_find_slots_remainder_path():
    # a tiny table, almost half full, forces chains longer than the dense rounds
    slot_keys = jnp.full((64,), EMPTY_KEY, jnp.int64)
    keys = jnp.arange(32, dtype=jnp.int64) * 1000003
    sk, slots = find_slots(slot_keys, keys, jnp.ones(32, bool), insert=True, dense_rounds=1,
                           chunk=4)
    slots = np.asarray(slots)
    assert len(set(slots.tolist())) == 32
    assert np.array_equal(np.asarray(sk)[slots], np.asarray(keys))


def test_erase_and_insert_follow_a_dictionary_model():
    """Long random sequences of inserts and erases (issue 36): after every operation the table
    finds exactly the keys a dictionary holds, each at its own row below the capacity; erased
    rows are reused before new ones (the high-water mark never passes the most keys held at
    once); a full table takes as many new keys as it has rows left, and counts the others."""
    from jctr.embedding.hash_table import erase, occupied_slots

    rng = np.random.default_rng(7)
    capacity, universe = 48, 200
    ins = jax.jit(lambda t, k, v: lookup(t, k, v, capacity, insert=True))
    find = jax.jit(lambda t, k, v: lookup(t, k, v, capacity, insert=False)[1].rows)
    era = jax.jit(erase)
    table, held, most, refused = create_table(capacity), set(), 0, 0
    everything = jnp.arange(universe, dtype=jnp.int64) * 7919 + 3
    for step in range(300):
        n = 16
        keys = np.asarray(everything)[rng.integers(0, universe, n)]
        valid = rng.random(n) < 0.9
        if rng.random() < 0.55:
            table, lk = ins(table, jnp.asarray(keys), jnp.asarray(valid))
            new = set(keys[valid].tolist()) - held
            # which of the new keys a full table takes is its own choice; how many is not
            rows = np.asarray(find(table, everything, jnp.ones(universe, bool)))
            got = {int(k) for k, r in zip(np.asarray(everything), rows) if r >= 0} - held
            assert got <= new and len(got) == min(len(new), capacity - len(held)), step
            held |= got
            refused += len(new) - len(got)
        else:
            keys = np.unique(keys)
            valid = rng.random(keys.size) < 0.9
            table, rows = era(table, jnp.asarray(keys), jnp.asarray(valid))
            gone = {k for k, v in zip(keys.tolist(), valid) if v and k in held}
            assert int((np.asarray(rows) >= 0).sum()) == len(gone), step
            held -= gone
        most = max(most, len(held))
        if int(occupied_slots(table)) > 0.6 * table.num_slots:
            # tombstones (and refused keys) crowd the slots: built again, as the shrink does
            kept, _ = export_items(table)
            fresh, _ = ins(create_table(capacity), jnp.asarray(kept), jnp.ones(kept.size, bool))
            table = fresh._replace(overflow=table.overflow)
            most = len(held)
        rows = np.asarray(find(table, everything, jnp.ones(universe, bool)))
        present = {int(k) for k, r in zip(np.asarray(everything), rows) if r >= 0}
        assert present == held, step
        used = rows[rows >= 0]
        assert used.size == np.unique(used).size and (used < capacity).all(), step
        assert int(table.size) - int(table.free_count) == len(held), step
        assert int(table.size) <= most, step
        assert int(table.overflow) == refused, step
    assert int(occupied_slots(table)) >= len(held)  # tombstones count as occupied


def test_an_erased_row_starts_as_new_for_the_next_key():
    """A row freed by erase holds what an unused row holds (zero vector, no slot, the
    optimizer's initial state); the key that takes it gets its initial vector."""
    from jctr.config import parse_config
    from jctr.embedding.sparse_embedding import (
        EmbeddingSpec,
        erase_keys,
        init_embedding,
        initial_vectors,
        lookup_keys,
    )
    from tests.conftest import load_json

    raw = load_json("dlrm_synthetic.json")
    raw["layers"][1]["optimizer"] = {"type": "Adam", "update_type": "Local"}
    raw["layers"][0].pop("synthetic")
    cfg = parse_config(raw)
    spec = EmbeddingSpec.from_config(cfg, cfg.embeddings[0])
    state = init_embedding(spec)
    keys = jnp.arange(10, dtype=jnp.int64) + 100
    ones = jnp.ones(10, bool)
    state, lk = lookup_keys(spec, state, keys, ones, jnp.zeros(10, jnp.int32), train=True)
    state = state._replace(slots={k: v + 1.0 for k, v in state.slots.items()})  # "trained"
    state, n = erase_keys(spec, state, keys[:4], jnp.ones(4, bool))
    assert int(n) == 4
    freed = np.asarray(lk.rows)[:4]
    assert (np.asarray(state.row_slot)[freed] == -1).all()
    for arr in state.slots.values():
        np.testing.assert_array_equal(np.asarray(arr)[freed], 0.0)
    new = jnp.arange(3, dtype=jnp.int64) + 500
    state, lk2 = lookup_keys(spec, state, new, jnp.ones(3, bool), jnp.zeros(3, jnp.int32),
                             train=True)
    rows = np.asarray(lk2.rows)
    assert set(rows.tolist()) <= set(freed.tolist())  # reused, not new rows
    np.testing.assert_allclose(np.asarray(state.values)[rows],
                               np.asarray(initial_vectors(spec, new)), rtol=1e-6)


def _adam_spec():
    """The synthetic DLRM's embedding with Adam rows (optimizer state a row must not lose)."""
    from jctr.config import parse_config
    from jctr.embedding.sparse_embedding import EmbeddingSpec
    from tests.conftest import load_json

    raw = load_json("dlrm_synthetic.json")
    raw["layers"][1]["optimizer"] = {"type": "Adam", "update_type": "Local"}
    raw["layers"][0].pop("synthetic")
    cfg = parse_config(raw)
    return EmbeddingSpec.from_config(cfg, cfg.embeddings[0])


def _stored_rows(spec, rng, n: int) -> dict:
    """``n`` stored rows of distinct keys: vectors, slot ids and optimizer state."""
    from jctr.embedding.sparse_embedding import init_embedding

    keys = rng.choice(10**9, n, replace=False).astype(np.int64)
    out = {"keys": keys, "values": rng.normal(size=(n, spec.dim)).astype(np.float32),
           "slot": rng.integers(0, spec.slot_num, n).astype(np.int32)}
    for name, arr in init_embedding(spec).slots.items():
        out[name] = rng.normal(size=(n, *arr.shape[1:])).astype(np.float32)
    return out


def _slot_map(table) -> dict:
    keys, rows = np.asarray(table.slot_keys), np.asarray(table.slot_rows)
    return dict(zip(keys[rows >= 0].tolist(), rows[rows >= 0].tolist()))


def test_a_consumed_table_is_emptied_and_filled_in_place_as_a_fresh_one():
    """put_rows(replace=True, consume=True) (streaming's sparse_store moves its working set
    with it) reuses the table's buffers: the result equals put_rows into a fresh table array
    by array (free rows' optimizer state initial again, not the last pass's), and the table
    given is consumed."""
    from jctr.embedding.sparse_embedding import init_embedding
    from jctr.sharding import rows as rows_mod

    spec = _adam_spec()
    rng = np.random.default_rng(1)
    used = rows_mod.put_rows(spec, init_embedding(spec), None, _stored_rows(spec, rng, 3000),
                             replace=True)
    later = _stored_rows(spec, rng, 1000)
    want = rows_mod.put_rows(spec, jax.tree.map(jnp.copy, used), None, later, replace=True)
    got = rows_mod.put_rows(spec, used, None, later, replace=True, consume=True)
    assert used.values.is_deleted()
    # which slot of its chain a key takes follows the GPU's claim race (its row does not):
    # the slots compare as key -> row maps, the scratch's contents never matter
    assert _slot_map(got.table) == _slot_map(want.table)
    by_slot = ("slot_keys", "slot_rows", "scratch")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        if jax.default_backend() == "cpu" or getattr(path[-1], "name", None) not in by_slot:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                          err_msg=jax.tree_util.keystr(path))
    empty = rows_mod.put_rows(spec, got, None, {k: v[:0] for k, v in later.items()},
                              replace=True, consume=True)
    for a, b in zip(jax.tree.leaves(empty), jax.tree.leaves(init_embedding(spec))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_shrink_by_erase_equals_the_rebuild(monkeypatch):
    """drop_keys (streaming training's shrink) erases on a one-device table; the table holds
    the same keys with the same vectors, optimizer rows and slots whether its slots are built
    again after the erase (when the tombstones would crowd a refill: forced here) or not, and
    keys inserted afterwards start alike. Keys given twice are erased once."""
    from jctr.embedding.sparse_embedding import init_embedding, lookup_keys
    from jctr.sharding import rows as rows_mod

    spec = _adam_spec()
    rng = np.random.default_rng(0)
    n = 3000
    stored = _stored_rows(spec, rng, n)
    keys = stored["keys"]
    full = rows_mod.put_rows(spec, init_embedding(spec), None, stored, replace=True)
    deleted = keys[rng.random(n) < 0.3]

    def by_key(state):
        out = rows_mod.export_placed(state)
        order = np.argsort(out["keys"])
        return {k: v[order] for k, v in out.items()}

    twice = np.concatenate([deleted, deleted[:50]])
    erased, in_use = rows_mod.drop_keys(spec, jax.tree.map(jnp.copy, full), None, twice)
    assert in_use == n - deleted.size
    assert int(erased.table.free_count) == int(erased.table.tombstones) == deleted.size
    monkeypatch.setattr(rows_mod, "MAX_FILL", 0.0)
    rebuilt, in_use2 = rows_mod.drop_keys(spec, full, None, deleted)
    assert in_use2 == in_use and int(rebuilt.table.free_count) == deleted.size
    assert int(rebuilt.table.tombstones) == 0  # the slots were built again
    a, b = by_key(erased), by_key(rebuilt)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    new = jnp.asarray(rng.choice(10**9, 500, replace=False).astype(np.int64) + 10**9)
    slots = jnp.asarray(rng.integers(0, spec.slot_num, 500), jnp.int32)
    ones = jnp.ones(500, bool)
    erased, _ = lookup_keys(spec, erased, new, ones, slots, train=True)
    rebuilt, _ = lookup_keys(spec, rebuilt, new, ones, slots, train=True)
    a, b = by_key(erased), by_key(rebuilt)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_full_table_at_85_percent_of_its_slots_erases_rebuilds_and_refills():
    """Issue 36 point 4: a table whose every row is in use fills 85% of its slots (bucketed
    probing); erasing a third of its keys leaves tombstones, ``rebuild_slots`` clears them
    (the shrink calls it when a refill would crowd the slots) without moving a row, and new
    keys then take exactly the freed rows; every kept key is found at its row throughout,
    by the native kernels and by the jnp reference alike."""
    import os

    from jctr.embedding.hash_table import erase, occupied_slots, rebuild_slots

    capacity = 4000
    rng = np.random.default_rng(3)
    keys = rng.choice(2**62, capacity, replace=False).astype(np.int64)
    ones = jnp.ones(capacity, bool)
    for mode in ("auto", "reference"):
        os.environ["JCTR_KERNELS"] = mode
        try:
            ins = jax.jit(lambda t, k, v: lookup(t, k, v, capacity, insert=True))
            find = jax.jit(lambda t, k: lookup(t, k, jnp.ones(k.shape, bool), capacity,
                                               insert=False)[1].rows)
            table, lk = ins(create_table(capacity), jnp.asarray(keys), ones)
            rows = np.asarray(lk.rows)
            assert sorted(rows.tolist()) == list(range(capacity))
            assert int(occupied_slots(table)) == capacity >= 0.84 * table.num_slots
            gone = rng.random(capacity) < 0.33
            table, freed = jax.jit(erase)(table, jnp.asarray(keys[gone]),
                                          jnp.ones(int(gone.sum()), bool))
            assert int(table.tombstones) == gone.sum() == int((np.asarray(freed) >= 0).sum())
            table = jax.jit(rebuild_slots)(table)
            assert int(table.tombstones) == 0
            assert int(occupied_slots(table)) == capacity - gone.sum()
            got = np.asarray(find(table, jnp.asarray(keys)))
            np.testing.assert_array_equal(got[~gone], rows[~gone])
            assert (got[gone] == -1).all()
            new = rng.choice(2**62, int(gone.sum()), replace=False).astype(np.int64) | 1
            table, lk = ins(table, jnp.asarray(new), jnp.ones(new.size, bool))
            assert sorted(np.asarray(lk.rows).tolist()) == sorted(rows[gone].tolist())
            assert int(table.overflow) == 0
            np.testing.assert_array_equal(np.asarray(find(table, jnp.asarray(keys[~gone]))),
                                          rows[~gone])
        finally:
            os.environ.pop("JCTR_KERNELS", None)


def test_a_synchronous_export_takes_views_and_the_default_copies():
    """export_placed(copy=False) (a synchronous save, done before the table changes) gives
    rows 0..n-1 as views of the host arrays, no copy of a table; by default (an asynchronous
    snapshot while training goes on) the rows are copies. Both hold the same rows."""
    from jctr.config import parse_config
    from jctr.embedding.sparse_embedding import EmbeddingSpec, init_embedding, lookup_keys
    from jctr.sharding import rows as rows_mod
    from jctr.sharding.mesh import to_host
    from tests.conftest import load_json

    raw = load_json("dlrm_synthetic.json")
    raw["layers"][0].pop("synthetic")
    cfg = parse_config(raw)
    spec = EmbeddingSpec.from_config(cfg, cfg.embeddings[0])
    keys = jnp.arange(50, dtype=jnp.int64) * 7 + 3
    state, _ = lookup_keys(spec, init_embedding(spec), keys, jnp.ones(50, bool),
                           jnp.zeros(50, jnp.int32), train=True)
    views = rows_mod.export_placed(state, copy=False)
    copies = rows_mod.export_placed(state)
    assert views.keys() == copies.keys()
    for name in views:
        np.testing.assert_array_equal(views[name], copies[name], err_msg=name)
    assert np.shares_memory(views["values"], to_host(state.values))
    assert not np.shares_memory(copies["values"], to_host(state.values))



@native_cpu_only
@pytest.mark.parametrize("no_empty_slot", [False, True])
@pytest.mark.parametrize("evicting", [False, True])
def test_the_native_rebuild_places_keys_as_the_native_insert_of_the_old_slots(
        evicting, no_empty_slot, monkeypatch):
    """``rebuild_slots`` on CPU is one native sweep over the slots, in place
    (``jctr_cpu_rebuild_slots``): each key moves back to the first empty slot of its probe,
    its row entry and (an evicting table) its scores with it; tombstones and keys without a
    row leave. It equals the XLA formulation around the native batch insert (``find_slots``
    of the keys in slot order from ``rebuild_start``, then scatters), slot for slot: keys,
    rows, scores, with tombstones left by erasing a third of the keys of a table of 4,000
    rows and twelve keys whose home is the last bucket (their probes wrap to the first
    slots); and for slots with no empty one left (every empty slot made a tombstone: the
    sweep has no bucket to start after, and inserts the keys anew from a copy)."""
    from jctr.config.schema import EvictionConfig
    from jctr.embedding import hash_table as ht
    from jctr.ops import dispatch
    from jctr.ops.hashing import home_slots

    capacity = 4000
    ev = EvictionConfig("lfu") if evicting else None
    n_slots = ht.num_slots_for(capacity, ev)
    rng = np.random.default_rng(5)
    pool = rng.choice(2**62, 400 * capacity, replace=False).astype(np.int64)
    rest = pool[capacity:]
    last = rest[np.asarray(home_slots(jnp.asarray(rest), n_slots)) == n_slots - 8][:12]
    assert last.size == 12
    keys = np.concatenate([pool[:capacity - 12], last])
    table, _ = jax.jit(lambda t, k: lookup(t, k, jnp.ones(k.shape, bool), capacity,
                                           insert=True))(ht.create_table(capacity, ev),
                                                         jnp.asarray(keys))
    assert np.isin(last, np.asarray(table.slot_keys)[:n_slots // 2]).any()  # wrapped
    if evicting:
        held = np.asarray(table.slot_rows)[:, None] >= 0  # (empty slots score 0)
        table = table._replace(slot_score=jnp.asarray(np.where(held, rng.integers(
            1, 50, table.slot_score.shape), 0), jnp.int32))
    gone = rng.random(capacity) < 0.33
    table, _ = jax.jit(ht.erase)(table, jnp.asarray(keys[gone]),
                                 jnp.ones(int(gone.sum()), bool))
    if no_empty_slot:
        table = table._replace(slot_keys=jnp.where(table.slot_keys == EMPTY_KEY,
                                                   ht.TOMBSTONE, table.slot_keys))
    calls = []
    native = dispatch.cpu_ffi.rebuild_slots
    monkeypatch.setattr(dispatch.cpu_ffi, "rebuild_slots",
                        lambda *a: calls.append(1) or native(*a))
    monkeypatch.setenv("JCTR_KERNELS", "auto")
    got = jax.jit(lambda t: ht.rebuild_slots(t))(table)  # a trace of its own
    assert calls, "the native rebuild did not run"
    monkeypatch.setattr(ht, "rebuild", lambda reference, *a: reference(*a))
    want = jax.jit(lambda t: ht.rebuild_slots(t))(table)  # XLA's scatters around the native insert
    for name in ("slot_keys", "slot_rows", "slot_score", "tombstones"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(want, name)), err_msg=name)
    live = np.asarray(got.slot_rows) >= 0
    assert live.sum() == capacity - gone.sum() and not (np.asarray(got.slot_keys)[~live]
                                                        != EMPTY_KEY).any()


@native_cpu_only
@pytest.mark.parametrize("capacity,buckets", [(40, True), (203, False), (512, True)])
def test_the_native_rebuild_equals_the_xla_one_over_random_erases_and_inserts(
        capacity, buckets, monkeypatch):
    """Small tables through 12 rounds of random inserts, erases of up to half the keys and
    rebuilds (one of 239 slots: no whole number of buckets, plain linear probing): the native
    sweep in place and the XLA formulation give the same slots each round, and every key
    left is found at its row."""
    from jctr.embedding import hash_table as ht

    if not buckets:
        monkeypatch.setattr(ht, "num_slots_for", lambda c, ev=None: -(-c * 100 // 85))
    rng = np.random.default_rng(capacity)
    ins = jax.jit(lambda t, k, v: lookup(t, k, v, capacity, insert=True))
    find = jax.jit(lambda t, k: lookup(t, k, jnp.ones(k.shape, bool), capacity,
                                       insert=False)[1].rows)
    drop = jax.jit(ht.erase)
    monkeypatch.setenv("JCTR_KERNELS", "auto")
    native = jax.jit(lambda t: ht.rebuild_slots(t))
    with monkeypatch.context() as m:
        m.setattr(ht, "rebuild", lambda reference, *a: reference(*a))
        xla = jax.jit(lambda t: ht.rebuild_slots(t))  # traced inside the patch
        table = ht.create_table(capacity)
        assert (table.num_slots % 8 == 0) == buckets
        held: dict[int, int] = {}
        for r in range(12):
            room = capacity - len(held)
            new = rng.choice(2**40, room, replace=False).astype(np.int64) + 1
            table, lk = ins(table, jnp.asarray(new), jnp.ones(room, bool))
            held.update(zip(new.tolist(), np.asarray(lk.rows).tolist()))
            gone = rng.choice(sorted(held), int(rng.integers(1, len(held) // 2 + 1)),
                              replace=False)
            table, _ = drop(table, jnp.asarray(gone), jnp.ones(gone.size, bool))
            for k in gone.tolist():
                del held[k]
            a, b = native(table), xla(table)
            for name in ("slot_keys", "slot_rows"):
                np.testing.assert_array_equal(np.asarray(getattr(a, name)),
                                              np.asarray(getattr(b, name)),
                                              err_msg=f"round {r}: {name}")
            table = a
            keys = np.array(sorted(held), np.int64)
            np.testing.assert_array_equal(np.asarray(find(table, jnp.asarray(keys))),
                                          [held[k] for k in keys.tolist()])
