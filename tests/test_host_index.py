"""The compiled host index (jctr/ops/host_index.py) that the CPU memory database and the
streaming statistics keep their keys with, against a dictionary."""

import numpy as np

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
