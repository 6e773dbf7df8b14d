import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jctr.embedding import create_table, export_items, lookup
from jctr.embedding.hash_table import num_slots_for
from jctr.ops.hashing import EMPTY_KEY, find_slots, home_slots


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


def test_num_slots_keeps_load_at_most_half():
    for cap in (1, 7, 8, 1000, 1 << 20):
        n = num_slots_for(cap)
        assert n >= 2 * cap and n & (n - 1) == 0


def test_find_slots_remainder_path():
    # a tiny table, almost half full, forces chains longer than the dense rounds
    slot_keys = jnp.full((64,), EMPTY_KEY, jnp.int64)
    keys = jnp.arange(32, dtype=jnp.int64) * 1000003
    sk, slots = find_slots(slot_keys, keys, jnp.ones(32, bool), insert=True, dense_rounds=1,
                           chunk=4)
    slots = np.asarray(slots)
    assert len(set(slots.tolist())) == 32
    assert np.array_equal(np.asarray(sk)[slots], np.asarray(keys))
