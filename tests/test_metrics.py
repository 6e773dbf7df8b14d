import numpy as np

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
