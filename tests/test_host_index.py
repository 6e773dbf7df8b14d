"""The compiled host index (jctr/ops/host_index.py) that the CPU memory database and the
streaming statistics keep their keys with, against a dictionary."""

import numpy as np
import pytest

from jctr.ops import host_index


def test_upsert_find_and_rebuild_equal_a_dictionary():
    rng = np.random.default_rng(0)
    cap = 5000
    index = np.full(host_index.index_size(cap), -1, np.int64)
    keys = np.empty(cap, np.int64)
    model: dict[int, int] = {}
    n = 0
    for _ in range(20):  # colliding small keys and the extremes of int64 alike
        q = np.concatenate([rng.integers(-300, 300, 150),
                            rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 50)])
        rows = np.empty(q.size, np.int64)
        n = host_index.upsert(index, keys, n, q, rows)
        for k, r in zip(q.tolist(), rows.tolist()):
            assert model.setdefault(k, len(model)) == r
    assert n == len(model)
    probe = np.concatenate([np.array(list(model), np.int64), np.arange(1000, 1100)])
    want = [model.get(k, -1) for k in probe.tolist()]
    np.testing.assert_array_equal(host_index.find(index, keys, probe), want)
    again = np.empty_like(index)
    assert host_index.rebuild(again, keys, n) == -1
    np.testing.assert_array_equal(host_index.find(again, keys, probe), want)
    keys[n - 1] = keys[0]  # a key twice: rebuild names the first repeat
    assert host_index.rebuild(again, keys, n) == n - 1


def test_upsert_values_keeps_the_last_row_of_a_key_as_a_dictionary_does():
    """``upsert_values`` (the hash map's insert in one pass): rows handed out as ``upsert``
    hands them, and each key's values and stamp those of its last occurrence across and
    within batches (many repeats: 300 distinct keys in 3,000), as a dictionary assigned in
    order leaves them."""
    rng = np.random.default_rng(1)
    cap, width = 4000, 5
    index = np.full(host_index.index_size(cap), -1, np.int64)
    keys = np.empty(cap, np.int64)
    dest = np.zeros((cap, width), np.float32)
    stamps = np.zeros(cap, np.int64)
    rows_of: dict[int, int] = {}
    last: dict[int, tuple[list[float], int]] = {}
    n = 0
    for now in range(1, 11):
        q = rng.integers(-150, 150, 300)
        src = rng.normal(size=(q.size, width)).astype(np.float32)
        n = host_index.upsert_values(index, keys, n, q, src, dest, stamps, now)
        for k, v in zip(q.tolist(), src.tolist()):
            rows_of.setdefault(k, len(rows_of))
            last[k] = (v, now)
    assert n == len(rows_of)
    probe = np.array(list(rows_of), np.int64)
    rows = host_index.find(index, keys, probe)
    np.testing.assert_array_equal(rows, [rows_of[k] for k in probe.tolist()])
    np.testing.assert_array_equal(dest[rows], np.array([last[k][0] for k in probe.tolist()],
                                                       np.float32))
    np.testing.assert_array_equal(stamps[rows], [last[k][1] for k in probe.tolist()])


