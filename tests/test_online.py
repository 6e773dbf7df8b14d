"""Streaming training parts: the time-sliced data schedule (passes of folders, done-files,
per-process shares), the per-key show/click statistics (score, shrink, base and delta
filters), each against a hand-computed case, and the streaming runner."""

import dataclasses
import os
import threading
import time

import numpy as np
import pytest

from jctr.data.records import DataError
from jctr.online.feature_stats import FeatureStats, ScoreRule, ShrinkRule
from jctr.online.schedule import data_files, days, pass_folders, shard, wait_ready


def test_passes_cut_the_day_into_consecutive_folders():
    passes = pass_folders(5, 2)
    assert len(passes) == 144
    assert passes[0] == ["0000", "0005"] and passes[1] == ["0010", "0015"]
    assert passes[-1] == ["2350", "2355"]
    assert pass_folders(60, 1)[13] == ["1300"]
    assert len(pass_folders(5, 7)) == 288 // 7  # a last incomplete group is left out
    with pytest.raises(DataError, match="split_interval: 7 minutes do not divide a day"):
        pass_folders(7, 1)
    with pytest.raises(DataError, match="split_per_pass: 300 slices of 5 minutes"):
        pass_folders(5, 300)
    with pytest.raises(DataError, match="split_per_pass: expected a positive integer"):
        pass_folders(5, 0)
    assert days("20190730", "20190802") == ["20190730", "20190731", "20190801", "20190802"]
    with pytest.raises(DataError, match="end_day 20190701 is before start_day 20190720"):
        days("20190720", "20190701")
    with pytest.raises(DataError, match="start_day: expected a date as YYYYMMDD"):
        days("2019-07-20", "20190721")


def test_waiting_for_done_files_and_sharing_files(tmp_path):
    folders = [str(tmp_path / "20190720" / f) for f in ("0000", "0005")]
    for f in folders:
        os.makedirs(f)
        for name in ("part-2", "part-1", ".hidden", "_SUCCESS_marker"):
            open(os.path.join(f, name), "w").close()
        os.makedirs(os.path.join(f, "subdir"))
    open(os.path.join(folders[0], "to.hadoop.done"), "w").close()
    told = []

    def land():  # the second folder's data is complete a little later
        time.sleep(0.3)
        open(os.path.join(folders[1], "to.hadoop.done"), "w").close()

    worker = threading.Thread(target=land)
    start = time.monotonic()
    worker.start()
    wait_ready(folders, "to.hadoop.done", sleep_s=0.05, report=told.append)
    worker.join()
    assert time.monotonic() - start >= 0.3
    assert told == [f"[jctr] waiting for {folders[1]}/to.hadoop.done (checking every 0.05 s)"]
    files = data_files(folders, "to.hadoop.done")
    assert files == [os.path.join(f, p) for f in folders for p in ("part-1", "part-2")]
    shares = [shard(files, i, 3) for i in range(3)]
    assert sorted(sum(shares, [])) == sorted(files) and [len(s) for s in shares] == [2, 1, 1]
    wait_ready(folders, None, sleep_s=100)  # no done-file configured: no waiting
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    with pytest.raises(InterruptedError, match="stopped while waiting for .*never.done"):
        wait_ready(folders, "never.done", sleep_s=0.05, stop=stop)
    with pytest.raises(DataError, match="0010: no such data folder"):
        data_files([str(tmp_path / "20190720" / "0010")])


def test_score_and_shrink_by_hand():
    """Paddle's ``CtrCommonAccessor::ShowClickScore`` and ``::Shrink``
    (paddle/fluid/distributed/ps/table/ctr_accessor.cc): decay first, then delete by score or
    unseen days; the shrink does not age the keys (``UpdateStatAfterSave`` does, param 3)."""
    stats = FeatureStats()
    # four occurrences: key 1 twice (one click), keys 2 and 3 once each (no click)
    stats.observe(np.array([1, 2, 1, 3]), show=1.0, click=np.array([1, 0, 0, 0]))
    found, score = stats.lookup(np.array([1, 2, 3, 9]))
    # score = click_coeff * click + nonclk_coeff * (show - click): 1 * 1 + 0.1 * (2 - 1)
    assert found.tolist() == [True, True, True, False]
    np.testing.assert_allclose(score, [1.1, 0.1, 0.1, 0.0])
    # decay 0.5: scores 0.55, 0.05, 0.05; delete below 0.06 -> keys 2 and 3 go
    deleted = stats.shrink(ShrinkRule(show_click_decay_rate=0.5, delete_threshold=0.06))
    assert deleted.tolist() == [2, 3] and stats.keys.tolist() == [1]
    np.testing.assert_allclose((stats.show, stats.click), ([1.0], [0.5]))
    assert stats.unseen_days.tolist() == [0]
    stats.age()  # the batch model is saved
    assert stats.unseen_days.tolist() == [1]
    # other coefficients
    other = FeatureStats(ScoreRule(nonclk_coeff=0.5, click_coeff=2.0))
    other.observe(np.array([7, 7, 7]), show=1.0, click=np.array([1, 0, 0]))
    np.testing.assert_allclose(other.scores(), [2.0 * 1 + 0.5 * 2])


def test_unseen_keys_are_deleted_after_the_configured_days():
    """``delete_after_unseen_days: 2``: a key last seen on day 0 survives day 2's shrink and
    goes at day 3's. Paddle tests ``unseen_days > delete_after_unseen_days`` in
    ``CtrCommonAccessor::Shrink`` and ages keys afterwards, when the batch model is saved
    (``UpdateStatAfterSave``, param 3: ``UnseenDays(value)++``)."""
    stats = FeatureStats()
    rule = ShrinkRule(delete_after_unseen_days=2)
    stats.observe(np.array([1, 4]), show=1.0, click=0.0)  # day 0: keys 1 and 4
    for day in (0, 1, 2):
        assert stats.shrink(rule).tolist() == [], day  # key 1 unseen 0, 1, 2 days: kept
        stats.age()
        stats.observe(np.array([4]), show=1.0, click=0.0)  # days 1, 2, 3: key 4 only
    assert stats.unseen_days.tolist() == [3, 0]
    assert stats.shrink(rule).tolist() == [1]  # day 3: unseen 3 days > 2
    assert stats.keys.tolist() == [4]


def test_base_and_delta_filters_by_hand():
    """Paddle's ``CtrCommonAccessor::Save`` (ctr_accessor.cc): base (param 2) keeps
    ``score >= base_threshold && unseen_days <= delta_keep_days`` (its delta_threshold is 0);
    delta (param 1) keeps ``score >= base_threshold && delta_score >= delta_threshold &&
    unseen_days <= delta_keep_days``; ``delta_score`` grows by the score of every push
    (``::Update``) and is 0 again for every key a base or delta saved (``::Save`` param 2,
    ``::UpdateStatAfterSave`` param 1). jctr's delta also needs a push since the key was last
    saved (unchanged rows are not sent again)."""
    stats = FeatureStats()
    stats.observe(np.array([1, 5, 5, 8]), show=1.0, click=np.array([1, 1, 0, 0]))
    # scores: key 1 -> 1.0, key 5 -> 1 + 0.1 = 1.1, key 8 -> 0.1; delta scores the same
    # (columns in storage order: the order keys came, here 1, 5, 8)
    np.testing.assert_allclose(stats.delta_score, [1.0, 1.1, 0.1])
    assert stats.delta_keys(base_threshold=0.5, delta_threshold=1.05,
                            delta_keep_days=16).tolist() == [5]  # 1 below 1.05, 8 below 0.5
    np.testing.assert_allclose(stats.delta_score, [1.0, 0.0, 0.1])  # 5 was saved
    stats.observe(np.array([1, 5, 8]), show=1.0, click=0.0)  # each +0.1
    np.testing.assert_allclose(stats.delta_score, [1.1, 0.1, 0.2])
    # base_threshold is tested by deltas too: key 8 (score 0.2) stays out of both
    assert stats.delta_keys(0.5, 0.0, 16).tolist() == [1, 5]
    assert stats.delta_keys(0.5, 0.0, 16).tolist() == []  # nothing pushed since
    assert stats.base_keys(base_threshold=0.5, delta_keep_days=16).tolist() == [1, 5]
    # unseen days: a base leaves out keys unseen for more than delta_keep_days
    stats.observe(np.array([8]), show=1.0, click=np.array([1.0]))  # key 8: score 1.2
    for _ in range(2):
        stats.shrink(ShrinkRule())
        stats.age()
    stats.observe(np.array([5]), show=1.0, click=0.0)
    assert stats.unseen_days.tolist() == [2, 0, 2]
    assert stats.base_keys(0.5, delta_keep_days=1).tolist() == [5]
    assert stats.delta_keys(0.5, 0.0, delta_keep_days=1).tolist() == []  # 5 saved by the base
    assert stats.delta_keys(0.5, 0.0, delta_keep_days=2).tolist() == [8]  # 1: not pushed since
    # a base resets only the keys it saved: key 8 (below the threshold) keeps its delta score
    stats.observe(np.array([8, 9]), show=1.0, click=0.0)
    assert stats.base_keys(1.5, 16).tolist() == []  # (flushes)
    np.testing.assert_allclose(stats.delta_score[stats.keys == 8], [0.1])


def test_statistics_saved_before_delta_scores_load():
    """A checkpoint's feature_stats.npz from before delta scores: keys pushed since their last
    delta get their lifetime score as the delta score."""
    stats = FeatureStats()
    stats.load_state_dict({"keys": np.array([1, 2]), "show": np.array([2.0, 1.0]),
                           "click": np.array([1.0, 0.0]), "unseen_days": np.array([0, 3]),
                           "since_delta": np.array([True, False])})
    np.testing.assert_allclose(stats.delta_score, [1.1, 0.0])


def test_statistics_changes_over_the_days_base_give_the_statistics():
    """A pass's checkpoint saves the statistics' changes since the day's batch model (its
    whole statistics): over random days of pushes (old and new keys), delta saves, shrinks
    and ageing, the day's base with any pass's changes applied is the statistics, bit for
    bit, storage order included; the changes are the day's keys, not every key; changes that
    do not fit their base are refused."""
    rng = np.random.default_rng(3)
    stats = FeatureStats()
    base, sizes = None, []
    for day in range(6):
        for _ in range(3):  # passes
            keys = np.concatenate([rng.integers(0, 40_000, 3_000),  # old and new keys
                                   rng.integers(20_000 * day, 20_000 * day + 15_000, 3_000)])
            stats.observe(keys, show=1.0, click=rng.random(keys.size) < 0.2)
            if rng.random() < 0.6:
                stats.delta_keys(0.0, float(rng.random()), 3)
            if base is not None:
                changes = stats.changes()
                sizes.append((changes["positions"].size, len(stats)))
                copy = FeatureStats()
                copy.apply_changes(base, changes)
                for name, value in stats.state_dict().items():
                    np.testing.assert_array_equal(getattr(copy, name), value, err_msg=name)
                # and the changes of the copy, made on: those of the statistics
                copy.observe(keys[:50], show=1.0, click=0.0)
                stats.observe(keys[:50], show=1.0, click=0.0)
                again = FeatureStats()
                again.apply_changes(base, copy.changes())
                for name, value in stats.state_dict().items():
                    np.testing.assert_array_equal(getattr(again, name), value, err_msg=name)
        # the day's end: the shrink, the base model, the keys age, the whole saved
        stats.shrink(ShrinkRule(show_click_decay_rate=0.9, delete_threshold=0.15,
                                delete_after_unseen_days=4))
        stats.base_keys(0.0, 3)
        stats.age()
        base = {k: v.copy() for k, v in stats.state_dict().items()}
        stats.mark_base()
    assert all(changed < total for changed, total in sizes)
    assert sizes[-1][0] < 0.5 * sizes[-1][1], sizes[-1]  # a day's keys of many days'
    bad = stats.changes()
    with pytest.raises(ValueError, match=r"changes of \d+ row\(s\) to \d+ rows do not fit a "
                                         r"base of \d+ rows"):
        FeatureStats().apply_changes({k: v[:-1] for k, v in base.items()},
                                     dict(bad, positions=bad["positions"][:-1]))


def test_statistics_made_for_the_tables_keys_grow_nothing_while_a_pass_trains(monkeypatch):
    """FeatureStats(expected_keys=...) (the runner passes the table's capacity) has room for
    that many keys from the start: adding them replaces no column and rebuilds no index (the
    reader thread's work while a pass trains), gives what growing statistics give, and grows
    past the room as before; the room is bounded (PRESIZE_MAX)."""
    rng = np.random.default_rng(3)
    keys = rng.choice(10**12, 30_000, replace=False).astype(np.int64)
    clicks = rng.random(keys.size) < 0.2
    sized, grown = FeatureStats(expected_keys=30_000), FeatureStats()
    columns, index = sized._cols["keys"], sized._index
    for part in np.array_split(np.arange(keys.size), 9):
        sized.observe(keys[part], show=1.0, click=clicks[part])
        grown.observe(keys[part], show=1.0, click=clicks[part])
    assert sized._cols["keys"] is columns and sized._index is index
    for name, value in grown.state_dict().items():
        np.testing.assert_array_equal(sized.state_dict()[name], value, err_msg=name)
    sized.observe(keys + 1, show=1.0, click=0.0)  # past the room: the columns double
    assert len(sized) == 2 * keys.size and sized.lookup(keys + 1)[0].all()
    monkeypatch.setattr(FeatureStats, "PRESIZE_MAX", 4096)
    assert FeatureStats(expected_keys=10**12)._cols["keys"].size == 4096


