"""Per-key show/click statistics of streaming training and the decisions made from them
(PaddlePaddle's ``SparseAccessor`` semantics, with its parameter names and defaults):

* ``score = click_coeff * click + nonclk_coeff * (show - click)``: clicks, plus a smaller
  weight for impressions that were not clicked. (The seed document prints the difference as
  ``click - show``; PaddlePaddle's accessor computes ``show - click``, which is what the names
  mean, and so does jctr.)
* every push (a key's occurrences in a batch) adds its shows and clicks, adds their score to
  the key's ``delta_score`` and sets ``unseen_days`` to 0 (``CtrCommonAccessor::Update``);
* shrink (at the end of each day): show and click decay by ``show_click_decay_rate``, then keys
  whose score is below ``delete_threshold``, or unseen for more than
  ``delete_after_unseen_days`` days, go (``CtrCommonAccessor::Shrink``); every key ages a day
  only after that, when the day's batch model is saved (:meth:`FeatureStats.age`; Paddle's
  ``UpdateStatAfterSave`` with param 3);
* saves (``CtrCommonAccessor::Save``): the base model keeps keys whose score is at least
  ``base_threshold`` and that were seen within ``delta_keep_days`` days (param 2); a delta
  model keeps those whose ``delta_score`` (the score of the shows and clicks since the key was
  last saved) is also at least ``delta_threshold`` (param 1). Each save sets the saved keys'
  ``delta_score`` back to 0. jctr's delta also leaves out keys not pushed since they were last
  saved (Paddle's keeps them when ``delta_threshold`` is 0): their rows did not change, so the
  serving side holds them already, and a delta of unchanged rows would be as large as a base.

The statistics live on the host, keyed by key (sorted int64 arrays), independent of where a
key's row sits in a device table; batches are merged in bulk (:meth:`FeatureStats.flush`),
vectorized, never a Python loop per key. (Admission, ``embedx_threshold``, is decided by the
table itself as it trains: :func:`jctr.embedding.row_optimizers.admits`.)

Example::

    stats = FeatureStats()
    stats.observe(keys, show=np.ones(n), click=labels)   # per key occurrence
    stats.flush()
    deleted = stats.shrink(ShrinkRule())                  # the end of a day
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ScoreRule:
    nonclk_coeff: float = 0.1
    """Weight of an impression that was not clicked."""
    click_coeff: float = 1.0
    """Weight of a click."""

    def score(self, show: np.ndarray, click: np.ndarray) -> np.ndarray:
        return self.click_coeff * click + self.nonclk_coeff * (show - click)


@dataclass(frozen=True)
class ShrinkRule:
    show_click_decay_rate: float = 1.0
    """Show and click are multiplied by this at each shrink (in [0, 1])."""
    delete_threshold: float = 0.0
    """Keys whose score (after the decay) is below this are deleted."""
    delete_after_unseen_days: int = 30
    """Keys unseen for more than this many days are deleted."""

    def __post_init__(self):
        if not 0.0 <= self.show_click_decay_rate <= 1.0:
            raise ValueError(f"show_click_decay_rate: expected a number in [0, 1], got "
                             f"{self.show_click_decay_rate}")
        if self.delete_after_unseen_days < 1:
            raise ValueError("delete_after_unseen_days: expected an integer > 0, got "
                             f"{self.delete_after_unseen_days}")


class FeatureStats:
    """Show, click, unseen days, delta score and "pushed since last saved" per key (sorted
    keys)."""

    def __init__(self, score: ScoreRule | None = None):
        self.rule = score or ScoreRule()
        self.keys = np.zeros(0, np.int64)
        self.show = np.zeros(0, np.float64)
        self.click = np.zeros(0, np.float64)
        self.unseen_days = np.zeros(0, np.int32)  # whole days since the key was last seen
        self.delta_score = np.zeros(0, np.float64)  # score pushed since the key was saved
        self.since_delta = np.zeros(0, bool)  # pushed since the key was last saved
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def __len__(self) -> int:
        self.flush()
        return int(self.keys.size)

    def observe(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray) -> None:
        """Add one occurrence per entry: ``keys[i]`` was shown ``show[i]`` times and clicked
        ``click[i]`` times (a batch's keys with each sample's show and click broadcast)."""
        keys = np.asarray(keys, np.int64).reshape(-1)
        show = np.broadcast_to(np.asarray(show, np.float64).reshape(-1), keys.shape)
        click = np.broadcast_to(np.asarray(click, np.float64).reshape(-1), keys.shape)
        if keys.size:
            self._pending.append((keys, show, click))

    def flush(self) -> None:
        """Merge what :meth:`observe` collected (one sort of the new keys, one merge)."""
        self.merge(*self.take_pending())

    def take_pending(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What :meth:`observe` collected since, summed per key: ``(keys, show, click)``
        (sorted keys), no longer pending. A multi-process run gathers every process's and
        :meth:`merge` s them all, so that every process holds the same statistics."""
        if not self._pending:
            return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
        keys = np.concatenate([p[0] for p in self._pending])
        show = np.concatenate([p[1] for p in self._pending])
        click = np.concatenate([p[2] for p in self._pending])
        self._pending = []
        uniq, inverse = np.unique(keys, return_inverse=True)
        return uniq, np.bincount(inverse, show, uniq.size), np.bincount(inverse, click,
                                                                         uniq.size)

    def merge(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray) -> None:
        """Add shows and clicks of distinct ``keys`` (seen now: unseen days back to 0)."""
        if not keys.size:
            return
        pos = np.searchsorted(self.keys, keys)
        known = pos < self.keys.size
        known[known] = self.keys[pos[known]] == keys[known]
        p = pos[known]
        self.show[p] += show[known]
        self.click[p] += click[known]
        self.delta_score[p] += self.rule.score(show[known], click[known])
        self.unseen_days[p] = 0
        self.since_delta[p] = True
        new = ~known
        if new.any():
            at = pos[new]
            self.keys = np.insert(self.keys, at, keys[new])
            self.show = np.insert(self.show, at, show[new])
            self.click = np.insert(self.click, at, click[new])
            self.delta_score = np.insert(self.delta_score, at,
                                         self.rule.score(show[new], click[new]))
            self.unseen_days = np.insert(self.unseen_days, at, 0)
            self.since_delta = np.insert(self.since_delta, at, True)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found, score)`` per key (score 0 where unknown)."""
        self.flush()
        keys = np.asarray(keys, np.int64).reshape(-1)
        if not self.keys.size:
            return np.zeros(keys.size, bool), np.zeros(keys.size)
        pos = np.minimum(np.searchsorted(self.keys, keys), self.keys.size - 1)
        found = self.keys[pos] == keys
        return found, np.where(found, self.scores()[pos], 0.0)

    def scores(self) -> np.ndarray:
        self.flush()
        return self.rule.score(self.show, self.click)

    _FIELDS = ("keys", "show", "click", "unseen_days", "delta_score", "since_delta")

    def shrink(self, rule: ShrinkRule) -> np.ndarray:
        """The end of a day (Paddle's ``CtrCommonAccessor::Shrink``): show and click decay,
        and the keys the rule removes (score below ``delete_threshold``, unseen for more than
        ``delete_after_unseen_days``) are deleted; returns them (their table rows are to be
        freed). Keys age afterwards, with :meth:`age`."""
        self.flush()
        self.show *= rule.show_click_decay_rate
        self.click *= rule.show_click_decay_rate
        drop = (self.scores() < rule.delete_threshold) | \
            (self.unseen_days > rule.delete_after_unseen_days)
        deleted = self.keys[drop]
        keep = ~drop
        for name in self._FIELDS:
            setattr(self, name, getattr(self, name)[keep])
        return deleted

    def age(self) -> None:
        """The day's batch model is saved: every key is one day older (a key seen since is
        back at 0 with its next push); Paddle's ``UpdateStatAfterSave`` with param 3."""
        self.flush()
        self.unseen_days += 1

    def base_keys(self, base_threshold: float, delta_keep_days: int) -> np.ndarray:
        """Keys a base model holds (Paddle's ``Save`` with param 2): score >=
        ``base_threshold`` and unseen for at most ``delta_keep_days`` days. They count as
        saved: their delta score starts again from 0."""
        self.flush()
        take = (self.scores() >= base_threshold) & (self.unseen_days <= delta_keep_days)
        return self._saved(take)

    def delta_keys(self, base_threshold: float, delta_threshold: float,
                   delta_keep_days: int) -> np.ndarray:
        """Keys the next delta model holds (Paddle's ``Save`` with param 1): pushed since
        they were last saved, score >= ``base_threshold``, delta score >=
        ``delta_threshold``, unseen for at most ``delta_keep_days`` days. They count as
        saved."""
        self.flush()
        take = self.since_delta & (self.scores() >= base_threshold) & \
            (self.delta_score >= delta_threshold) & (self.unseen_days <= delta_keep_days)
        return self._saved(take)

    def _saved(self, take: np.ndarray) -> np.ndarray:
        self.delta_score[take] = 0.0
        self.since_delta[take] = False
        return self.keys[take]

    def state_dict(self) -> dict[str, np.ndarray]:
        """Plain arrays (for a checkpoint; no pickle)."""
        self.flush()
        return {name: getattr(self, name) for name in self._FIELDS}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """What :meth:`state_dict` gave; statistics saved before ``delta_score`` existed get
        the lifetime score of the keys pushed since their last delta as theirs."""
        n = np.asarray(state["keys"]).size
        state = dict(state)
        if "delta_score" not in state:
            since = np.asarray(state["since_delta"], bool)
            state["delta_score"] = np.where(since, self.rule.score(
                np.asarray(state["show"], np.float64), np.asarray(state["click"], np.float64)),
                0.0)
        for name, dtype in (("keys", np.int64), ("show", np.float64), ("click", np.float64),
                            ("unseen_days", np.int32), ("delta_score", np.float64),
                            ("since_delta", bool)):
            value = np.asarray(state[name], dtype)
            if value.shape != (n,):
                raise ValueError(f"feature statistics: {name} holds {value.shape}, expected "
                                 f"({n},)")
            setattr(self, name, value.copy())
        if n > 1 and not (np.diff(self.keys) > 0).all():
            raise ValueError("feature statistics: keys are not sorted and distinct")
        self._pending = []