def test_a_scans_rows_go_to_the_rows_of_the_keys_asked_for_and_the_others_are_kept_apart():
    """``scatter_found`` (a scan of a RocksDB table into the rows of the keys a pass asks
    for) and ``KeySet.absent_rows`` (a scan's rows but those of the held keys), in chunks,
    against numpy's find, mask and scatter / compress: colliding small keys, int64's
    extremes, keys asked for that no chunk holds."""
    rng = np.random.default_rng(7)
    asked = np.unique(np.concatenate([rng.integers(-500, 500, 400),
                                      [np.iinfo(np.int64).min, np.iinfo(np.int64).max]]))
    index = np.full(host_index.index_size(asked.size), -1, np.int64)
    distinct = np.empty(asked.size, np.int64)
    at = np.empty(asked.size, np.int64)
    assert host_index.upsert(index, distinct, 0, asked, at) == asked.size
    held_set = host_index.KeySet()
    held_set.add(asked)
    dest = np.zeros((asked.size, 3), np.float32)
    held = np.zeros(asked.size, bool)
    want_dest, want_held = dest.copy(), held.copy()
    for _ in range(5):  # chunks of stored keys, each key stored once
        stored = np.unique(np.concatenate([rng.choice(asked, 60, replace=False),
                                           rng.integers(600, 10**6, 90)]))
        rng.shuffle(stored)
        src = rng.normal(size=(stored.size, 3)).astype(np.float32)
        rows = host_index.find(index, distinct, stored)
        hit = rows >= 0
        want_dest[rows[hit]] = src[hit]
        want_held[rows[hit]] = True
        found = host_index.scatter_found(index, distinct, stored, src, dest, held)
        assert found == hit.sum()
        keys_out, rows_out = held_set.absent_rows(stored, src)
        np.testing.assert_array_equal(keys_out, stored[~hit])
        np.testing.assert_array_equal(rows_out, src[~hit])
    np.testing.assert_array_equal(dest, want_dest)
    np.testing.assert_array_equal(held, want_held)
    assert 0 < held.sum() < asked.size


def test_rebuild_of_distinct_keys_finds_what_rebuild_finds():
    """``rebuild_distinct`` (no key compared while probing) gives an index in which every row
    is found at its key, as ``rebuild``'s; keys crowding the last slots wrap to the first."""
    rng = np.random.default_rng(1)
    for n in (0, 1, 700, 20_000):
        keys = rng.choice(np.iinfo(np.int64).max, n, replace=False).astype(np.int64) - (1 << 40)
        size = host_index.index_size(n)
        if n >= 700:  # six keys whose home is the last slot: their probes wrap around
            pool = rng.integers(1 << 62, (1 << 62) + 200_000, 200_000)
            last = [k for k in pool.tolist() if host_index.home(k, size - 1) == size - 1]
            keys[:6] = np.unique(last)[:6]
        index = np.full(size, 7, np.int32)  # stale contents are cleared
        host_index.rebuild_distinct(index, keys, n)
        assert (index >= 0).sum() == n
        np.testing.assert_array_equal(host_index.find(index, keys, keys), np.arange(n))
        absent = rng.integers(-1000, 0, 50)
        assert (host_index.find(index, keys, absent) == -1).all()


def test_the_radix_argsort_is_numpys_stable_argsort():
    """:func:`jctr.ops.host_sort.argsort_u64` (the stores' sorted writes) equals
    ``np.argsort(kind="stable")`` (and its ``stable=False`` sorts) -- ties in their
    positions' order -- on full-range keys, many repeats, keys whose low or high digits are
    all equal (passes skipped: an odd and an even number of moves), and sizes below and above
    the radix threshold; and :func:`ascending_last` keeps each value's last position. The
    packed sort (a key and its position in one value) takes keys of a narrow span whole,
    keys whose top bits tie in short runs told apart by their low bits (repaired by
    insertion: a run's keys in descending order, with repeats), and gives way to the radix
    sort where the repair would move too many (keys below 2**22 with one of 2**63: the span
    is wide and the top bits of all but one tie)."""
    from jctr.ops import host_sort
    from jctr.ops.host_sort import argsort_u64, ascending_last

    rng = np.random.default_rng(5)
    tops = rng.integers(0, 2**40, 6_000).astype(np.uint64) << np.uint64(24)
    lows = rng.permuted(np.tile(np.arange(5, dtype=np.uint64), (6_000, 1)), axis=1)
    runs = np.repeat(tops, 5) | lows.ravel()
    cases = [rng.integers(0, 2**64, 50_000, dtype=np.uint64),
             rng.integers(0, 40, 30_000).astype(np.uint64),
             rng.integers(0, 2**22, 30_000).astype(np.uint64),
             np.append(rng.integers(0, 2**22, 30_000).astype(np.uint64), np.uint64(2**63)),
             rng.integers(0, 2**20, 20_000).astype(np.uint64) << np.uint64(44),
             rng.integers(0, 2**11, 20_000).astype(np.uint64) << np.uint64(11),
             np.full(9_000, 7, np.uint64), np.arange(12_000, dtype=np.uint64)[::-1],
             runs, runs[::-1].copy(), np.concatenate([runs, runs[:7_000]]),
             rng.integers(0, 2**64, 100, dtype=np.uint64), np.zeros(0, np.uint64)]
    packed = []
    for keys in cases:
        want = np.argsort(keys, kind="stable")
        np.testing.assert_array_equal(argsort_u64(keys), want)
        # unstable (numpy's vectorized sort on AVX-512): sorted, ties in any order
        order = argsort_u64(keys, stable=False)
        np.testing.assert_array_equal(np.sort(order), np.arange(keys.size))
        np.testing.assert_array_equal(keys[order], np.sort(keys))
        last = np.ones(keys.size, bool)
        last[:-1] = keys[want][1:] != keys[want][:-1]
        np.testing.assert_array_equal(ascending_last(keys), want[last])
        if keys.size >= 4096:
            taken = host_sort._packed_argsort(keys)
            packed.append(None if taken is None else bool(taken[1]))
    # which sort took each case: the packed one (with or without equal keys) or the radix
    assert packed == [False, True, True, None, True, True, True, False, False, False, True]