def test_statistics_in_mapped_files_equal_those_in_memory(tmp_path, monkeypatch):
    """A table larger than memory has statistics to match (~45 bytes a key; Paddle keeps
    show, click and unseen days inside the rows of its SSD table,
    paddle/fluid/distributed/ps/table/ctr_accessor.h ``CtrCommonFeatureValue``): columns past
    ``in_memory_bytes`` move into unnamed files of ``files``, mapped. Over random days of
    pushes (old and new keys), delta and base saves, shrinks, ageing, changes, saves and
    loads, statistics in files from the start, statistics that move there as they grow, and
    statistics in memory give the same columns, keys and decisions bit for bit, a day's
    decisions taken a few rows at a time (``CHUNK``); the files are mapped and have no name
    (nothing is left in the folder), and a growth in files copies no row."""
    from tests.conftest import mappings_under

    monkeypatch.setattr(FeatureStats, "CHUNK", 1000)
    said = []
    memory = FeatureStats()
    files = FeatureStats(files=str(tmp_path), in_memory_bytes=0)
    moving = FeatureStats(files=str(tmp_path), in_memory_bytes=20_000 * FeatureStats.ROW_BYTES,
                          report=said.append)
    every = (memory, files, moving)
    assert files.mapped and not moving.mapped
    rng = np.random.default_rng(5)

    def same(results):
        for r in results[1:]:
            if isinstance(r, dict):
                assert r.keys() == results[0].keys()
                for k in r:
                    np.testing.assert_array_equal(r[k], results[0][k], err_msg=k)
            elif isinstance(r, tuple):
                for a, b in zip(r, results[0]):
                    np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_array_equal(r, results[0])
        return results[0]

    base = None
    for day in range(5):
        for _ in range(3):  # passes
            keys = np.concatenate([rng.integers(0, 30_000, 4_000),
                                   rng.integers(15_000 * day, 15_000 * day + 12_000, 4_000)])
            clicks = rng.random(keys.size) < 0.2
            for st in every:
                st.observe(keys, show=1.0, click=clicks)
            same([st.lookup(keys[::7]) for st in every])
            if rng.random() < 0.6:
                threshold = float(rng.random())
                same([st.delta_keys(0.0, threshold, 3) for st in every])
            if base is not None:
                changes = same([st.changes() for st in every])
                copies = [FeatureStats(), FeatureStats(files=str(tmp_path), in_memory_bytes=0)]
                for c in copies:
                    c.apply_changes(base, changes)
                same([c.state_dict() for c in copies] + [memory.state_dict()])
                copies[1].close()
        rule = ShrinkRule(show_click_decay_rate=0.9, delete_threshold=0.15,
                          delete_after_unseen_days=3)
        same([st.shrink(rule) for st in every])
        same([st.base_keys(0.0, 2) for st in every])
        for st in every:
            st.age()
            st.mark_base()
        base = {k: v.copy() for k, v in same([st.state_dict() for st in every]).items()}
    assert moving.mapped and len(said) == 1 and "in mapped files" in said[0], said
    # loaded from a checkpoint's arrays: in files again, the same
    again = FeatureStats(files=str(tmp_path), in_memory_bytes=0)
    again.load_state_dict(base)
    assert again.mapped
    same([again.state_dict(), memory.state_dict()])
    # mapped from unnamed files in the folder (O_TMPFILE), none left there by name
    maps = mappings_under(tmp_path)
    assert maps and all("(deleted)" in line for line in maps), maps[:3]
    assert not os.listdir(tmp_path)
    # a growth in files: the same file, longer; no row copied (the old view still reads it)
    keys_before = files._cols["keys"]
    files.observe(np.arange(10**6, 10**6 + 3 * keys_before.size), show=1.0, click=0.0)
    assert files._cols["keys"].size > keys_before.size
    np.testing.assert_array_equal(files._cols["keys"][:keys_before.size], keys_before)
    for st in (files, moving, again):
        st.close()


def test_statistics_past_int32_row_numbers_index_them_in_int64():
    """An index of int32 row numbers would wrap past 2**31 - 1 keys (statistics in files can
    hold that many): past ``INT32_ROWS`` the index holds int64 row numbers, the same
    statistics (the limit lowered to 3,000 rows here)."""
    plain, wide = FeatureStats(), FeatureStats()
    wide.INT32_ROWS = 3_000
    rng = np.random.default_rng(2)
    for _ in range(4):
        keys = rng.integers(0, 20_000, 5_000)
        for st in (plain, wide):
            st.observe(keys, show=1.0, click=keys % 3 == 0)
    assert plain._index.dtype == np.int32 and wide._index.dtype == np.int64
    for name, value in plain.state_dict().items():
        np.testing.assert_array_equal(wide.state_dict()[name], value, err_msg=name)
    probe = rng.integers(0, 25_000, 2_000)
    np.testing.assert_array_equal(wide.rows_of(probe), plain.rows_of(probe))
    gone = [st.shrink(ShrinkRule(delete_threshold=0.15)) for st in (plain, wide)]
    np.testing.assert_array_equal(*gone)
    np.testing.assert_array_equal(wide.rows_of(probe), plain.rows_of(probe))


def test_statistics_in_files_refuse_to_grow_onto_a_full_disk(tmp_path, monkeypatch):
    """Statistics in mapped files take their blocks as the columns grow: a full disk is an
    error naming the folder (a write into a mapped page the disk has no room for would kill
    the process with SIGBUS, deep in a compiled loop), and the statistics stay as they
    were; with room again they grow on."""
    import errno

    stats = FeatureStats(files=str(tmp_path), in_memory_bytes=0)
    stats.observe(np.arange(500), show=1.0, click=0.0)
    before = {k: v.copy() for k, v in stats.state_dict().items()}

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=rf"{tmp_path}: no room for .* bytes of .*No space left"):
        stats.observe(np.arange(10_000, 20_000), show=1.0, click=0.0)
    for name, value in before.items():
        np.testing.assert_array_equal(stats.state_dict()[name], value, err_msg=name)
    # statistics in memory that would move into files: they stay in memory, whole
    moving = FeatureStats(files=str(tmp_path), in_memory_bytes=2_000 * FeatureStats.ROW_BYTES)
    moving.observe(np.arange(1_000), show=1.0, click=0.0)
    with pytest.raises(OSError, match="no room for"):
        moving.observe(np.arange(10_000, 20_000), show=1.0, click=0.0)
    assert not moving.mapped and len(moving) == 1_000
    monkeypatch.undo()
    for st in (stats, moving):
        st.observe(np.arange(10_000, 20_000), show=1.0, click=0.0)
        assert st.mapped and st.lookup(np.array([10_001, 7]))[0].all()
        st.close()
    assert len(stats) == 10_500 and len(moving) == 11_000


def test_statistics_round_trip_and_bulk_merge():
    rng = np.random.default_rng(0)
    stats = FeatureStats()
    keys = rng.zipf(1.2, 200_000).astype(np.int64)
    clicks = rng.random(keys.size) < 0.1
    for part in np.array_split(np.arange(keys.size), 7):
        stats.observe(keys[part], show=1.0, click=clicks[part])
    uniq, counts = np.unique(keys, return_counts=True)
    assert len(stats) == uniq.size
    state = _by_key(stats)
    np.testing.assert_array_equal(state["keys"], uniq)
    np.testing.assert_array_equal(state["show"], counts)
    np.testing.assert_array_equal(state["click"], np.bincount(np.searchsorted(uniq, keys),
                                                              clicks, uniq.size))
    # storage order: the order keys first came
    _, first = np.unique(keys, return_index=True)
    np.testing.assert_array_equal(stats.keys, keys[np.sort(first)])
    found, score = stats.lookup(np.concatenate([uniq[::1000], [-5, 0]]))
    assert found.tolist() == [True] * uniq[::1000].size + [False, False]
    np.testing.assert_allclose(score[:-2], 0.9 * state["click"][::1000]
                               + 0.1 * state["show"][::1000], rtol=1e-12)
    # the multi-process mode: pending until taken, then the same statistics
    gathered = FeatureStats(gather=True)
    for part in np.array_split(np.arange(keys.size), 3):
        gathered.observe(keys[part], show=1.0, click=clicks[part])
    taken = gathered.take_pending()
    assert len(gathered) == 0 and taken[0].tolist() == uniq.tolist()
    gathered.merge(*taken)  # sorted keys: storage order is key order here
    for name, value in gathered.state_dict().items():
        np.testing.assert_allclose(value, state[name], rtol=1e-12)
    copy = FeatureStats()
    copy.load_state_dict(stats.state_dict())
    for name, value in stats.state_dict().items():
        np.testing.assert_array_equal(getattr(copy, name), value)
    copy.load_state_dict(state)  # key order (as jctr wrote them before the hashed index)
    assert copy.lookup(uniq[::1000])[0].all()
    # a shrink keeps the storage order and the index finds every kept key
    deleted = copy.shrink(ShrinkRule(delete_threshold=1.5))
    kept = state["keys"][0.9 * state["click"] + 0.1 * state["show"] >= 1.5]
    assert deleted.size + kept.size == uniq.size and len(copy) == kept.size
    assert copy.lookup(kept)[0].all() and not copy.lookup(deleted)[0].any()
    copy.observe(deleted[:10], show=1.0, click=0.0)  # deleted keys come back as new rows
    assert copy.keys[-10:].tolist() == deleted[:10].tolist()
    twice = state["keys"].copy()
    twice[-1] = twice[0]
    with pytest.raises(ValueError, match=f"key {twice[0]} is there twice"):
        copy.load_state_dict(dict(state, keys=twice))


def _by_key(stats: FeatureStats) -> dict[str, np.ndarray]:
    """The statistics' columns in key order (they are kept in the order keys came)."""
    state = stats.state_dict()
    order = np.argsort(state["keys"])
    return {name: value[order] for name, value in state.items()}


# -- the runner ------------------------------------------------------------------------------

def _stream(tmp, days=("20190720", "20190721")):
    """A model config and a two-day folder tree (two passes a day, one Norm file each),
    from the small synthetic DLRM's generated files."""
    import json
    import shutil

    from jctr.config import parse_config
    from jctr.data.tools.synthetic import generate_for_config
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp, "dlrm", display=1000, eval_batches=2, batchsize=256,
                      batchsize_eval=256, eval_interval=10_000)
    cfg["layers"][0]["synthetic"].update(num_samples=4 * 512, eval_num_samples=512,
                                         num_files=4)
    generate_for_config(parse_config(cfg))
    train = sorted((tmp / "dlrm" / "train").glob("*.data"))
    assert len(train) == 4
    k = 0
    for day in days:
        for hhmm in ("0000", "1200"):
            folder = tmp / "stream" / day / hhmm
            folder.mkdir(parents=True)
            shutil.copy(train[k % 4], folder / "part-0.data")
            k += 1
    model = tmp / "model.json"
    model.write_text(json.dumps(cfg))
    return model


def _online(tmp, model, save, end_day="20190721", start_day="20190720", **extra):
    from jctr.config.online import parse_online_config

    doc = {"model": str(model), "train_data_dir": str(tmp / "stream"), "split_interval": 720,
           "split_per_pass": 1, "start_day": start_day, "end_day": end_day,
           "save_model_path": str(save), "data_donefile": "DONE", "data_sleep_second": 0.05,
           **extra}
    return parse_online_config(doc, str(tmp / "online.yaml"))


def test_streaming_runs_pass_by_pass_waits_for_data_and_resumes_exactly(tmp_path):
    import json

    import jax

    from jctr.online.runner import OnlineRun
    from tests.test_epochs import leaves_equal

    model = _stream(tmp_path)
    folders = sorted(p for p in (tmp_path / "stream").glob("*/*"))
    for folder in folders[:-1]:
        (folder / "DONE").touch()
    lines = []
    timers = []

    def log(line):  # the last slice lands while the run waits for it
        lines.append(line)
        if line.startswith("[jctr] waiting for"):
            timers.append(threading.Timer(0.3, (folders[-1] / "DONE").touch))
            timers[-1].start()

    whole = OnlineRun(_online(tmp_path, model, tmp_path / "whole"), log=log)
    assert whole.run() == 4
    assert len(timers) == 1
    text = "\n".join(lines)
    assert f"[jctr] waiting for {folders[-1]}/DONE" in text
    passes = [x for x in lines if x.startswith("[jctr] day ")]
    assert [x.split(":")[0] for x in passes] == [
        "[jctr] day 20190720 pass 1/2", "[jctr] day 20190720 pass 2/2",
        "[jctr] day 20190721 pass 1/2", "[jctr] day 20190721 pass 2/2"]
    assert all("2 iterations" in x and "validation AUC" in x and ", pass AUC 0." in x
               for x in passes), passes
    records = [json.loads(x) for x in (tmp_path / "whole" / "passes.jsonl").read_text()
               .splitlines()]
    assert [(r["day"], r["pass"], r["iterations"]) for r in records] == [
        ("20190720", 1, 2), ("20190720", 2, 2), ("20190721", 1, 2), ("20190721", 2, 2)]
    assert all(0.0 < r["pass_auc"] < 1.0 and "AUC" in r["validation"] for r in records)
    # passes after the first were read while the one before trained (the last one's data
    # landed during that wait)
    assert [r["read_ahead_s"] is not None for r in records] == [False, True, True, True]
    assert all("read ahead in" in x for x in passes[1:])
    assert int(whole.trainer.state.step) == 8
    progress = json.loads((tmp_path / "whole" / "progress.json").read_text())
    assert (progress["day"], progress["pass"], progress["step"]) == ("20190721", 2, 8)
    assert (tmp_path / "whole" / "20190720" / "1" / "2").is_dir()
    assert (tmp_path / "whole" / "20190720" / "1" / "feature_stats.npz").is_file()
    assert len(whole.stats[0]) > 0 and whole.stats[0].show.sum() > 0
    # stopped after the first day, started again up to the second: the same model
    half = tmp_path / "half"
    assert OnlineRun(_online(tmp_path, model, half, end_day="20190720"),
                     log=lambda s: None).run() == 2
    lines = []
    again = OnlineRun(_online(tmp_path, model, half), log=lines.append)
    assert again.run() == 2
    assert any("resuming after day 20190720 pass 2 (iter 4" in x for x in lines)
    assert int(again.trainer.state.step) == 8
    for name, value in whole.stats[0].state_dict().items():  # statistics resumed too
        np.testing.assert_array_equal(again.stats[0].state_dict()[name], value)
    a = jax.tree.map(np.asarray, whole.trainer.state.params)
    b = jax.tree.map(np.asarray, again.trainer.state.params)
    assert leaves_equal(a, b)
    # nothing left to do
    lines = []
    assert OnlineRun(_online(tmp_path, model, half), log=lines.append).run() == 0
    assert any("nothing to train" in x for x in lines)


def test_streaming_config_errors_name_the_file_and_field(tmp_path):
    from jctr.config import ConfigError
    from jctr.config.online import load_online_config
    from jctr.online.runner import OnlineRun

    path = tmp_path / "online.yaml"
    path.write_text("model: m.json\ntrain_data_dir: d\nsplit_interval: 7\nsplit_per_pass: 1\n"
                    "start_day: '20190720'\nend_day: '20190721'\nsave_model_path: out\n")
    cfg = load_online_config(path)
    assert cfg.model == str(tmp_path / "m.json") and cfg.data_sleep_second == 30.0
    with pytest.raises(ConfigError, match="schedule: split_interval: 7 minutes do not divide"):
        OnlineRun(cfg)
    base = path.read_text().replace("split_interval: 7", "split_interval: 5")
    path.write_text(base + "sparse_store: {type: row_file, path: rows}\n")
    cfg = load_online_config(path)
    assert (cfg.sparse_store, cfg.sparse_store_type) == (str(tmp_path / "rows"), "row_file")
    path.write_text(base + "sparse_store: {type: lmdb, path: rows}\n")
    with pytest.raises(ConfigError, match=r'online.yaml: sparse_store.type: expected one of '
                                          r'"rocks_db", "row_file"'):
        load_online_config(path)
    path.write_text(base + "prefetch_passes: 2\n")
    with pytest.raises(ConfigError, match=r"online.yaml: prefetch_passes: unknown key"):
        load_online_config(path)
    path.write_text("model: m.json\nstart_day: 2019-07-20\n")
    with pytest.raises(ConfigError, match="online.yaml: "):
        load_online_config(path)


def test_online_command_reports_errors_in_one_line(tmp_path, capsys):
    from jctr.online.cli import main

    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "missing.yaml: <file>: cannot read streaming config" in err and "Traceback" not in err


