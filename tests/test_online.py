"""Streaming training parts: the time-sliced data schedule (passes of folders, done-files,
per-process shares) and the per-key show/click statistics (score, admission, shrink, base and
delta filters), each against a hand-computed case."""

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


def test_score_admission_and_shrink_by_hand():
    stats = FeatureStats()
    # four occurrences: key 1 twice (one click), keys 2 and 3 once each (no click)
    stats.observe(np.array([1, 2, 1, 3]), show=1.0, click=np.array([1, 0, 0, 0]))
    found, score = stats.lookup(np.array([1, 2, 3, 9]))
    # score = click_coeff * click + nonclk_coeff * (show - click): 1 * 1 + 0.1 * (2 - 1)
    assert found.tolist() == [True, True, True, False]
    np.testing.assert_allclose(score, [1.1, 0.1, 0.1, 0.0])
    assert stats.admitted(embedx_threshold=0.5).tolist() == [1]
    assert stats.admitted(embedx_threshold=0).tolist() == [1, 2, 3]
    # decay 0.5: scores 0.55, 0.05, 0.05; delete below 0.06 -> keys 2 and 3 go
    deleted = stats.shrink(ShrinkRule(show_click_decay_rate=0.5, delete_threshold=0.06))
    assert deleted.tolist() == [2, 3] and stats.keys.tolist() == [1]
    np.testing.assert_allclose((stats.show, stats.click), ([1.0], [0.5]))
    assert stats.unseen_days.tolist() == [1]
    # other coefficients
    other = FeatureStats(ScoreRule(nonclk_coeff=0.5, click_coeff=2.0))
    other.observe(np.array([7, 7, 7]), show=1.0, click=np.array([1, 0, 0]))
    np.testing.assert_allclose(other.scores(), [2.0 * 1 + 0.5 * 2])


def test_unseen_keys_are_deleted_after_the_configured_days():
    stats = FeatureStats()
    rule = ShrinkRule(delete_after_unseen_days=2)
    stats.observe(np.array([1, 4]), show=1.0, click=0.0)  # day 1: keys 1 and 4
    assert stats.shrink(rule).tolist() == []  # unseen 1 day
    stats.observe(np.array([4]), show=1.0, click=0.0)  # day 2: key 4 only
    assert stats.shrink(rule).tolist() == []  # key 1 unseen 2 days: kept (not more than 2)
    stats.observe(np.array([4]), show=1.0, click=0.0)  # day 3
    assert stats.shrink(rule).tolist() == [1]  # 3 days > 2
    assert stats.keys.tolist() == [4] and stats.unseen_days.tolist() == [1]


def test_base_and_delta_filters_by_hand():
    stats = FeatureStats()
    stats.observe(np.array([1, 5, 5, 8]), show=1.0, click=np.array([1, 1, 0, 0]))
    # scores: key 1 -> 1.0, key 5 -> 1 + 0.1 = 1.1, key 8 -> 0.1
    assert stats.base_keys(base_threshold=1.0).tolist() == [1, 5]
    assert stats.delta_keys(delta_threshold=0.0, delta_keep_days=16).tolist() == [1, 5, 8]
    stats.observe(np.array([5, 8]), show=1.0, click=0.0)  # only 5 and 8 since that delta
    assert stats.delta_keys(delta_threshold=0.15, delta_keep_days=16).tolist() == [5, 8]
    assert stats.delta_keys(0.0, 16).tolist() == []  # nothing seen since
    stats.observe(np.array([8]), show=1.0, click=0.0)
    stats.shrink(ShrinkRule())
    stats.shrink(ShrinkRule())  # key 8 seen, then two days pass before the next delta
    assert stats.delta_keys(0.0, delta_keep_days=1).tolist() == []
    assert stats.base_keys(0.0).tolist() == [1, 5, 8]


def test_statistics_round_trip_and_bulk_merge():
    rng = np.random.default_rng(0)
    stats = FeatureStats()
    keys = rng.zipf(1.2, 200_000).astype(np.int64)
    clicks = rng.random(keys.size) < 0.1
    for part in np.array_split(np.arange(keys.size), 7):
        stats.observe(keys[part], show=1.0, click=clicks[part])
    uniq, counts = np.unique(keys, return_counts=True)
    assert len(stats) == uniq.size
    np.testing.assert_array_equal(stats.keys, uniq)
    np.testing.assert_array_equal(stats.show, counts)
    np.testing.assert_array_equal(stats.click, np.bincount(np.searchsorted(uniq, keys),
                                                           clicks, uniq.size))
    copy = FeatureStats()
    copy.load_state_dict(stats.state_dict())
    for name, value in stats.state_dict().items():
        np.testing.assert_array_equal(getattr(copy, name), value)
    bad = dict(stats.state_dict(), keys=stats.keys[::-1].copy())
    with pytest.raises(ValueError, match="keys are not sorted and distinct"):
        copy.load_state_dict(bad)