def test_sorted_set_operations_equal_numpys():
    """:func:`jctr.ops.host_sort.unique`, ``isin``, ``first_repeat`` and ``union_sorted``
    (numpy 2.3+ hashes a plain ``np.unique``, 30-70x slower for int64 keys) equal
    ``np.unique``, ``np.isin`` and ``np.union1d`` on signed and unsigned keys, repeats,
    full-range keys, empty and one-element arrays."""
    from jctr.ops.host_sort import first_repeat, isin, union_sorted, unique

    rng = np.random.default_rng(9)
    cases = [rng.integers(-50, 50, 3_000), rng.integers(-2**63, 2**63 - 1, 20_000),
             rng.integers(0, 2**64, 5_000, dtype=np.uint64), np.arange(1_000)[::-1],
             np.zeros(0, np.int64), np.array([7]), rng.integers(0, 9, (40, 3))]
    for values in cases:
        np.testing.assert_array_equal(unique(values), np.unique(values))
        for test in (values[::3], rng.permutation(np.ravel(values))[:50], values[:0]):
            got = isin(values, test)
            assert got.shape == values.shape
            np.testing.assert_array_equal(got, np.isin(values, test))
        flat = np.ravel(values)
        repeats = np.unique(flat)[np.unique(flat, return_counts=True)[1] > 1]
        assert first_repeat(values) == (int(repeats[0]) if repeats.size else None)
    # union_sorted: a growing set joined with new ones, some already in it
    for a, b in [(np.unique(rng.integers(0, 1_000, 400)), np.unique(rng.integers(0, 1_200, 300))),
                 (np.arange(5), np.zeros(0, np.int64)), (np.zeros(0, np.int64), np.arange(3)),
                 (np.array([10, 20]), np.array([0, 15, 20, 30]))]:
        got = union_sorted(a, b)
        np.testing.assert_array_equal(got, np.union1d(a, b))
        assert got is not a and got is not b
    # a set larger than the caches, tested a chunk at a time (a served table's keys against
    # a new base's): the values are sorted before their searches, the set is not sorted
    # again (test_sorted), and the answers keep the values' order and shape
    big = np.unique(rng.integers(-2**63, 2**63 - 1, (1 << 20) + 5))
    for values in (np.concatenate([rng.choice(big, 3_000), rng.integers(-2**63, 2**63 - 1,
                                                                         3_000)]),
                   rng.choice(big, (70, 100)), big[-5_000:][::-1]):
        want = np.isin(values, big)
        for got in (isin(values, big), isin(values, big, test_sorted=True)):
            assert got.shape == values.shape
            np.testing.assert_array_equal(got, want)