def test_weeks_of_new_keys_fit_a_small_table_through_the_daily_shrink(tmp_path):
    """Six days, each with keys never seen before (the day's files have their keys shifted),
    through a table holding a little over three days of keys: with the shrink (keys unseen for
    more than a day deleted, rows freed) every day fits and the table never fills; without it
    the fourth day does not fit. Paddle's order (``CtrCommonAccessor::Shrink`` tests unseen
    days before the batch model's save ages them): a key last seen on day d is still there on
    day d + 2 and goes at that day's end."""
    import json

    from jctr.data.norm import read_norm_file, write_norm_file
    from jctr.data.records import RecordBlock
    from jctr.embedding.hash_table import TableFullError
    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path, days=())
    train = sorted((tmp_path / "dlrm" / "train").glob("*.data"))
    day_names = [f"201907{20 + d}" for d in range(6)]
    per_day = []
    for d, day in enumerate(day_names):
        folder = tmp_path / "stream" / day / "0000"
        folder.mkdir(parents=True)
        blocks = [read_norm_file(str(f), label_dim=1, dense_dim=13, slot_num=8,
                                 key_type="I64", check="Sum") for f in train]
        keys = np.concatenate([b.keys for b in blocks]) + d * 10**9  # the day's new keys
        per_day.append(np.unique(keys).size)
        block = RecordBlock(np.concatenate([b.label for b in blocks]),
                            np.concatenate([b.dense for b in blocks]),
                            np.concatenate([b.nnz for b in blocks]), keys)
        write_norm_file(str(folder / "part-0.data"), block, key_type="I64", check="Sum")
        (folder / "DONE").touch()
    capacity = (3 * max(per_day) + 4 * min(per_day)) // 2
    assert 3 * max(per_day) < capacity < 4 * min(per_day)  # the premise
    cfg = json.loads(model.read_text())
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = capacity
    model.write_text(json.dumps(cfg))

    def online(save, unseen_days):
        doc = {"model": str(model), "train_data_dir": str(tmp_path / "stream"),
               "split_interval": 1440, "split_per_pass": 1, "start_day": day_names[0],
               "end_day": day_names[-1], "save_model_path": str(tmp_path / save),
               "data_donefile": "DONE", "data_sleep_second": 0.05,
               "table_parameters": {"delete_after_unseen_days": unseen_days}}
        from jctr.config.online import parse_online_config

        return parse_online_config(doc, str(tmp_path / "online.yaml"))

    lines = []
    run = OnlineRun(online("shrunk", 1), log=lines.append)
    assert run.run() == 6
    shrinks = [x for x in lines if x.startswith("[jctr] shrink at the end of day")]
    assert len(shrinks) == 6
    rows = [int(x.split(", ")[-1].split(" rows")[0].replace(",", "")) for x in shrinks
            if "rows in use" in x]
    # from day 2 on each shrink deletes the keys of two days before: two days' keys stay
    assert rows == [2 * per_day[0]] * 4
    assert " 0 key(s) deleted" in shrinks[0] and " 0 key(s) deleted" in shrinks[1]
    with pytest.raises(TableFullError):
        OnlineRun(online("kept", 30), log=lambda s: None).run()


@pytest.mark.parametrize("when", ["waiting", "training", "training, sparse_store",
                                  "training, sparse_store row_file"])
def test_a_killed_streaming_run_resumes_to_the_same_model(tmp_path, when):
    """``python -m jctr.online`` SIGKILLed while it waits for the second pass's data, or in
    the middle of the second pass's training, and started again (once the data is there):
    its last checkpoint equals an uninterrupted run's. The command runs with the malloc
    heap ``python -m jctr.train`` sets (its header says so). With ``sparse_store`` the first
    pass's write-back is written while the second trains and its checkpoint recorded once it
    is done (killed after that: the run resumes after the first pass), and the database ends
    with the uninterrupted run's rows (RocksDB, and the mapped row files of ``row_file``)."""
    import json
    import signal
    import subprocess
    import sys

    import jax
    import yaml

    from jctr.checkpoint.manager import Checkpointer
    from jctr.online.runner import OnlineRun
    from tests.conftest import ROOT
    from tests.test_epochs import leaves_equal

    model = _stream(tmp_path, days=("20190720",))
    cfg = json.loads(model.read_text())
    cfg["solver"].update(batchsize=64, display=1)  # 8 iterations a pass, each reported
    model.write_text(json.dumps(cfg))
    folders = sorted((tmp_path / "stream").glob("*/*"))
    for folder in folders[:1] if when == "waiting" else folders:
        (folder / "DONE").touch()
    doc = {"model": str(model), "train_data_dir": str(tmp_path / "stream"),
           "split_interval": 720, "split_per_pass": 1, "start_day": "20190720",
           "end_day": "20190720", "save_model_path": "killed", "data_donefile": "DONE",
           "data_sleep_second": 0.1}
    store = "sparse_store" in when
    kind = "row_file" if "row_file" in when else "rocks_db"
    if store:
        doc["sparse_store"] = {"type": kind, "path": str(tmp_path / "rows")}
    (tmp_path / "online.yaml").write_text(yaml.safe_dump(doc))
    cmd = [sys.executable, "-m", "jctr.online", "--config", str(tmp_path / "online.yaml")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen = []
    # waiting: pass 1 is checkpointed, then the run waits for pass 2's data; training: the
    # first of pass 2's eight iterations is done
    marks = {"checkpoint of day 20190720 pass 1"} if when == "waiting" else \
        {"[jctr] iter 9 "} | ({"checkpoint of day 20190720 pass 1"} if store else set())
    for line in proc.stdout:
        seen.append(line)
        marks = {m for m in marks if m not in line}
        if not marks:
            break
    if when == "waiting":
        time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert any("checkpoint of day 20190720 pass 1" in x for x in seen), seen[-5:]
    assert not (tmp_path / "killed" / "20190720" / "2").exists()  # pass 2 never finished
    (folders[1] / "DONE").touch()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "resuming after day 20190720 pass 1" in out.stdout
    assert "day 20190720 pass 2/2" in out.stdout
    from jctr.runtime.host_memory import malloc_tuning_env

    if malloc_tuning_env({}) is not None:  # glibc: it ran with python -m jctr.train's heap
        header = [x for x in (out.stdout + out.stderr).splitlines() if "host memory:" in x]
        assert header and "host memory: GLIBC_TUNABLES=" in header[0] and \
            "glibc.malloc.mmap_max=0" in header[0], header
    # the same two passes without a stop, in this process
    extra = {"sparse_store": {"type": kind, "path": str(tmp_path / "rows_whole")}} \
        if store else {}
    whole = OnlineRun(_online(tmp_path, model, tmp_path / "whole", end_day="20190720",
                              **extra), log=lambda s: None)
    assert whole.run() == 2
    killed = Checkpointer(str(tmp_path / "killed" / "20190720" / "2"))
    state, _ = killed.restore(whole.trainer.state, whole.trainer.specs)
    assert int(state.step) == int(whole.trainer.state.step) == 16
    assert leaves_equal(jax.tree.map(np.asarray, state.params),
                        jax.tree.map(np.asarray, whole.trainer.state.params))
    if store:
        from jctr.online.row_store import RowStore

        t = whole.trainer
        shapes = [{k: tuple(v.shape[1:]) for k, v in es.slots.items()}
                  for es in t.state.embeddings]
        rows = []
        for path in ("rows", "rows_whole"):
            db = RowStore(str(tmp_path / path), t.specs, shapes, kind)
            rows.append([db.pull(i, np.sort(np.concatenate(
                [k for k, _ in db.db.items(db.names[i])]))) for i in range(len(t.specs))])
            db.close()
        assert rows[0][0]["keys"].size > 100
        for got, want in zip(*rows):
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def record_conversion(path, kind, day, pass_id):  # the converter hook of the test below
    import json

    save = os.path.dirname(os.path.dirname(path))
    with open(os.path.join(save, "converted.jsonl"), "a") as f:
        f.write(json.dumps([os.path.relpath(path, save), kind, day, pass_id]) + "\n")


def test_base_and_delta_models_load_into_the_hps_and_predict_as_the_trainer(tmp_path):
    """Two days of two passes with a delta every pass and SparseAdaGradSGDRule tables: the
    saves land under the seed's names, the converter sees each inference model, and the HPS
    loaded with the day's base and its deltas in order (the deltas one at a time, each load
    writing only the delta the database lacks) predicts what the trainer predicts. The base
    holds exactly the keys whose score reaches base_threshold (counted here from the files)."""
    import json

    from jctr.config import ConfigError
    from jctr.config.hps import parse_ps_config
    from jctr.data.norm import read_norm_file
    from jctr.online.runner import OnlineRun
    from jctr.serving.bundle import InferenceModel
    from jctr.serving.hps import Databases
    from jctr.serving.hps_model import HPSModel

    model = _stream(tmp_path)
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    tp = {"converter": "tests.test_online:record_conversion",
          "embedx_sgd_param": {"learning_rate": 0.1, "initial_range": 0.01}}
    save = tmp_path / "save"
    run = OnlineRun(_online(tmp_path, model, save, save_delta_frequency=1,
                            table_parameters=tp), log=lambda s: None)
    assert run.run() == 4
    assert run.trainer.specs[0].optimizer.type == "SparseAdaGradSGDRule"
    assert run.trainer.specs[0].optimizer.embedx_sgd_param.learning_rate == 0.1
    converted = [json.loads(x) for x in (save / "converted.jsonl").read_text().splitlines()]
    assert converted == [["20190720/delta-1", "delta", "20190720", 1],
                         ["20190720/delta-2", "delta", "20190720", 2],
                         ["20190721/base", "base", "20190721", None],
                         ["20190721/delta-1", "delta", "20190721", 1],
                         ["20190721/delta-2", "delta", "20190721", 2],
                         ["20190722/base", "base", "20190722", None]]
    progress = json.loads((save / "progress.json").read_text())
    assert progress["day_end"] and progress["checkpoint"] == os.path.join("20190722", "0", "8")
    assert (save / "20190721" / "0" / "4").is_dir()  # day 1's batch model
    manifest = json.loads((save / "20190721" / "delta-2" / "manifest.json").read_text())
    assert (manifest["kind"], manifest["day"], manifest["pass"], manifest["step"]) == (
        "delta", "20190721", 2, 8)

    # the HPS: base of 20190721, then its deltas one at a time, into RocksDB + a hash map
    day = save / "20190721"
    eval_batch = next(run.trainer.data.eval.batches(256, epochs=1))

    def ps(deltas):
        return parse_ps_config({
            "supportlonglong": True,
            "volatile_db": {"type": "hash_map", "initial_cache_rate": 0.5},
            "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
            "models": [{"model": "m", "max_batch_size": 256, "bundle": str(day / "base"),
                        "deltas": [str(day / d) for d in deltas]}]}, str(tmp_path / "ps.json"))

    written = []
    for deltas in ([], ["delta-1"], ["delta-1", "delta-2"]):
        cfg = ps(deltas)
        dbs = Databases(cfg.volatile_db, cfg.persistent_db)
        hps = HPSModel(cfg.models[0], dbs)
        written.append(hps.load_databases(replace=True)["hps_et.m.sparse_embedding1"])
        dbs.close()
    delta_rows = [np.fromfile(day / d / "sparse" / "sparse_embedding1.model" / "key",
                              "<i8").size for d in ("delta-1", "delta-2")]
    assert written[1]["persistent_db"] == delta_rows[0]  # only what the database lacked
    assert written[2]["persistent_db"] == delta_rows[1]
    dbs = Databases(cfg.volatile_db, cfg.persistent_db)
    hps = HPSModel(cfg.models[0], dbs)
    assert hps.load_databases()["hps_et.m.sparse_embedding1"]["persistent_db"] == 0  # matches
    want = run.trainer.predict(eval_batch)
    np.testing.assert_allclose(hps.predict(eval_batch), want, rtol=2e-5, atol=1e-6)
    dbs.close()
    # the next day's base alone is the same model (the shrink deleted nothing)
    base = InferenceModel.load(str(save / "20190722" / "base"))
    np.testing.assert_allclose(base.predict(eval_batch), want, rtol=2e-5, atol=1e-6)
    # a base model of every row is the batch model's rows, linked once the snapshot is sealed
    # (not written a second time), and its manifest's checksums hold (InferenceModel.load
    # and the sparse reader checked them above)
    rows = save / "20190722" / "0" / "8" / "rows"
    index = json.loads((rows / "index.json").read_text())["tables"]["sparse_embedding1"]
    sparse = save / "20190722" / "base" / "sparse" / "sparse_embedding1.model"
    for name, array in (("key", "keys"), ("emb_vector", "values")):
        assert (sparse / name).stat().st_ino == (rows / index[array]["file"]).stat().st_ino
    # a database left half way through a delta is refused until loaded again
    cfg = ps(["delta-1"])
    from jctr.serving.hps import TableMismatch
    from jctr.stores.rocksdb import RocksDBStore

    store = RocksDBStore(cfg.persistent_db)
    meta = store.get_meta("hps_et.m.sparse_embedding1")
    store.set_meta("hps_et.m.sparse_embedding1", {**meta, "incomplete": True})
    store.close()
    dbs = Databases(cfg.volatile_db, cfg.persistent_db)
    with pytest.raises(TableMismatch, match="was being updated with delta models"):
        HPSModel(cfg.models[0], dbs).load_databases()
    dbs.close()
    with pytest.raises(ConfigError, match=r"ps.json: models\[0\].deltas\[1\]: .*iter 6, not after"):
        ps(["delta-2", "delta-1"])

    # base_threshold 1.0: the base holds the keys with click + 0.1 * (show - click) >= 1
    files = sorted((tmp_path / "stream").glob("*/*/part-0.data"))
    blocks = [read_norm_file(str(f), label_dim=1, dense_dim=13, slot_num=8, key_type="I64",
                             check="Sum") for f in files]
    keys = np.concatenate([b.keys for b in blocks])
    per_key = np.concatenate([np.repeat(b.label[:, 0], b.nnz.sum(axis=1)) for b in blocks])
    uniq, inverse = np.unique(keys, return_inverse=True)
    show = np.bincount(inverse, minlength=uniq.size)
    click = np.bincount(inverse, per_key, uniq.size)
    expected = np.sort(uniq[click + 0.1 * (show - click) >= 1.0])
    run = OnlineRun(_online(tmp_path, model, tmp_path / "filtered",
                            table_parameters={"base_threshold": 1.0}), log=lambda s: None)
    run.run()
    stored = np.fromfile(tmp_path / "filtered" / "20190722" / "base" / "sparse"
                         / "sparse_embedding1.model" / "key", "<i8")
    assert 0 < expected.size < uniq.size
    np.testing.assert_array_equal(np.sort(stored), expected)
    # a filtered base model is written (beside the snapshot), not linked
    assert (tmp_path / "filtered" / "20190722" / "base" / "sparse" / "sparse_embedding1.model"
            / "key").stat().st_nlink == 1


def _days_with_deltas(tmp_path, **table_parameters):
    """Two days of two passes of ``_stream`` trained with a delta model every pass (their
    base and delta models under ``tmp_path/save``); returns the finished run."""
    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path)
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    run = OnlineRun(_online(tmp_path, model, tmp_path / "save", save_delta_frequency=1,
                            **({"table_parameters": table_parameters}
                               if table_parameters else {})),
                    log=lambda s: None)
    assert run.run() == 4
    return run


