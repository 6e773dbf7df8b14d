"""Evaluation metrics on host arrays: exact AUC (ties averaged), AUC from bucketed
positive/negative counts (PaddlePaddle's ``stat_pos`` / ``stat_neg``: counts add up across
batches and processes, so the AUC of a whole pass is exact to the bucket width), and average
log loss."""

from __future__ import annotations

import numpy as np

from jctr.ops.host_metrics import pack_scores, ranked_pairs


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U with tied scores sharing ranks); NaN if one class only.

    Example::

        auc(np.array([0, 1, 1]), np.array([0.1, 0.9, 0.4]))  # 1.0
    """
    labels = np.asarray(labels).ravel() > 0.5
    scores = np.asarray(scores, np.float64).ravel()
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(s.size, np.float64)
    # average rank over runs of equal scores
    change = np.concatenate([[True], s[1:] != s[:-1]])
    run_id = np.cumsum(change) - 1
    run_start = np.nonzero(change)[0]
    run_end = np.append(run_start[1:], s.size)
    avg = (run_start + run_end - 1) / 2.0 + 1.0
    ranks[order] = avg[run_id]
    u = ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


class EvalTally:
    """The exact AUC and the log loss of predictions added batch by batch, in little memory:
    a sample is one uint64 (its float32 score and its label, :func:`jctr.ops.host_metrics.
    pack_scores`), sorted in place for the AUC; the loss is summed as batches come. Equal to
    :func:`auc` and :func:`log_loss` of the joined arrays (float32 scores); 30M samples: 8
    bytes a sample at the peak against 66, 1.7 s against 17-18 (docs/performance.md).

    Example::

        tally = EvalTally()
        tally.add(np.array([0, 1, 1]), np.array([0.1, 0.9, 0.4], np.float32))
        tally.auc(), tally.log_loss()       # 1.0, 0.3757...
    """

    def __init__(self):
        self._parts: list[np.ndarray] = []
        self._loss = 0.0
        self.count = 0

    def add(self, labels: np.ndarray, probs: np.ndarray) -> None:
        labels, probs = np.asarray(labels).ravel(), np.asarray(probs).ravel()
        self._parts.append(pack_scores(labels, probs))
        self._loss += _loss_sum(labels, probs)
        self.count += labels.size

    def auc(self) -> float:
        """NaN if one class only."""
        keys = np.concatenate(self._parts) if len(self._parts) != 1 else self._parts[0]
        self._parts = [keys]
        keys.sort()
        u2, positives = ranked_pairs(keys)
        negatives = keys.size - positives
        if positives == 0 or negatives == 0:
            return float("nan")
        return float(u2 / (2.0 * positives * negatives))

    def log_loss(self) -> float:
        return self._loss / self.count


def _loss_sum(labels: np.ndarray, probs: np.ndarray) -> float:
    p = np.clip(np.asarray(probs, np.float64).ravel(), 1e-7, 1 - 1e-7)
    y = np.asarray(labels, np.float64).ravel()
    return float(-np.sum(y * np.log(p) + (1 - y) * np.log(1 - p)))


def log_loss(labels: np.ndarray, probs: np.ndarray) -> float:
    return _loss_sum(labels, probs) / np.asarray(labels).size


def bucket_auc(counts: np.ndarray) -> float:
    """AUC from ``counts[0]`` (negatives) and ``counts[1]`` (positives) per prediction bucket
    (bucket ``i`` holds predictions in ``[i / n, (i + 1) / n)``); a bucket's samples count as
    tied. NaN if one class only.

    Example::

        bucket_auc(np.array([[1, 0], [0, 1]]))  # 1.0: the negative below the positive
    """
    neg, pos = (np.asarray(c, np.float64) for c in counts)
    n_pos, n_neg = pos.sum(), neg.sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    below = np.cumsum(neg) - neg  # negatives in lower buckets
    return float((pos * (below + 0.5 * neg)).sum() / (n_pos * n_neg))