def test_rows_gathered_into_their_columns_equal_numpys_take():
    from jctr.ops.host_sort import gather_rows

    rng = np.random.default_rng(6)
    a = rng.random((5_000, 16)).astype(np.float32)
    b = rng.random((5_000, 3)).astype(np.float32)
    order = rng.integers(0, 5_000, 7_000)  # repeats too
    out = np.full((7_000, 20), -1.0, np.float32)
    gather_rows(out, 0, a, order)
    gather_rows(out, 16, b, order)
    np.testing.assert_array_equal(out[:, :16], np.take(a, order, axis=0))
    np.testing.assert_array_equal(out[:, 16:19], np.take(b, order, axis=0))
    assert (out[:, 19] == -1).all()
    with pytest.raises(ValueError, match="do not fit"):
        gather_rows(out, 18, b, order)
    with pytest.raises(ValueError, match="outside the block"):
        gather_rows(out, 16, b, np.full(7_000, 5_000))


def test_take_rows_equals_numpys_take_for_every_kind_of_block():
    """``take_rows`` (the streaming runner's gather of the last pass's written rows): the
    compiled gather for float32 row blocks, ``np.take`` for keys and other dtypes; both as
    numpy's take."""
    from jctr.ops.host_sort import take_rows

    rng = np.random.default_rng(7)
    order = rng.integers(0, 3_000, 4_000)
    for src in (rng.random((3_000, 57)).astype(np.float32), rng.integers(0, 9, 3_000),
                rng.random((3_000, 4)), rng.random((3_000, 2, 3)).astype(np.float32)):
        out = np.empty((order.size, *src.shape[1:]), src.dtype)
        take_rows(src, order, out)
        np.testing.assert_array_equal(out, np.take(src, order, axis=0))


def test_last_occurrences_equal_a_dictionary():
    """The stores' dedupe of a batch (the last row of a key wins) by the radix sort of the
    keys' bits: negative keys and the int64 extremes group like any other."""
    from jctr.stores.base import last_occurrences

    rng = np.random.default_rng(3)
    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    for n in (0, 1, 2, 7, 5000, 60000):  # below and above the radix sort's threshold
        for keys in (rng.integers(-4, 4, n), rng.integers(lo, hi, n),
                     rng.choice(np.array([lo, -1, 0, 1, hi]), n)):
            want = sorted({k: i for i, k in enumerate(keys.tolist())}.values())
            np.testing.assert_array_equal(last_occurrences(keys), want)


def test_sorted_runs_hold_the_set_a_python_set_holds():
    """The Kafka publisher's record of sent keys: joined with a step's keys at every publish,
    it was one sorted array copied whole each time (181 ms a publish at 20M keys). As runs
    under half the size of the one before, over random joins, removals and replacements it
    holds what a Python set holds, its size bound at most twice the size, with O(log n) runs."""
    from jctr.ops.host_sort import SortedRuns, unique

    rng = np.random.default_rng(7)
    runs, model = SortedRuns(), set()
    for step in range(400):
        roll = rng.random()
        if roll < 0.8:
            keys = unique(rng.integers(0, 50_000, rng.integers(0, 3_000)))
            runs.add(keys)
            model.update(keys.tolist())
        elif roll < 0.95:
            gone = rng.integers(0, 50_000, 500)
            runs.remove(gone)
            model.difference_update(gone.tolist())
        else:
            keep = unique(rng.choice(np.array(sorted(model) or [0], np.int64), 1_000))
            runs.replace(keep)
            model = set(keep.tolist())
        assert len(model) <= runs.size_bound() <= 2 * len(model) + 3_000
        assert len(runs._runs) <= 2 + int(np.log2(max(runs.size_bound(), 1)))
        probe = rng.integers(0, 50_000, 200)
        np.testing.assert_array_equal(runs.contains(probe),
                                      [k in model for k in probe.tolist()])
        if step % 50 == 0:
            np.testing.assert_array_equal(runs.values(), np.array(sorted(model), np.int64))
            assert runs.size_bound() == len(model)