def test_a_server_takes_the_next_deltas_and_the_next_base_without_a_restart(tmp_path):
    """A server of a base and its deltas took new models only through `serve load`, which
    RocksDB's lock allows only with the server stopped: a restart every delta (Paddle's
    delta models come every few passes) and every day's base. Sent SIGHUP, `serve` reads its
    parameter-server file again and each model takes the models it names now: the next
    deltas (their rows into every layer), or the next day's base (every layer's table made
    that base: written apart and swapped in, so the keys the day's shrink deleted are gone,
    the hash map's share kept to the keys it held); the device cache reads the keys it holds
    again and forgets the erased ones; then the last model's dense weights. Each time it
    predicts what a server loaded afresh with the same models predicts, and a later start
    writes nothing. A chain that drops deltas of the base served is refused and the model
    served as it was."""
    import json
    import signal

    from jctr.config.hps import load_ps_config
    from jctr.serving.bundle import InferenceModel
    from jctr.serving.cli import take_models_on_sighup
    from jctr.serving.hps import Databases
    from jctr.serving.hps_model import HPSModel
    from jctr.stores import StoreError

    run = _days_with_deltas(tmp_path, delete_threshold=0.25)
    save = tmp_path / "save"
    day, table = save / "20190721", "hps_et.m.sparse_embedding1"
    batch = next(run.trainer.data.eval.batches(256, epochs=1))
    path = tmp_path / "ps.json"

    def ps(base, deltas, rocks="rocks", where=path, cacheper=0.5, rate=0.5):
        where.write_text(json.dumps({
            "supportlonglong": True,
            "volatile_db": {"type": "hash_map", "initial_cache_rate": rate},
            "persistent_db": {"type": "rocks_db", "path": str(tmp_path / rocks)},
            "models": [{"model": "m", "max_batch_size": 256, "bundle": str(base),
                        "deltas": [str(day / d) for d in deltas], "gpucache": True,
                        "gpucacheper": cacheper, "hit_rate_threshold": 1.0}]}))
        return load_ps_config(where)

    def afresh(base, deltas):
        """What a server loaded with these models from the start predicts."""
        cfg = ps(base, deltas, rocks=f"rocks_ref{len(deltas)}", where=tmp_path / "ref.json")
        dbs = Databases(cfg.volatile_db, cfg.persistent_db)
        ref = HPSModel(cfg.models[0], dbs)
        try:
            ref.load_databases(replace=True)
            return ref.predict(batch)
        finally:
            ref.close()
            dbs.close()

    def sighup(lines, said):
        old = signal.getsignal(signal.SIGHUP)
        try:
            take_models_on_sighup(str(path), {"m": hps}, log=lines.append)
            os.kill(os.getpid(), signal.SIGHUP)
            deadline = time.monotonic() + 60
            while not any(said in x or "error" in x for x in lines) and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            signal.signal(signal.SIGHUP, old)
        assert any(said in x for x in lines), lines

    cfg = ps(day / "base", ["delta-1"])
    dbs = Databases(cfg.volatile_db, cfg.persistent_db)
    hps = HPSModel(cfg.models[0], dbs)
    hps.load_databases(replace=True)
    before = hps.predict(batch)  # the cache takes the batch's keys
    hps.wait_inserts()
    assert hps.tables[0].cache.size() > 0
    with pytest.raises(StoreError, match="deltas of the same base that do not extend those "
                                         "served"):
        hps.take_chain(ps(day / "base", ["delta-2"]).models[0])
    np.testing.assert_array_equal(hps.predict(batch), before)  # served as it was
    # the next delta added to the file
    ps(day / "base", ["delta-1", "delta-2"])
    sighup([], "[jctr] m: 1 delta model(s) taken; serving")
    two = hps.predict(batch)
    np.testing.assert_allclose(two, afresh(day / "base", ["delta-1", "delta-2"]),
                               rtol=2e-5, atol=1e-6)
    assert not np.allclose(before, two)
    # other settings changed: said to take a restart, the model served as it was
    ps(day / "base", ["delta-1", "delta-2"], cacheper=0.25, rate=0.75)
    lines = []
    sighup(lines, "those take a restart")
    assert any("m: " + str(path) + " changes gpucacheper, volatile_db: those take a restart"
               in x for x in lines), lines
    np.testing.assert_array_equal(hps.predict(batch), two)
    # the next day's base (the shrink deleted keys at the day's end)
    base = save / "20190722" / "base"
    kept = np.fromfile(base / "sparse" / "sparse_embedding1.model" / "key", "<i8")
    chain = np.concatenate([np.fromfile(b / "sparse" / "sparse_embedding1.model" / "key",
                                        "<i8")
                            for b in (day / "base", day / "delta-1", day / "delta-2")])
    assert np.setdiff1d(chain, kept).size > 0
    # the hash map holds the old share and the next one together while a base is written:
    # a switch that would not fit is refused before any write, the model served as it was
    from jctr.serving import hps_model as hps_model_module

    real_room = hps_model_module.room_left
    hps_model_module.room_left = lambda reserve=0: 1000
    try:
        with pytest.raises(StoreError, match="the next base's table would take .* beside the "
                                             "one served, but 1000 B are left"):
            hps.take_chain(ps(base, []).models[0])
    finally:
        hps_model_module.room_left = real_room
    np.testing.assert_array_equal(hps.predict(batch), two)
    ps(base, [])
    sighup([], "[jctr] m: a new base taken")
    want = InferenceModel.load(str(base)).predict(batch)
    np.testing.assert_allclose(hps.predict(batch), want, rtol=2e-5, atol=1e-6)
    stored = np.concatenate([k for k, _ in dbs.persistent.items(table)])
    np.testing.assert_array_equal(np.sort(stored), np.sort(kept))
    share = np.concatenate([k for k, _ in dbs.volatile.items(table)])
    assert np.isin(share, kept).all() and share.size <= kept.size
    cached = hps.tables[0].cache.cached_keys(0, hps.tables[0].cache.num_sets)
    assert np.isin(cached, kept).all()
    # back to the day before, its cache unreadable meanwhile (a layer down): the cached keys
    # are forgotten, never left with the other day's rows; then the next base again
    from jctr.serving.hps import LayerUnavailable

    def down(*args, **kwargs):
        raise LayerUnavailable("volatile_db", "down")
    calls = []  # and every layer's next table is written before any is swapped in
    for step in ("write_staged", "swap_staged"):
        real = getattr(dbs, step)
        setattr(dbs, step, lambda layer, *a, real=real, step=step, **k:
                calls.append((step, layer)) or real(layer, *a, **k))
    dbs.lookup = down
    try:
        assert hps.take_chain(ps(day / "base", []).models[0]) == (True, 0)
    finally:
        del dbs.lookup, dbs.write_staged, dbs.swap_staged
    assert calls == [("write_staged", "persistent_db"), ("write_staged", "volatile_db"),
                     ("swap_staged", "persistent_db"), ("swap_staged", "volatile_db")], calls
    assert hps.tables[0].cache.size() == 0
    np.testing.assert_allclose(hps.predict(batch), afresh(day / "base", []),
                               rtol=2e-5, atol=1e-6)
    assert hps.take_chain(ps(base, []).models[0]) == (True, 0)
    np.testing.assert_allclose(hps.predict(batch), want, rtol=2e-5, atol=1e-6)
    hps.close()
    dbs.close()
    # a later start finds the new base there: nothing written again; a next base a switch
    # stopped half way had written (a process killed meanwhile) is dropped, and said
    cfg = load_ps_config(path)
    dbs = Databases(cfg.volatile_db, cfg.persistent_db)
    dbs.persistent.insert(table + "~next", np.array([1], np.int64), np.ones((1, 8), np.float32))
    hps = HPSModel(cfg.models[0], dbs)
    lines = []
    assert hps.load_databases(progress=lines.append)[table]["persistent_db"] == 0
    assert dbs.persistent.tables() == [table] and any("half written, dropped" in x
                                                      for x in lines), lines
    np.testing.assert_allclose(hps.predict(batch), want, rtol=2e-5, atol=1e-6)
    hps.close()
    dbs.close()


def test_a_sighup_during_the_serve_commands_imports_ends_only_load(tmp_path):
    """`python -m jctr.serve` catches SIGHUP before its imports (``jctr/serve.py``), so a
    SIGHUP while they run (sent here from an import hook, as `jctr.serving.cli` is imported)
    no longer ends the server's process; `load`, a batch command, still ends at it."""
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    driver = (
        "import os, runpy, signal, sys\n"
        "class Hangup:\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'jctr.serving.cli':\n"
        "            os.kill(os.getpid(), signal.SIGHUP)\n"
        "sys.meta_path.insert(0, Hangup())\n"
        "sys.argv = ['jctr.serve', *sys.argv[1:]]\n"
        "runpy.run_module('jctr.serve', run_name='__main__', alter_sys=True)\n")

    def run(*args):
        return subprocess.run([sys.executable, "-c", driver, *args], cwd=ROOT, timeout=120,
                              capture_output=True, text=True)

    served = run("--help")
    assert served.returncode == 0 and "usage: python -m jctr.serve" in served.stdout, \
        served.stderr
    loaded = run("load", "--config", str(tmp_path / "ps.json"))
    assert loaded.returncode == -signal.SIGHUP, (loaded.returncode, loaded.stderr)


def test_serve_takes_a_sighup_while_it_starts_and_then_the_next_delta(tmp_path):
    """`python -m jctr.serve` itself: a SIGHUP while it loads its databases (SIGHUP's default
    would end the process) is taken once it serves; a later one, after the next delta was
    added to its file, is said taken, and the server answers as before."""
    import json
    import queue
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    from tests.conftest import ROOT

    _days_with_deltas(tmp_path)
    day = tmp_path / "save" / "20190721"
    path = tmp_path / "ps.json"

    def ps(deltas):
        path.write_text(json.dumps({
            "supportlonglong": True, "volatile_db": {"type": "hash_map"},
            "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
            "models": [{"model": "m", "max_batch_size": 256, "bundle": str(day / "base"),
                        "deltas": [str(day / d) for d in deltas]}]}))

    ps(["delta-1"])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jctr.serve", "--config", str(path),
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()

    def said(text, timeout=120):
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)
                continue
            seen.append(line)
            if text in line:
                return
        pytest.fail(f"not said: {text}; said: {''.join(seen)}")

    try:
        said("[jctr] starting m from")  # checking and loading its databases now
        proc.send_signal(signal.SIGHUP)
        said("[jctr] serving m on")
        ps(["delta-1", "delta-2"])
        proc.send_signal(signal.SIGHUP)
        said("[jctr] m: 1 delta model(s) taken")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready",
                                    timeout=10) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_run_stopped_before_the_day_end_saves_does_them_on_resume(tmp_path):
    """Stopped after the day's last pass checkpoint but before its shrink and saves: started
    again, it shrinks and writes the batch and base models from that checkpoint."""
    import json
    import shutil

    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path, days=("20190720",))
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    save = tmp_path / "save"
    assert OnlineRun(_online(tmp_path, model, save, end_day="20190720"),
                     log=lambda s: None).run() == 2
    base = (save / "20190721" / "base" / "sparse" / "sparse_embedding1.model" / "key")
    keys = np.fromfile(base, "<i8")
    # as if stopped right after the checkpoint of pass 2
    shutil.rmtree(save / "20190721")
    (save / "progress.json").write_text(json.dumps(
        {"day": "20190720", "pass": 2, "step": 4, "day_end": False,
         "checkpoint": str(save / "20190720" / "2" / "4")}))
    lines = []
    assert OnlineRun(_online(tmp_path, model, save, end_day="20190720"),
                     log=lines.append).run() == 0
    assert any(x.startswith("[jctr] shrink at the end of day 20190720") for x in lines)
    assert any("batch model after day 20190720 pass 2" in x for x in lines)
    np.testing.assert_array_equal(np.fromfile(base, "<i8"), keys)
    assert json.loads((save / "progress.json").read_text())["day_end"]


def _two_pass_stream(tmp_path) -> dict:
    """A one-day stream of two passes (the second's three files give one of two processes
    twice the other's data) and a model config with a learning rate of almost 0 (processes
    that split the data differently then predict alike)."""
    import json
    import shutil

    model = _stream(tmp_path, days=())
    cfg = json.loads(model.read_text())
    cfg["optimizer"] = {"type": "SGD", "sgd_hparam": {"learning_rate": 1e-30}}
    for layer in cfg["layers"][1:]:
        layer.pop("optimizer", None)
    train = sorted((tmp_path / "dlrm" / "train").glob("*.data"))
    for hhmm, picks in (("0000", (0, 1)), ("1200", (2, 3, 0))):
        folder = tmp_path / "stream" / "20190720" / hhmm
        folder.mkdir(parents=True)
        for i, k in enumerate(picks):
            shutil.copy(train[k], folder / f"part-{i}.data")
        (folder / "DONE").touch()
    return cfg


def _run_processes(tmp_path, cfg: dict, name: str, processes: int, **online):
    """``python -m jctr.online`` on :func:`_two_pass_stream`'s stream in ``processes``
    jax.distributed processes; returns its pass records, feature statistics (by key), base
    model keys (sorted) and stdout."""
    import json
    import subprocess
    import sys

    import yaml

    from tests.conftest import ROOT, xla_flags

    cfg["solver"]["gpu"] = [[0]] * processes if processes > 1 else [0]
    (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
    doc = {"model": f"{name}.json", "train_data_dir": "stream", "split_interval": 720,
           "split_per_pass": 1, "start_day": "20190720", "end_day": "20190720",
           "save_model_path": name, "data_donefile": "DONE", "data_sleep_second": 0.05,
           **online}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "XLA_FLAGS": xla_flags(1),
           "PYTHON": sys.executable, "JCTR_LAUNCH_MODULE": "jctr.online"}
    cmd = (["bash", os.path.join(ROOT, "scripts", "launch_local.sh"), str(processes),
            str(path)] if processes > 1 else [sys.executable, "-m", "jctr.online",
                                               "--config", str(path)])
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    save = tmp_path / name
    records = [json.loads(x) for x in (save / "passes.jsonl").read_text().splitlines()]
    with np.load(next((save / "20190721" / "0").glob("feature_stats.npz"))) as f:
        order = np.argsort(f["0/keys"])  # kept in the order keys came: compared by key
        stats = {k: f[k][order] for k in f.files}
    base = np.fromfile(save / "20190721" / "base" / "sparse" / "sparse_embedding1.model"
                       / "key", "<i8")
    return records, stats, np.sort(base), out.stdout


def test_two_processes_count_and_score_as_one(tmp_path):
    """``python -m jctr.online`` in two jax.distributed processes (each reading its share of
    a pass's files; the second pass's three files give one process twice the other's data)
    against one process on the same tree, with a learning rate of almost 0 so that both
    predict alike: every key's show and click, the base model's keys and each pass AUC
    (bucketed counts summed over the processes) are the single process's."""
    cfg = _two_pass_stream(tmp_path)
    one = _run_processes(tmp_path, cfg, "one", 1)
    two = _run_processes(tmp_path, cfg, "two", 2)
    assert "[p0] [jctr] day 20190720 pass 2/2" in two[3]
    assert "[p1] [jctr] day" not in two[3]  # one process reports for all
    assert [r["iterations"] for r in one[0]] == [4, 6]
    assert [r["iterations"] for r in two[0]] == [4, 8]  # 4 + 4 padding-only steps in pass 2
    for a, b in zip(one[0], two[0]):
        assert a["pass_auc"] == pytest.approx(b["pass_auc"], abs=1e-12)
    assert one[1].keys() == two[1].keys()
    for name in one[1]:
        np.testing.assert_array_equal(one[1][name], two[1][name], err_msg=name)
    np.testing.assert_array_equal(one[2], two[2])
    assert one[1]["0/show"].sum() == 2560 * 8  # every sample's 8 keys, counted once


