import numpy as np
import pytest

from jctr.train.metrics import auc, log_loss


def _brute_auc(y, s):
    pos, neg = s[y == 1], s[y == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


def test_auc_matches_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(5):
        y = (rng.random(300) < 0.3).astype(np.float32)
        s = np.round(rng.random(300) + 0.3 * y, 1)  # many ties
        assert abs(auc(y, s) - _brute_auc(y, s)) < 1e-12


def test_auc_edge_cases():
    assert auc(np.array([0, 1]), np.array([0.2, 0.8])) == 1.0
    assert auc(np.array([0, 1]), np.array([0.8, 0.2])) == 0.0
    assert auc(np.array([0, 1, 0, 1]), np.full(4, 0.5)) == 0.5
    assert np.isnan(auc(np.ones(3), np.ones(3)))


def test_log_loss():
    y = np.array([1.0, 0.0])
    p = np.array([0.9, 0.2])
    assert abs(log_loss(y, p) - (-(np.log(0.9) + np.log(0.8)) / 2)) < 1e-12


def test_bucket_auc_is_the_exact_auc_of_bucketed_predictions():
    from jctr.train.metrics import bucket_auc

    rng = np.random.default_rng(1)
    y = (rng.random(5000) < 0.2).astype(np.float32)
    p = np.clip(rng.random(5000) * 0.7 + 0.3 * y, 0, 1)
    n = 64
    idx = np.minimum((p * n).astype(int), n - 1)
    counts = np.stack([np.bincount(idx[y == 0], minlength=n), np.bincount(idx[y == 1],
                                                                          minlength=n)])
    assert abs(bucket_auc(counts) - auc(y, idx)) < 1e-12
    # two processes' counts add up to the AUC of all their samples
    half = np.stack([np.bincount(idx[:2500][y[:2500] == c], minlength=n) for c in (0, 1)])
    assert abs(bucket_auc(half + (counts - half)) - bucket_auc(counts)) < 1e-15
    assert abs(bucket_auc(counts) - auc(y, p)) < 2e-3  # fine buckets: close to the exact one
    assert bucket_auc(np.array([[1, 0], [0, 1]])) == 1.0
    assert np.isnan(bucket_auc(np.array([[0, 0], [2, 1]])))


def test_trainer_counts_training_predictions_per_bucket(tmp_path):
    """With a learning rate of almost 0 the model stands still: the counts the train steps
    summed on the device equal the buckets of the trainer's own predictions of the same
    batches afterwards (their keys inserted by the training)."""
    from jctr.config import parse_config
    from jctr.train.hooks import PredictionCounts
    from jctr.train.trainer import Trainer
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, "dlrm", max_iter=3, display=1000, eval_interval=10_000,
                      batchsize=128)
    cfg["optimizer"] = {"type": "SGD", "sgd_hparam": {"learning_rate": 1e-30}}
    for layer in cfg["layers"][1:]:
        layer.pop("optimizer", None)
    counts = PredictionCounts(32)
    t = Trainer(parse_config(cfg), log=lambda s: None, hooks=[counts])
    t.fit(3)
    got = counts.take()
    batches = list(t.data.train.batches(128, epochs=1))[:3]
    preds = [t.predict(b) for b in batches]
    y = np.concatenate([b.label[b.mask, 0] for b in batches])
    p = np.concatenate([x.reshape(x.shape[0], -1)[:, 0] for x in preds])
    idx = np.minimum((p * 32).astype(int), 31)
    want = np.stack([np.bincount(idx[y < 0.5], minlength=32),
                     np.bincount(idx[y > 0.5], minlength=32)])
    np.testing.assert_array_equal(got, want)
    assert counts.take().sum() == 0  # taken: they start again


def test_eval_tally_equals_the_joined_arrays_auc_and_loss():
    """``EvalTally`` (an evaluation's metrics from batches, each sample one uint64 sorted in
    place: ``jctr.ops.host_metrics``) gives the AUC of the joined float32 scores exactly,
    ties (and -0.0 against +0.0) shared, and their log loss; one class: NaN."""
    from jctr.train.metrics import EvalTally

    rng = np.random.default_rng(3)
    for n, batches in ((7, 1), (3000, 5), (200_000, 13)):
        y = (rng.random(n) < 0.3).astype(np.float32)
        s = np.round(rng.random(n) * 0.8 + 0.2 * y, 2).astype(np.float32)  # many ties
        s[: n // 7] = -0.0 if n < 10 else s[: n // 7]
        s[n // 7: 2 * (n // 7)] = 0.0
        tally = EvalTally()
        for part in np.array_split(np.arange(n), batches):
            tally.add(y[part], s[part])
        assert tally.count == n
        assert tally.auc() == auc(y, s)
        if n < 5000:
            assert abs(tally.auc() - _brute_auc(y, s)) < 1e-12
        assert tally.log_loss() == pytest.approx(log_loss(y, s), rel=1e-12)
        assert tally.auc() == auc(y, s)  # asked twice: the same
    one = EvalTally()
    one.add(np.ones(4), np.float32([0.1, 0.2, 0.3, 0.4]))
    assert np.isnan(one.auc())