@pytest.mark.parametrize("kind", ["rocks_db", "row_file"])
def test_two_processes_keep_their_rows_in_one_sparse_store(tmp_path, kind):
    """Issue 34 point 13: ``sparse_store`` with two jax.distributed processes. Each keeps the
    rows of its part of the keys (by key hash) in its own database under the store's path;
    a pass pulls every process's rows of the pass's keys (from both processes' data), trains,
    and each writes its part back. Against one process on the same stream (learning rate
    almost 0, so the data's split between processes does not matter): the two databases
    together hold exactly the one-process database's keys and rows, each only its own part,
    and the base models have the same keys. The store is refused by a run with another number
    of processes, naming why."""
    from jctr.config.hps import PersistentDatabaseParams
    from jctr.ops import owner_shards_host
    from jctr.stores.rocksdb import RocksDBStore
    from jctr.stores.row_file import RowFileStore

    def rows(path):
        db = RowFileStore(str(path)) if kind == "row_file" else \
            RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(path)))
        parts = list(db.items("online.sparse_embedding1"))
        db.close()
        keys = np.concatenate([k for k, _ in parts])
        order = np.argsort(keys)
        return keys[order], np.concatenate([r for _, r in parts])[order]

    cfg = _two_pass_stream(tmp_path)
    one = _run_processes(tmp_path, cfg, "one", 1, sparse_store={"type": kind, "path": "rows1"})
    two = _run_processes(tmp_path, cfg, "two", 2, sparse_store={"type": kind, "path": "rows2"})
    np.testing.assert_array_equal(one[2], two[2])
    for name in one[1]:
        np.testing.assert_array_equal(one[1][name], two[1][name], err_msg=name)
    assert [r["iterations"] for r in two[0]] == [4, 8]
    want_keys, want_rows = rows(tmp_path / "rows1")
    got = [rows(tmp_path / "rows2" / f"process-{p}-of-2") for p in (0, 1)]
    for p, (keys, _) in enumerate(got):
        assert keys.size and (owner_shards_host(keys, 2) == p).all()
    keys = np.concatenate([k for k, _ in got])
    order = np.argsort(keys)
    np.testing.assert_array_equal(keys[order], want_keys)
    np.testing.assert_allclose(np.concatenate([r for _, r in got])[order], want_rows,
                               rtol=1e-6, atol=1e-7)

    with pytest.raises(AssertionError, match="written by a run of another number of "
                                             "processes than this one's 1") as refused:
        _run_processes(tmp_path, cfg, "again", 1, sparse_store={"type": kind, "path": "rows2"})
    assert "compiled in" not in str(refused.value)  # said before the model is compiled
    with pytest.raises(AssertionError, match="rows1 holds one process's database, written by "
                                             "a run of another number of processes than this "
                                             "one's 2"):
        _run_processes(tmp_path, cfg, "again2", 2, sparse_store={"type": kind, "path": "rows1"})


def test_prefetch_trains_the_same_model_and_a_stop_ends_its_wait(tmp_path):
    import jax

    from jctr.online.runner import OnlineRun
    from tests.test_epochs import leaves_equal

    model = _stream(tmp_path, days=("20190720",))
    folders = sorted((tmp_path / "stream").glob("*/*"))
    (folders[0] / "DONE").touch()
    stop = threading.Event()
    waiting = OnlineRun(_online(tmp_path, model, tmp_path / "stopped", end_day="20190720"),
                        log=lambda s: None, stop=stop)
    threading.Timer(0.5, stop.set).start()  # pass 2's data never lands
    with pytest.raises(InterruptedError, match="stopped while waiting for day 20190720 pass 2"):
        waiting.run()
    (folders[1] / "DONE").touch()
    runs = [OnlineRun(_online(tmp_path, model, tmp_path / name, end_day="20190720",
                              prefetch=prefetch), log=lambda s: None)
            for name, prefetch in (("plain", False), ("ahead", True))]
    assert [r.run() for r in runs] == [2, 2]
    a, b = (jax.tree.map(np.asarray, r.trainer.state.params) for r in runs)
    assert leaves_equal(a, b)


def test_admission_in_a_streaming_run(tmp_path):
    """embedx_threshold 2: at the end every key's row has trained embedx dimensions exactly
    when its score (from the run's own show/click statistics) reached 2; the others are 0 in
    the table and in the base model."""
    from jctr.config import ConfigError
    from jctr.online.runner import OnlineRun
    from jctr.sharding.rows import export_placed

    model = _stream(tmp_path, days=("20190720",))
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    run = OnlineRun(_online(tmp_path, model, tmp_path / "save", end_day="20190720",
                            table_parameters={"embedx_threshold": 2.0, "embedx_dim": 7,
                                              "fea_dim": 10}), log=lambda s: None)
    assert run.run() == 2
    t = run.trainer
    assert t.specs[0].optimizer.embedx_threshold == 2.0
    table = export_placed(t.state.embeddings[0], t.placements[0])
    found, score = run.stats[0].lookup(table["keys"])
    assert found.all()
    admitted = (table["values"][:, 1:] != 0).any(axis=1)
    np.testing.assert_array_equal(admitted, score >= 2.0 - 1e-9)
    assert 0 < admitted.sum() < admitted.size
    np.testing.assert_array_equal(table["accessor"][:, 2] > 0, admitted)
    # the table's counts are the statistics' (after the day's decay: both halved)
    run2 = OnlineRun(_online(tmp_path, model, tmp_path / "decayed", end_day="20190720",
                             table_parameters={"embedx_threshold": 2.0,
                                               "show_click_decay_rate": 0.5}),
                     log=lambda s: None)
    run2.run()
    t2 = run2.trainer
    table2 = export_placed(t2.state.embeddings[0], t2.placements[0])
    stats2 = _by_key(run2.stats[0])
    at = np.searchsorted(stats2["keys"], table2["keys"])
    np.testing.assert_allclose(table2["accessor"][:, 0], stats2["show"][at])
    np.testing.assert_allclose(table2["accessor"][:, 1], stats2["click"][at])
    assert run2.stats[0].show.sum() == 0.5 * run.stats[0].show.sum()
    base = tmp_path / "save" / "20190721" / "base" / "sparse" / "sparse_embedding1.model"
    keys = np.fromfile(base / "key", "<i8")
    vectors = np.fromfile(base / "emb_vector", "<f4").reshape(keys.size, 8)
    order = np.argsort(table["keys"])
    pos = order[np.searchsorted(table["keys"], keys, sorter=order)]
    np.testing.assert_array_equal((vectors[:, 1:] != 0).any(axis=1), admitted[pos])
    with pytest.raises(ConfigError, match="embedx_dim: 5, but embedding .* makes it 7"):
        OnlineRun(_online(tmp_path, model, tmp_path / "bad", end_day="20190720",
                          table_parameters={"embedx_dim": 5}), log=lambda s: None).run()


def _drifting_stream(tmp_path, days: list[str], samples_per_file: int = 4096):
    """The tiny DLRM (a 32,000-row table) and a generated tree of ``days`` (two passes a
    day) of power-law keys whose popular keys drift every day; returns the model config's
    path."""
    import json

    from jctr.config import parse_config
    from jctr.data.tools.synthetic import generate_for_config
    from jctr.online.synthetic_stream import write_stream
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, "dlrm", display=1000, eval_batches=2, batchsize=256,
                      batchsize_eval=256, eval_interval=10**6)
    cfg["layers"][0]["synthetic"].update(num_samples=512, eval_num_samples=512, num_files=1)
    # three days of keys fit (27.7k), ten do not (46.4k): each slot draws from 6,000 keys
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = 32000
    generate_for_config(parse_config(cfg))  # the validation set
    write_stream(parse_config(cfg), str(tmp_path / "stream"), days, split_interval=720,
                 files_per_slice=1, samples_per_file=samples_per_file, drift=0.3,
                 vocab=[6000] * 8)
    model = tmp_path / "model.json"
    model.write_text(json.dumps(cfg))
    return model


def _small_stream(tmp_path, days: list[str], capacity: int, *, split_interval: int = 720,
                  samples_per_file: int = 512):
    """The tiny DLRM with a ``capacity``-row table (128 validation samples) and a generated
    tree of ``days`` of drifting keys, one file a pass; returns the model config's path."""
    import json

    from jctr.config import parse_config
    from jctr.data.tools.synthetic import generate_for_config
    from jctr.online.synthetic_stream import write_stream
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, "dlrm", display=1000, eval_batches=1, batchsize=256,
                      batchsize_eval=256, eval_interval=10**6)
    cfg["layers"][0]["synthetic"].update(num_samples=128, eval_num_samples=128, num_files=1)
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = capacity
    generate_for_config(parse_config(cfg))
    write_stream(parse_config(cfg), str(tmp_path / "stream"), days,
                 split_interval=split_interval, files_per_slice=1,
                 samples_per_file=samples_per_file, drift=0.37)
    model = tmp_path / "model.json"
    model.write_text(json.dumps(cfg))
    return model


def test_ten_days_of_a_drifting_stream_through_a_small_table(tmp_path):
    """Ten simulated days of power-law keys whose popular keys drift every day (a generated
    tree): with the shrink (keys unseen for more than a day go, Paddle's order: at the end of
    the second day after they were last seen) the table never holds more than about three days
    of keys and the pass AUC (each pass's predictions before it learns from them) climbs and
    holds; the same stream without a shrink fills the table."""
    import json

    from jctr.embedding.hash_table import TableFullError
    from jctr.online.runner import OnlineRun

    days = [f"201907{20 + d}" for d in range(10)]
    model = _drifting_stream(tmp_path, days)

    def online(name, unseen_days):
        return _online(tmp_path, model, tmp_path / name, start_day=days[0], end_day=days[-1],
                       table_parameters={"delete_after_unseen_days": unseen_days})

    lines = []
    assert OnlineRun(online("shrunk", 1), log=lines.append).run() == 20
    rows = [int(x.split(", ")[-1].split(" rows")[0].replace(",", "")) for x in lines
            if "rows in use" in x]
    assert len(rows) == 8 and max(rows) < 0.7 * 32000, rows
    aucs = [json.loads(x)["pass_auc"] for x in
            (tmp_path / "shrunk" / "passes.jsonl").read_text().splitlines()]
    assert min(aucs[-6:]) > 0.7 and min(aucs[-6:]) > aucs[0] + 0.15, aucs
    with pytest.raises(TableFullError):
        OnlineRun(online("kept", 30), log=lambda s: None).run()


def test_a_streaming_run_compiles_nothing_once_its_first_shrink_is_done(tmp_path,
                                                                         monkeypatch):
    """A streaming run lives for months, a pass an hour: a program compiled in a pass stays in
    the process for good. Five days of a drifting stream (two passes a day, the shrink
    erasing keys from the third day's end): once a shrink has run, a pass and its day end
    compile nothing. Each pass's checkpoint gathered the table's rows with an index of the
    table's size, a new program (and ~3.5 MB more memory a day) for every size met."""
    import jax

    from jctr.online import runner

    days = [f"201907{20 + d}" for d in range(5)]
    model = _drifting_stream(tmp_path, days, samples_per_file=2048)
    compiles: list[int] = [0]  # a count each pass (its training, its checkpoint, its day end)
    real = runner.OnlineRun._train_pass

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        compiles.append(0)
        return out

    def listen(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[-1] += 1

    monkeypatch.setattr(runner.OnlineRun, "_train_pass", counted)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        oc = _online(tmp_path, model, tmp_path / "save", start_day=days[0], end_day=days[-1],
                     table_parameters={"delete_after_unseen_days": 1})
        assert runner.OnlineRun(oc, log=lambda s: None).run() == 10
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles[0] > 0 and compiles[6:10] == [0, 0, 0, 0], compiles


def test_a_pass_saves_the_statistics_changed_since_its_days_batch_model(tmp_path):
    """Every checkpoint had every key's statistics beside it: a table that lives for months
    (keys of many days) wrote them all at every pass, where its table rows are a pass's
    (sparse_store). A pass's ``feature_stats.npz`` now holds the rows changed since the
    day's batch model (which holds them all) and names it; a run stopped after such a pass
    resumes from both to the statistics and model of a run that never stopped. (Paddle's
    accessor keeps show and click in the table's rows and saves them with each table save:
    ``CtrCommonAccessor::Save``.)"""
    import json
    import shutil

    import jax

    from jctr.data.records import DataError
    from jctr.online.runner import OnlineRun
    from tests.test_epochs import leaves_equal

    days = [f"201907{20 + d}" for d in range(3)]
    model = _drifting_stream(tmp_path, days, samples_per_file=1024)
    whole = OnlineRun(_online(tmp_path, model, tmp_path / "whole", start_day=days[0],
                              end_day=days[-1]), log=lambda s: None)
    assert whole.run() == 6
    save = tmp_path / "whole"

    def stats_file(day, folder):
        with np.load(save / day / folder / "feature_stats.npz") as f:
            return {k: f[k] for k in f.files}

    assert "base" not in stats_file(days[0], "1")  # day one: no batch model before it
    # (the second day's second pass met more than half of two days' keys: written whole)
    for day, n in ((days[1], "1"), (days[2], "1"), (days[2], "2")):
        base, changes = stats_file(day, "0"), stats_file(day, n)
        assert "base" not in base and str(changes["base"]) == f"{day}/0/feature_stats.npz"
        assert changes["base_rows"].tolist() == [base["0/keys"].size]
        assert 0 < changes["0/positions"].size < 0.5 * changes["0/rows"]
    # stopped after the last day's first pass (its record written, nothing after it)
    stopped = tmp_path / "stopped"
    shutil.copytree(save, stopped)
    shutil.rmtree(stopped / days[-1] / "2")
    shutil.rmtree(stopped / "20190723")
    step = int(next((stopped / days[-1] / "1").glob("[0-9]*")).name)
    (stopped / "progress.json").write_text(json.dumps(
        {"day": days[-1], "pass": 1, "step": step,
         "checkpoint": f"{days[-1]}/1/{step}", "day_end": False}))
    lines = []
    again = OnlineRun(_online(tmp_path, model, stopped, start_day=days[0], end_day=days[-1]),
                      log=lines.append)
    assert again.run() == 1
    assert any(f"resuming after day {days[-1]} pass 1" in x for x in lines), lines
    for name, value in whole.stats[0].state_dict().items():
        np.testing.assert_array_equal(again.stats[0].state_dict()[name], value, err_msg=name)
    assert leaves_equal(jax.tree.map(np.asarray, whole.trainer.state.params),
                        jax.tree.map(np.asarray, again.trainer.state.params))
    # the day's batch model gone: said, naming both files
    (stopped / "progress.json").write_text(json.dumps(
        {"day": days[-1], "pass": 1, "step": step,
         "checkpoint": f"{days[-1]}/1/{step}", "day_end": False}))
    os.remove(stopped / days[-1] / "0" / "feature_stats.npz")
    with pytest.raises(DataError, match=rf"{days[-1]}/1/feature_stats.npz: feature statistics "
                                        rf"unreadable \(changes over .*{days[-1]}/0/"
                                        r"feature_stats.npz\)"):
        OnlineRun(_online(tmp_path, model, stopped, start_day=days[0], end_day=days[-1]),
                  log=lambda s: None).run()


def test_checkpoint_keep_days_bounds_a_long_runs_checkpoints(tmp_path):
    """``checkpoint_keep_days: 1``: at each day's end the pass checkpoints and batch models of
    days before the one that ended go (a run that lives for months fills no disk); the base
    models stay, and the run resumes from its progress record and goes on to the next day.
    ``model_keep_days: 1`` does the same for the base and delta models (each day's base holds
    every row: months of them would fill the disk as surely). Without them (PaddlePaddle's
    way: ``SaveBase`` / ``SaveDelta`` in fleet_util write a folder a day and a pass and
    nothing removes one) every checkpoint and model stays."""
    import json

    from jctr.online.runner import OnlineRun

    days = [f"201907{20 + d}" for d in range(5)]
    model = _drifting_stream(tmp_path, days, samples_per_file=1024)

    def online(save, end, keep):
        return _online(tmp_path, model, tmp_path / save, start_day=days[0], end_day=end,
                       checkpoint_keep_days=keep)

    lines = []
    assert OnlineRun(online("kept", days[3], 1), log=lines.append).run() == 8
    save = tmp_path / "kept"

    def held(day):
        folder = save / day
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    assert [held(d) for d in days[:3]] == [[], ["base"], ["base"]]  # (day one's folder gone)
    assert not (save / days[0]).exists()
    assert held(days[3]) == ["0", "1", "2", "base"] and held(days[4]) == ["0", "base"]
    assert any("checkpoint(s) of days before 20190723 removed" in x for x in lines), lines
    progress = json.loads((save / "progress.json").read_text())
    assert (save / progress["checkpoint"]).is_dir() and progress["day"] == days[3]
    assert OnlineRun(online("kept", days[4], 1), log=lambda s: None).run() == 2
    assert held(days[3]) == ["base"]
    assert held(days[4]) == ["0", "1", "2", "base"]
    assert OnlineRun(online("all", days[2], 0), log=lambda s: None).run() == 6
    assert [sorted(p.name for p in (tmp_path / "all" / d).iterdir()) for d in days[:3]] == \
        [["1", "2"], ["0", "1", "2", "base"], ["0", "1", "2", "base"]]  # (day one: no 0)
    # base and delta models: those of days before the day that ended go, checkpoints stay
    lines.clear()
    models = _online(tmp_path, model, tmp_path / "models", start_day=days[0], end_day=days[3],
                     save_delta_frequency=1, model_keep_days=1)
    assert OnlineRun(models, log=lines.append).run() == 8
    save = tmp_path / "models"
    assert [held(d) for d in days] == [
        ["1", "2"], ["0", "1", "2"], ["0", "1", "2"],
        ["0", "1", "2", "base", "delta-1", "delta-2"], ["0", "base"]]
    said = [x for x in lines if x.startswith("[jctr] model_keep_days")]
    assert said == [f"[jctr] model_keep_days 1: {n} base and delta model(s) of days before "
                    f"{day} removed" for n, day in ((2, days[1]), (3, days[2]), (3, days[3]))]


def test_show_and_click_from_named_inputs(tmp_path):
    """show_click_entry: each key's show is the sum of its samples' dense[0] and its click the
    sum of label[0] (counted here from the files); a column the model lacks is refused."""
    from jctr.config import ConfigError
    from jctr.data.norm import read_norm_file
    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path, days=("20190720",))
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    run = OnlineRun(_online(tmp_path, model, tmp_path / "save", end_day="20190720",
                            table_parameters={"show_click_entry": {"show": "dense[0]",
                                                                   "click": "label[0]"}}),
                    log=lambda s: None)
    run.run()
    blocks = [read_norm_file(str(f), label_dim=1, dense_dim=13, slot_num=8, key_type="I64",
                             check="Sum")
              for f in sorted((tmp_path / "stream").glob("*/*/part-0.data"))]
    keys = np.concatenate([b.keys for b in blocks])
    per_key = lambda col: np.concatenate([np.repeat(col(b), b.nnz.sum(axis=1))  # noqa: E731
                                          for b in blocks])
    uniq, inverse = np.unique(keys, return_inverse=True)
    show = np.bincount(inverse, per_key(lambda b: b.dense[:, 0].astype(np.float64)), uniq.size)
    click = np.bincount(inverse, per_key(lambda b: b.label[:, 0] > 0.5), uniq.size)
    stats = _by_key(run.stats[0])
    np.testing.assert_array_equal(stats["keys"], uniq)
    np.testing.assert_allclose(stats["show"], show, rtol=1e-6)
    np.testing.assert_array_equal(stats["click"], click)
    with pytest.raises(ConfigError, match=r'show_click_entry.show: "dense\[13\]", but the '
                                          r"model has 13 dense column"):
        OnlineRun(_online(tmp_path, model, tmp_path / "bad", end_day="20190720",
                          table_parameters={"show_click_entry": {"show": "dense[13]"}}),
                  log=lambda s: None).run()
    with pytest.raises(ConfigError, match=r'show_click_entry.click: expected a number >= 0, '
                                          r'"label\[i\]" or "dense\[i\]", got .label0.'):
        _online(tmp_path, model, tmp_path / "bad", table_parameters={
            "show_click_entry": {"click": "label0"}})


@pytest.mark.parametrize("kind", ["rocks_db", "row_file"])
def test_a_table_larger_than_the_device_table_through_a_sparse_store(tmp_path, monkeypatch,
                                                                     kind):
    """sparse_store: three days of drifting keys, several times more than the device table
    holds, trained with the rows in RocksDB or in mapped row files (each pass pulls its keys'
    rows, trains, writes them back): every stored row, the statistics and the deltas equal an
    in-memory run's, with SparseAdaGradSGDRule, admission and the daily shrink. A run that
    stops after a write-back but before that pass's checkpoint puts the rows back when
    started again. Every write into RocksDB goes through its bulk load here (a large pass's
    write-back does; these passes are small). With RocksDB the statistics live in mapped
    files from the start (``STATS_IN_MEMORY_SHARE`` 0), resumed there: the same
    statistics."""
    import json

    from jctr.config import ConfigError, parse_config
    from jctr.data.tools.synthetic import generate_for_config
    from jctr.online.row_store import RowStore
    from jctr.online.runner import OnlineRun
    from jctr.online.synthetic_stream import write_stream
    from jctr.sharding.rows import export_placed
    from jctr.stores.rocksdb import RocksDBStore
    from tests.conftest import tiny_config

    monkeypatch.setattr(RocksDBStore, "INGEST_ROWS", 1)

    cfg = tiny_config(tmp_path, "dlrm", display=1000, eval_batches=1, batchsize=256,
                      batchsize_eval=256, eval_interval=10**6)
    cfg["layers"][0]["synthetic"].update(num_samples=128, eval_num_samples=128, num_files=1)
    generate_for_config(parse_config(cfg))
    days = ["20190720", "20190721", "20190722", "20190723"]
    write_stream(parse_config(cfg), str(tmp_path / "stream"), days, split_interval=720,
                 files_per_slice=1, samples_per_file=512, drift=0.37)
    # the last shrink deletes the keys only the first day had
    tp = {"embedx_threshold": 1.0, "delete_after_unseen_days": 2, "show_click_decay_rate": 0.9}

    def online(name, capacity, **extra):
        cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = capacity
        model = tmp_path / f"{name}.json"
        model.write_text(json.dumps(cfg))
        return _online(tmp_path, model, tmp_path / name, start_day=days[0], end_day=days[-1],
                       save_delta_frequency=1, table_parameters=tp, **extra)

    memory = OnlineRun(online("memory", 40_000), log=lambda s: None)
    assert memory.run() == 8
    want = export_placed(memory.trainer.state.embeddings[0], memory.trainer.placements[0])
    order = np.argsort(want["keys"])
    want = {k: v[order] for k, v in want.items()}

    # the second day's first write-back is done, its checkpoint never recorded: the run stops
    real = OnlineRun._record_checkpoint
    stopped = []

    def fail_once(self, day, n, path, day_end):
        if (day, n, day_end) == ("20190721", 1, False) and not stopped:
            stopped.append(1)
            raise KeyboardInterrupt
        return real(self, day, n, path, day_end)

    monkeypatch.setattr(OnlineRun, "_record_checkpoint", fail_once)
    if kind == "rocks_db":  # the statistics in mapped files from the start, resumed there
        monkeypatch.setattr(OnlineRun, "STATS_IN_MEMORY_SHARE", 0.0)
    store_cfg = online("disk", 2000, sparse_store={"type": kind, "path": "rows"})
    with pytest.raises(KeyboardInterrupt):
        OnlineRun(store_cfg, log=lambda s: None).run()
    lines = []
    disk = OnlineRun(store_cfg, log=lines.append)
    assert disk.run() == 6  # day 2 pass 1 again, then the rest
    assert any("put back the rows day 20190721 pass 1" in x for x in lines)
    t = disk.trainer
    assert int(t.state.embeddings[0].table.size) == 0  # only a pass's working set was there
    shapes = [{k: tuple(v.shape[1:]) for k, v in t.state.embeddings[0].slots.items()}]
    store = RowStore(str(tmp_path / "rows"), t.specs, shapes, kind)
    got = store.pull(0, want["keys"])
    assert got["keys"].size == want["keys"].size == store.size(0)
    # several device tables' worth: at the end, and more before the day-end shrinks
    assert want["keys"].size > 2 * 2000
    peak = max(int(x.split(": ")[2].split(" key")[0].replace(",", ""))
               + int(x.split(", ")[1].split(" with")[0].replace(",", ""))
               for x in lines if "shrink at the end" in x)
    assert peak > 3 * 2000
    for name in ("values", "g2sum", "accessor", "slot"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    store.close()
    assert disk.stats[0].mapped == (kind == "rocks_db")
    assert any("feature statistics: in memory up to" in x for x in lines)
    assert not [f for f in os.listdir(tmp_path / "disk") if "stats" in f]
    for name, value in memory.stats[0].state_dict().items():
        np.testing.assert_array_equal(disk.stats[0].state_dict()[name], value)
    for folder in ("20190723/delta-2", "20190724/base"):
        a, b = (np.fromfile(tmp_path / run / folder / "sparse" / "sparse_embedding1.model"
                            / "key", "<i8") for run in ("memory", "disk"))
        np.testing.assert_array_equal(np.sort(a), np.sort(b))
    with pytest.raises(ConfigError, match="checkpoint_per_pass: 2, but with sparse_store"):
        online("x", 2000, sparse_store={"path": "rows"}, checkpoint_per_pass=2)


def _rows_given(monkeypatch, method: str) -> list[int]:
    """``OnlineRun.<method>(self, i, keys, rows, ...)`` wrapped: each call's count of
    ``rows`` (None for None) appended to the list returned."""
    from jctr.online.runner import OnlineRun

    sizes = []
    real = getattr(OnlineRun, method)

    def counted(self, i, keys, rows, *rest):
        sizes.append(None if rows is None else rows["keys"].size)
        return real(self, i, keys, rows, *rest)

    monkeypatch.setattr(OnlineRun, method, counted)
    return sizes


@pytest.mark.parametrize("kind", ["rocks_db", "row_file"])
def test_the_next_pass_rows_read_while_a_pass_trains_change_nothing(tmp_path, monkeypatch,
                                                                  kind):
    """sparse_store with one process: while a pass trains, the prefetch thread reads the
    stored rows of the next pass's keys that this pass does not hold (this pass's write-back
    leaves them as they are); the next pass takes the rest from the rows this pass wrote
    back. Two days of four passes with drifting keys train to the same stored rows and
    statistics, bit for bit, as a run that reads every pass's rows after the last write-back
    (``prefetch: false``); each day's passes after the first took the rows read ahead. Each
    day's base model takes the rows of the keys its last pass does not hold from a read while
    that pass trained: the same keys and vectors as the base model read from the database.
    A delta after every pass takes the pass's rows from memory and reads the others. A pass's
    write-back is written there too, while the next pass trains (each day's last pass's
    while its checkpoint is written; the day's end waits for it), and the pass's checkpoint is
    recorded once it is done: a write-back that fails (here after writing every row) leaves
    its checkpoint unrecorded and the run stops with the error at the next pass's end; started
    again, the run puts the old rows back, trains that pass again (its unrecorded snapshot
    replaced) and ends with the same rows. A run stopped between a pass's end and its
    checkpoint drops that pass's write-back, not begun: nothing to put back."""
    import json

    from jctr.online.row_store import RowStore
    from jctr.online.runner import OnlineRun

    days = ["20190720", "20190721"]
    model = _small_stream(tmp_path, days, 4000, split_interval=360, samples_per_file=384)
    took = _rows_given(monkeypatch, "_pulled_rows")  # rows read ahead
    # models' rows, the pass's from memory (None: the others read now, for the deltas; else
    # those read while a day's last pass trained, for its base model)
    based = _rows_given(monkeypatch, "_model_rows")
    runs = {}
    for prefetch in (True, False):
        name = f"prefetch_{prefetch}"
        lines = []
        run = OnlineRun(_online(tmp_path, model, tmp_path / name, start_day=days[0],
                                end_day=days[-1], split_interval=360, prefetch=prefetch,
                                save_delta_frequency=1,
                                sparse_store={"type": kind, "path": f"rows_{prefetch}"}),
                        log=lines.append)
        assert run.run() == 8
        rows_lines = [x for x in lines if "sparse_store rows read in" in x]
        assert len(rows_lines) == 8 and all("written back in" in x for x in rows_lines)
        behind = ["written while the next pass trains" in x for x in rows_lines]
        assert behind == ([True, True, True, False] * 2 if prefetch else [False] * 8)
        beside = ["written while the pass's checkpoint is" in x for x in rows_lines]
        assert beside == ([False, False, False, True] * 2 if prefetch else [False] * 8)
        assert sum("s read ahead, while the last pass trained" in x
                   for x in rows_lines) == (6 if prefetch else 0)
        runs[prefetch] = run
        if prefetch:
            # passes 2-4 of each day (rows read ahead: none before the first day's second
            # pass, whose keys the store holds only if the first pass held them too)
            assert len(took) == 6 and took[0] == 0 < min(took[1:])
            took.clear()
    assert not took
    # each day's base model and its passes' deltas, with prefetch only
    assert based.count(None) == 8 and len(based) == 10 and min(x or 1 for x in based) > 0
    saved = [f"{day}/{kind}" for day, following in zip(days, ("20190721", "20190722"))
             for kind in ("delta-1", "delta-2", "delta-3", "delta-4", f"../{following}/base")]
    for model_dir in saved:  # the same keys and vectors as the models read from the database
        models = []
        for prefetch in (True, False):
            folder = (tmp_path / f"prefetch_{prefetch}" / model_dir / "sparse"
                      / "sparse_embedding1.model")
            keys = np.fromfile(folder / "key", "<i8")
            vectors = np.fromfile(folder / "emb_vector", "<f4").reshape(keys.size, -1)
            order = np.argsort(keys)
            models.append((keys[order], vectors[order]))
        assert models[0][0].size > 100
        np.testing.assert_array_equal(models[0][0], models[1][0])
        np.testing.assert_array_equal(models[0][1], models[1][1])
    # each pass's record (and line) says how long its rows took to read and write back
    for prefetch in (True, False):
        records = [json.loads(x) for x in (tmp_path / f"prefetch_{prefetch}" / "passes.jsonl")
                   .read_text().splitlines()]
        assert all(r["store_read_s"] > 0 and r["store_write_s"] > 0 for r in records)
        ahead = [r["store_read_ahead_s"] is not None for r in records]
        assert ahead == ([False, True, True, True] * 2 if prefetch else [False] * 8)
    t = runs[True].trainer
    shapes = [{k: tuple(v.shape[1:]) for k, v in t.state.embeddings[0].slots.items()}]
    got = {}
    for prefetch in (True, False):
        store = RowStore(str(tmp_path / f"rows_{prefetch}"), t.specs, shapes, kind)
        keys = np.sort(np.concatenate([k for k, _ in store.db.items(store.names[0])]))
        got[prefetch] = store.pull(0, keys)
        store.close()
    assert got[True]["keys"].size > 1000
    for name, want in got[False].items():
        np.testing.assert_array_equal(got[True][name], want, err_msg=name)
    for name, value in runs[False].stats[0].state_dict().items():
        np.testing.assert_array_equal(runs[True].stats[0].state_dict()[name], value)

    # the second day's second write-back fails after writing its rows
    real_write = OnlineRun._write_back

    def fails(self, undo, pulled, tables, marker):
        real_write(self, undo, pulled, tables, marker)
        if (marker["day"], marker["pass"]) == (days[1], 2):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(OnlineRun, "_write_back", fails)
    failing = _online(tmp_path, model, tmp_path / "failed", start_day=days[0],
                      end_day=days[-1], split_interval=360,
                      sparse_store={"type": kind, "path": "rows_f"})
    with pytest.raises(OSError, match="No space left"):
        OnlineRun(failing, log=lambda s: None).run()
    progress = json.loads((tmp_path / "failed" / "progress.json").read_text())
    assert (progress["day"], progress["pass"]) == (days[1], 1)
    assert (tmp_path / "failed" / days[1] / "2").is_dir()  # written, never recorded
    monkeypatch.setattr(OnlineRun, "_write_back", real_write)
    lines = []
    assert OnlineRun(failing, log=lines.append).run() == 3
    assert any(f"put back the rows day {days[1]} pass 2" in x for x in lines)
    store = RowStore(str(tmp_path / "rows_f"), t.specs, shapes, kind)
    keys = np.sort(np.concatenate([k for k, _ in store.db.items(store.names[0])]))
    again = store.pull(0, keys)
    store.close()
    for name, want in got[False].items():
        np.testing.assert_array_equal(again[name], want, err_msg=name)

    # stopped between a pass's end and its checkpoint: its write-back, not begun, is dropped
    real_checkpoint = OnlineRun._checkpoint

    def stops(self, folder, day, n, *, day_end, **kw):
        if (day, n, day_end) == (days[0], 2, False):
            raise KeyboardInterrupt
        return real_checkpoint(self, folder, day, n, day_end=day_end, **kw)

    monkeypatch.setattr(OnlineRun, "_checkpoint", stops)
    stopping = _online(tmp_path, model, tmp_path / "stopped", start_day=days[0],
                       end_day=days[-1], split_interval=360,
                       sparse_store={"type": kind, "path": "rows_s"})
    with pytest.raises(KeyboardInterrupt):
        OnlineRun(stopping, log=lambda s: None).run()
    assert not os.listdir(tmp_path / "stopped" / "_store_undo")
    monkeypatch.setattr(OnlineRun, "_checkpoint", real_checkpoint)
    lines = []
    assert OnlineRun(stopping, log=lines.append).run() == 7
    assert not any("put back the rows" in x for x in lines)
    store = RowStore(str(tmp_path / "rows_s"), t.specs, shapes, kind)
    again = store.pull(0, keys)
    store.close()
    for name, want in got[False].items():
        np.testing.assert_array_equal(again[name], want, err_msg=name)


def _one_day_in_memory(tmp_path):
    """The day-end shrink tests' day (two passes; a ``delete_threshold`` that keys shown
    once without a click fall below, the decay) trained in memory: (model config,
    table_parameters, the table's rows in key order)."""
    from jctr.online.runner import OnlineRun
    from jctr.sharding.rows import export_placed

    model = _small_stream(tmp_path, ["20190720"], 4000)
    tp = {"delete_threshold": 0.15, "show_click_decay_rate": 0.9}
    memory = OnlineRun(_online(tmp_path, model, tmp_path / "memory", end_day="20190720",
                               table_parameters=tp), log=lambda s: None)
    assert memory.run() == 2
    want = export_placed(memory.trainer.state.embeddings[0], memory.trainer.placements[0])
    order = np.argsort(want["keys"])
    return model, tp, {k: v[order] for k, v in want.items()}


def _assert_stored_as(tmp_path, run, want: dict, kind: str) -> None:
    """The run's sparse_store (``rows`` under ``tmp_path``) holds exactly ``want``'s keys
    (an in-memory table's rows in key order), with their vectors, optimizer and admission
    columns and slots."""
    from jctr.online.row_store import RowStore

    t = run.trainer
    shapes = [{k: tuple(v.shape[1:]) for k, v in t.state.embeddings[0].slots.items()}]
    store = RowStore(str(tmp_path / "rows"), t.specs, shapes, kind)
    assert store.size(0) == want["keys"].size
    got = store.pull(0, want["keys"])
    store.close()
    back = np.argsort(got["keys"])
    np.testing.assert_array_equal(got["keys"][back], want["keys"])
    for name in ("values", "g2sum", "accessor", "slot"):
        if name in want:
            np.testing.assert_allclose(got[name][back], want[name], rtol=1e-5, atol=1e-7,
                                       err_msg=name)


@pytest.mark.parametrize("kind", ["rocks_db", "row_file"])
def test_a_day_end_shrink_deletes_what_the_last_pass_wrote_back(tmp_path, monkeypatch, kind):
    """sparse_store with prefetch: the day's last pass writes its rows back on the store
    thread while the day's end builds its base model from memory, and the shrink's database
    changes (deletions, the decay) are queued behind that write-back, after its checkpoint
    is recorded (``OnlineRun._after_write_back``). With a ``delete_threshold`` that keys shown
    once without a click fall below, the shrink deletes keys the last pass held and wrote:
    had they been erased before the write-back, it would have written them again. The stored
    rows equal an in-memory run's table (the same keys, vectors, optimizer and admission
    columns after the decay), the base models hold the same keys and vectors, and the log
    records the last pass's checkpoint before the day's batch model."""
    from jctr.online.row_store import RowStore
    from jctr.online.runner import OnlineRun

    model, tp, want = _one_day_in_memory(tmp_path)
    written, deleted = [], []
    real_push, real_shrink = RowStore.push, OnlineRun._shrink_store

    def push(self, table, stored):  # slowly: the day's end comes while it writes
        written.append(np.array(stored["keys"]))
        time.sleep(0.5)
        return real_push(self, table, stored)

    def shrink(self, i, day, keys, rate):
        deleted.append(np.array(keys))
        return real_shrink(self, i, day, keys, rate)

    monkeypatch.setattr(RowStore, "push", push)
    monkeypatch.setattr(OnlineRun, "_shrink_store", shrink)
    lines = []
    run = OnlineRun(_online(tmp_path, model, tmp_path / "disk", end_day="20190720",
                            table_parameters=tp, sparse_store={"type": kind, "path": "rows"}),
                    log=lines.append)
    assert run.run() == 2
    assert "written while the pass's checkpoint is" in [x for x in lines if "pass 2/2" in x][0]
    # the shrink deleted keys the last pass wrote back
    assert np.isin(deleted[0], written[-1]).sum() > 50
    assert len(want["keys"]) > 500
    _assert_stored_as(tmp_path, run, want, kind)
    models = []
    for name in ("memory", "disk"):
        folder = tmp_path / name / "20190721" / "base" / "sparse" / "sparse_embedding1.model"
        keys = np.fromfile(folder / "key", "<i8")
        vectors = np.fromfile(folder / "emb_vector", "<f4").reshape(keys.size, -1)
        models.append((np.sort(keys), vectors[np.argsort(keys)]))
    np.testing.assert_array_equal(models[0][0], models[1][0])
    np.testing.assert_allclose(models[0][1], models[1][1], rtol=1e-5, atol=1e-7)
    saved = [x for x in lines if "checkpoint of day" in x or "batch model after" in x]
    assert "pass 2" in saved[-2] and "checkpoint of" in saved[-2]
    assert "batch model after day 20190720 pass 2" in saved[-1]


def test_a_day_end_whose_shrink_fails_in_the_database_resumes_to_the_same_rows(tmp_path,
                                                                            monkeypatch):
    """The day end's shrink runs in the database on the store thread, after the last pass's
    write-back is in and its checkpoint recorded (``OnlineRun._after_write_back``). When it
    fails there (here before it erases anything), the run stops with that error at the day's
    end, the day's end unrecorded; started again, the run resumes after the last pass, does
    the day's end again (the same shrink, from that pass's statistics) and ends with the
    stored rows of an in-memory run."""
    from jctr.online.runner import OnlineRun

    model, tp, want = _one_day_in_memory(tmp_path)
    real_shrink = OnlineRun._shrink_store
    failed = []

    def shrink_once(self, i, day, keys, rate):
        if not failed:
            failed.append(threading.current_thread().name)
            raise RuntimeError("the database went away")
        return real_shrink(self, i, day, keys, rate)

    monkeypatch.setattr(OnlineRun, "_shrink_store", shrink_once)
    cfg = _online(tmp_path, model, tmp_path / "disk", end_day="20190720", table_parameters=tp,
                  sparse_store={"type": "rocks_db", "path": "rows"})
    with pytest.raises(RuntimeError, match="the database went away"):
        OnlineRun(cfg, log=lambda s: None).run()
    assert failed[0].startswith("jctr-store")  # behind the write-back, on the store thread
    lines = []
    run = OnlineRun(cfg, log=lines.append)
    assert run.run() == 0
    assert any("resuming after day 20190720 pass 2" in x for x in lines)
    assert any("batch model after day 20190720 pass 2" in x for x in lines)
    _assert_stored_as(tmp_path, run, want, "rocks_db")


def test_the_quick_start_runs_as_printed(tmp_path):
    """docs/streaming.md's quick start, command by command, in a scratch folder beside the
    shipped configs: the stream and the validation set are generated, and the run trains every
    pass and writes the day's base model. The reference YAML of every key parses as given."""
    import re
    import subprocess
    import sys

    from jctr.config.online import parse_online_config
    from tests.conftest import ROOT

    with open(os.path.join(ROOT, "docs", "streaming.md"), encoding="utf-8") as f:
        page = f.read()
    start = page.index("## Quick start\n")
    block = re.findall(r"```bash\n(.*?)```", page[start:], re.S)[0]
    commands = [line.split() for line in block.splitlines() if line.startswith("python ")]
    assert len(commands) == 2
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    for cmd in commands:
        out = subprocess.run([sys.executable, *cmd[1:]], cwd=tmp_path, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    passes = (tmp_path / "runs" / "online" / "passes.jsonl").read_text().splitlines()
    assert len(passes) == 4
    assert (tmp_path / "runs" / "online" / "20190722" / "base" / "manifest.json").is_file()
    import yaml

    reference = re.findall(r"```yaml\n(.*?)```", page, re.S)[0]
    cfg = parse_online_config(yaml.safe_load(reference), str(tmp_path / "online.yaml"))
    assert cfg.table_parameters.converter in (None, "")


def test_missing_inputs_are_errors_at_start_not_a_wait(tmp_path):
    """A model file or train_data_dir that is not there, or a first day folder that is not,
    stops the run at once with the path, instead of waiting for a done-file forever."""
    from jctr.config import ConfigError
    from jctr.data.records import DataError
    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path, days=("20190720",))
    with pytest.raises(ConfigError, match="nope.json"):
        OnlineRun(_online(tmp_path, tmp_path / "nope.json", tmp_path / "save"))
    cfg = _online(tmp_path, model, tmp_path / "save")
    with pytest.raises(ConfigError, match="train_data_dir: .*streamx: no such folder"):
        OnlineRun(dataclasses.replace(cfg, train_data_dir=str(tmp_path / "streamx")))
    late = _online(tmp_path, model, tmp_path / "save", start_day="20190721",
                   end_day="20190721")
    t0 = time.monotonic()
    with pytest.raises(DataError, match="20190721: no such day folder"):
        OnlineRun(late, log=lambda s: None).run()
    assert time.monotonic() - t0 < 30


def test_hourly_folders_and_the_paddle_settings_jctr_refuses(tmp_path):
    """``is_data_hourly_placed`` (Paddle's ``get_online_pass_interval``: ``%02d`` hour folders
    instead of ``%02d%02d``) trains from ``<day>/<HH>/``; slices shorter than an hour are
    refused (they would name one folder several times). ``global_shuffle`` and the dump keys
    are refused with the reason."""
    from jctr.config import ConfigError
    from jctr.config.online import parse_online_config
    from jctr.online.runner import OnlineRun

    assert pass_folders(360, 2, hourly=True) == [["00", "06"], ["12", "18"]]
    with pytest.raises(DataError, match="whole hours: use a multiple of 60"):
        pass_folders(30, 1, hourly=True)
    model = _stream(tmp_path, days=())
    from jctr.config import load_config
    from jctr.online.synthetic_stream import write_stream

    write_stream(load_config(str(model)), str(tmp_path / "stream"), ["20190720"],
                 split_interval=720, files_per_slice=1, samples_per_file=512, hourly=True)
    assert sorted(p.name for p in (tmp_path / "stream" / "20190720").iterdir()) == ["00", "12"]
    cfg = _online(tmp_path, model, tmp_path / "save", end_day="20190720",
                  is_data_hourly_placed=True)
    assert OnlineRun(cfg, log=lambda s: None).run() == 2
    for key, value, why in [("global_shuffle", True, "records do not move between processes"),
                            ("dump_fields", ["fc_1"], "does not dump intermediate layers"),
                            ("dump_param", ["emb"], "base and delta models hold")]:
        doc = {"model": "m.json", "train_data_dir": "s", "split_interval": 60,
               "split_per_pass": 1, "start_day": "20190720", "end_day": "20190720",
               "save_model_path": "out"}
        doc[key] = value
        with pytest.raises(ConfigError, match=f"{key}: not supported: .*{why}"):
            parse_online_config(doc, str(tmp_path / "online.yaml"))


def test_a_show_column_reaches_the_sparse_rule(tmp_path):
    """show_click_entry with a show column: every table's SparseAdaGradSGDRule divides by
    the pushed shows (its ``show``), whether the streaming config gives the rule
    (embed_sgd_param) or the model's own clause does."""
    import json

    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path, days=("20190720",))
    entry = {"show_click_entry": {"show": "dense[0]", "click": "label[0]"}}
    run = OnlineRun(_online(tmp_path, model, tmp_path / "a", end_day="20190720",
                            table_parameters={**entry, "embed_sgd_param": {}}),
                    log=lambda s: None)
    cfg = run._trainer().cfg
    assert all(cfg.embedding_optimizer(e).show == "dense[0]" for e in cfg.embeddings)
    raw = json.loads(model.read_text())
    for layer in raw["layers"]:
        if "sparse_embedding_hparam" in layer:
            layer["optimizer"] = {"type": "SparseAdaGradSGDRule"}
    model.write_text(json.dumps(raw))
    run = OnlineRun(_online(tmp_path, model, tmp_path / "b", end_day="20190720",
                            table_parameters=entry), log=lambda s: None)
    cfg = run._trainer().cfg
    assert all(cfg.embedding_optimizer(e).show == "dense[0]" for e in cfg.embeddings)


def fail_on_base(path, kind, day, pass_id):  # the converter hook of the test below
    if kind == "base":
        raise RuntimeError("the KV store refused the base model")


def test_a_failed_base_model_leaves_no_batch_model_behind(tmp_path):
    """At a day's end the batch model's snapshot is written while the base model is (they
    overlap); a base model that fails (here its converter) takes the snapshot with it, so the
    day end is done again, whole, when the run is started again."""
    import json

    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path, days=("20190720",))
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    cfg = _online(tmp_path, model, tmp_path / "save", end_day="20190720",
                  table_parameters={"converter": "tests.test_online:fail_on_base"})
    from jctr.config import ConfigError

    with pytest.raises(ConfigError, match=r"table_parameters\.converter: .*fail_on_base failed "
                                          r"on the base model .*refused the base model"):
        OnlineRun(cfg, log=lambda s: None).run()
    batch_model = tmp_path / "save" / "20190721" / "0"
    assert not batch_model.exists() or not [p for p in batch_model.iterdir()
                                            if p.name.isdigit()]
    progress = json.loads((tmp_path / "save" / "progress.json").read_text())
    assert (progress["pass"], progress["day_end"]) == (2, False)
    again = OnlineRun(dataclasses.replace(cfg, table_parameters=dataclasses.replace(
        cfg.table_parameters, converter="")), log=lambda s: None)
    assert again.run() == 0  # nothing left to train: the day end is done again
    progress = json.loads((tmp_path / "save" / "progress.json").read_text())
    assert progress["day_end"] and (batch_model / str(progress["step"])).is_dir()


def test_a_model_that_spills_evicted_rows_is_refused_by_streaming(tmp_path):
    """eviction.spill belongs to the core trainer; streaming training's rows beyond memory
    live in sparse_store: the run stops at its start, naming the embedding and both keys."""
    import json

    from jctr.config import ConfigError
    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path)
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    raw = json.loads(open(model).read())
    raw["layers"][1]["eviction"] = {"policy": "lru", "spill": str(tmp_path / "spill")}
    spilling = tmp_path / "spilling.json"
    spilling.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="sparse_embedding1.*eviction.spill.*sparse_store"):
        OnlineRun(_online(tmp_path, spilling, tmp_path / "save"), log=lambda s: None).run()


def test_the_shrink_in_place_equals_the_masked_columns(monkeypatch):
    """The shrink compacts the columns in place and rebuilds the index on a thread of its own:
    the same statistics as the plain formulation of ``CtrCommonAccessor::Shrink``
    (paddle/fluid/distributed/ps/table/ctr_accessor.cc: decay, then delete by score or unseen
    days) with masks, every kept key found at its row, and work after it (observe, lookup)
    waits for the index. A failure of the rebuild is raised where the index is next used."""
    rng = np.random.default_rng(3)
    n = 60_000
    stats = FeatureStats()
    keys = rng.choice(1 << 40, n, replace=False).astype(np.int64)
    stats.observe(keys, show=rng.integers(0, 20, n).astype(float), click=0.0)
    stats.observe(keys[::3], show=1.0, click=1.0)
    stats.unseen_days[:] = rng.integers(0, 6, n)
    stats.since_delta[:] = rng.random(n) < 0.5
    before = {name: col.copy() for name, col in stats.state_dict().items()}
    rule = ShrinkRule(show_click_decay_rate=0.8, delete_threshold=0.5,
                      delete_after_unseen_days=4)
    deleted = stats.shrink(rule)
    show, click = before["show"] * 0.8, before["click"] * 0.8
    drop = (ScoreRule().score(show, click) < 0.5) | (before["unseen_days"] > 4)
    assert 0 < drop.sum() < n
    np.testing.assert_array_equal(deleted, np.sort(before["keys"][drop]))
    want = {"keys": before["keys"], "show": show, "click": click,
            "unseen_days": before["unseen_days"], "delta_score": before["delta_score"],
            "since_delta": before["since_delta"]}
    for name, col in stats.state_dict().items():
        np.testing.assert_array_equal(col, want[name][~drop], err_msg=name)
    np.testing.assert_array_equal(stats.rows_of(before["keys"]),
                                  np.where(drop, -1, np.cumsum(~drop) - 1))
    stats.observe(deleted[:10], show=1.0, click=0.0)  # deleted keys come back as new rows
    assert len(stats) == (~drop).sum() + 10
    np.testing.assert_array_equal(stats.rows_of(deleted[:10]), (~drop).sum() + np.arange(10))

    def broken(*args):
        raise MemoryError("no room for the index")

    monkeypatch.setattr("jctr.online.key_index.rebuild_distinct", broken)
    stats.unseen_days[:5] = 99
    assert stats.shrink(ShrinkRule(delete_after_unseen_days=4)).size == 5
    with pytest.raises(MemoryError, match="no room"):
        stats.rows_of(keys[:3])


def _tight_memory(monkeypatch, keep: int):
    """The machine as one with room for ``keep`` data files of each set a run keeps in
    memory (``jctr.runtime.host_memory.room_left`` as :meth:`Dataset.cache_all` sees it):
    room while fewer are kept, none after."""
    from jctr.data import dataset as ds

    real, asked = ds.Dataset.cache_all, threading.local()  # (the prefetch has a thread)

    def cache_all(self, reserve=0):
        asked.count = 0
        return real(self, reserve)

    def room_left(reserve=0):
        asked.count += 1
        return 1 << 40 if asked.count <= keep else -1

    monkeypatch.setattr(ds.Dataset, "cache_all", cache_all)
    monkeypatch.setattr(ds, "room_left", room_left)


def test_a_pass_too_large_for_memory_trains_from_its_files(tmp_path, monkeypatch):
    """A streaming pass's data is read into memory ahead of it, while the pass before trains
    (Paddle's ``preload_into_memory``): a pass of an hour of a production stream is tens of
    GB, and two of them beside the tables were a process the kernel killed mid-day. Each file
    is kept only while the machine has room for it beside the step's peak
    (``MemoryPlan.transient``) and a margin (``Dataset.cache_all``); the others are read from
    disk as the pass trains. The model is the one the run with every file in memory trains;
    the pass's line and record say how many files it read from disk."""
    import json
    import shutil

    import jax

    from jctr.online.runner import OnlineRun
    from tests.test_epochs import leaves_equal

    model = _stream(tmp_path, days=("20190720",))
    for folder in sorted((tmp_path / "stream").glob("*/*")):  # three files a pass
        for k in (1, 2):
            shutil.copy(folder / "part-0.data", folder / f"part-{k}.data")
        (folder / "DONE").touch()
    whole = OnlineRun(_online(tmp_path, model, tmp_path / "whole", end_day="20190720"),
                      log=lambda s: None)
    assert whole.run() == 2
    _tight_memory(monkeypatch, keep=1)
    lines = []
    tight = OnlineRun(_online(tmp_path, model, tmp_path / "tight", end_day="20190720"),
                      log=lines.append)
    assert tight.run() == 2
    assert any("pass 2/2: 3 file(s)" in x and "2 file(s) read from disk as it trained" in x
               for x in lines)
    records = [json.loads(x) for x in open(tmp_path / "tight" / "passes.jsonl")]
    assert [r["uncached_files"] for r in records if "pass" in r] == [0, 2]
    a, b = (jax.tree.map(np.asarray, r.trainer.state.params) for r in (whole, tight))
    assert leaves_equal(a, b)


@pytest.mark.parametrize("kind", ["rocks_db", "row_file"])
def test_a_base_model_of_a_table_larger_than_memory_is_written_a_part_at_a_time(
        tmp_path, monkeypatch, kind):
    """sparse_store keeps a table larger than memory, but the day's base model gathered every
    stored row in memory twice (read while the last pass trained, then joined for the
    bundle): a store several times memory killed the run at its first day end. Where those
    rows (twice) do not fit beside the step's peak (``OnlineRun._unheld_fits``), the base
    model reads the database a part at a time and writes each part's chosen rows as it
    goes (``RowStore.pull_except_parts``, ``model_files.write_sparse_model_parts``): the
    same keys and vectors as the run that held them, files that pass the bundle's
    checksums, and a line saying so."""
    import json

    from jctr.checkpoint.model_files import read_sparse_model
    from jctr.online import runner
    from jctr.online.runner import OnlineRun

    days = ["20190720", "20190721"]
    model = _small_stream(tmp_path, days, 3000)

    def run(name, lines):
        doc = _online(tmp_path, model, tmp_path / name, start_day=days[0], end_day=days[-1],
                      sparse_store={"type": kind, "path": f"rows-{name}"})
        assert OnlineRun(doc, log=lines.append).run() == 4

    run("room", [])
    read_ahead, real = [], OnlineRun._read_unheld
    # room for the statistics and the passes' rows (the plans at start), then 1 KiB: a
    # machine filled meanwhile
    room = iter([1 << 40, 1 << 40])
    monkeypatch.setattr(runner, "room_left", lambda reserve=0: next(room, 1 << 10))
    monkeypatch.setattr(OnlineRun, "_read_unheld",
                        lambda self, held: read_ahead.append(1) or real(self, held))
    lines = []
    run("tight", lines)
    assert not read_ahead
    said = [x for x in lines if "read from the database a part at a time" in x]
    assert len(said) == 2 and "20190722/base" in said[-1], lines
    for day in ("20190721", "20190722"):
        got = []
        for name in ("room", "tight"):
            folder = tmp_path / name / day / "base"
            keys, vectors = read_sparse_model(
                str(folder / "sparse" / "sparse_embedding1.model"), 8)
            manifest = json.loads((folder / "manifest.json").read_text())
            assert manifest["embeddings"]["sparse_embedding1"]["keys"] == keys.size > 2000
            order = np.argsort(keys)
            got.append((keys[order], vectors[order]))
        np.testing.assert_array_equal(got[0][0], got[1][0])
        np.testing.assert_array_equal(got[0][1], got[1][1])
    assert got[0][0].size > 3000  # the second day's: more keys than the device table holds


def test_sparse_store_plans_a_pass_s_rows_and_refuses_what_does_not_fit(tmp_path,
                                                                        monkeypatch):
    """A sparse_store pass keeps copies of its rows on the host beside the planned step (its
    pulled rows for the undo, the last pass's written rows, the next pass's read ahead, their
    join: ~4.4 working sets at the peak, measured), none of it in the memory plan: a table
    sized to the plan was killed mid-pass. The run prints their plan at start, at most a full
    table's stored rows a copy (``OnlineRun._plan_store_memory``); without room for the read
    ahead's copies each pass reads its rows when it starts (the same model); without room for
    two it is refused, with the figures, before any pass."""

    import jax

    from jctr.online import runner
    from jctr.online.runner import OnlineRun
    from jctr.sharding.plan import PlanError
    from tests.test_epochs import leaves_equal

    model = _small_stream(tmp_path, ["20190720"], 16000, split_interval=480)
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}

    def run(name):
        lines = []
        doc = _online(tmp_path, model, tmp_path / name, end_day="20190720",
                      split_interval=480, sparse_store={"path": f"rows-{name}"})
        r = OnlineRun(doc, log=lines.append)
        return r, r.run(), lines

    roomy, passes, lines = run("roomy")
    plan = next(x for x in lines if "sparse_store memory plan" in x)
    copies, size, unit = plan.split("up to ")[1].split(" (")[0].replace(" x", "").split()
    assert copies == "5" and passes == 3
    per_copy = float(size) * units[unit]
    ahead = []
    real = OnlineRun._pull_ahead
    monkeypatch.setattr(OnlineRun, "_pull_ahead", lambda self, *a: ahead.append(1) or
                        real(self, *a))
    monkeypatch.setattr(runner, "room_left", lambda reserve=0: int(3.5 * per_copy))
    tight, passes, lines = run("tight")
    assert passes == 3 and not ahead
    assert any("no room to read a pass's rows ahead" in x for x in lines)
    assert any("sparse_store memory plan: a pass's rows beside the tables, up to 2 x" in x
               for x in lines)
    a, b = (jax.tree.map(np.asarray, r.trainer.state.params) for r in (roomy, tight))
    assert leaves_equal(a, b)
    monkeypatch.setattr(runner, "room_left", lambda reserve=0: int(per_copy))
    with pytest.raises(PlanError, match=r"sparse_store: a pass's rows need up to 2 x .* of "
                                        r"host memory beside the training step, and .* are "
                                        r"to spare: lower the tables' "
                                        r"max_vocabulary_size_per_gpu"):
        run("refused")
    assert not (tmp_path / "refused" / "20190720").exists()  # no pass began


def test_a_streaming_run_reports_at_most_every_ten_minutes_into_one_event_file(
        tmp_path, monkeypatch):
    """Every fit wrote report.html from the whole ``metrics.jsonl`` (3.8 s for a 30-day log)
    and closed its TensorBoard event file: a streaming run, one fit a pass for months, paid
    that each pass and left a file a pass. Its report now comes at most every
    ``REPORT_EVERY_S`` (600 s), at each day's end and at the run's end, and one event file
    takes every pass."""
    import json

    from jctr.online.runner import OnlineRun
    from jctr.train import run_log

    model = _stream(tmp_path, days=("20190720", "20190721"))
    cfg = json.loads(model.read_text())
    cfg["solver"].update(log_dir=str(tmp_path / "logs"), display=1)
    model.write_text(json.dumps(cfg))
    for folder in sorted((tmp_path / "stream").glob("*/*")):
        (folder / "DONE").touch()
    reports = []
    real = run_log.write_report

    def counted(log_dir):
        reports.append(sum(1 for _ in open(tmp_path / "logs" / "metrics.jsonl")))
        return real(log_dir)

    monkeypatch.setattr(run_log, "write_report", counted)
    run = OnlineRun(_online(tmp_path, model, tmp_path / "save", end_day="20190721"),
                    log=lambda s: None)
    assert run.run() == 4
    lines = sum(1 for _ in open(tmp_path / "logs" / "metrics.jsonl"))
    # the first pass's and each day's end (four fits); nothing came after the last
    assert len(reports) == 3 and reports[-1] == lines, (reports, lines)
    assert (tmp_path / "logs" / "report.html").is_file()
    assert len(os.listdir(tmp_path / "logs" / "tensorboard")) == 1


def test_a_streaming_run_keeps_one_pass_of_log_records_in_memory(tmp_path):
    """The trainer's log kept every record in memory (``Trainer.history``): a streaming run,
    one fit a pass with a record a display, gathers millions over months. Each pass now
    starts with the log's memory empty (``RunLog.forget``); ``metrics.jsonl`` holds every
    pass's records."""
    import json

    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path, days=("20190720",))
    cfg = json.loads(model.read_text())
    cfg["solver"].update(log_dir=str(tmp_path / "logs"), display=1)
    model.write_text(json.dumps(cfg))
    for folder in sorted((tmp_path / "stream").glob("*/*")):
        (folder / "DONE").touch()
    run = OnlineRun(_online(tmp_path, model, tmp_path / "save", end_day="20190720"),
                    log=lambda s: None)
    assert run.run() == 2
    kinds = [h["kind"] for h in run.trainer.history]
    assert kinds.count("start") == 1 and kinds.count("train") >= 2  # the last pass's
    logged = [json.loads(x)["kind"] for x in open(tmp_path / "logs" / "metrics.jsonl")]
    assert logged.count("start") == 2 and logged.count("train") >= 2 * kinds.count("train")
