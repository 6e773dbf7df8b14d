"""The Batch every reader produces and every step consumes."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
    """A fixed-shape batch (host numpy or device arrays; a pytree either way).

    Sparse input ``i`` is a flat key array of static length ``batch * max_feature_num_per_sample``
    (int64) with the segment of each key, ``sample * slot_num + slot``; padding keys carry the
    out-of-range segment ``batch * slot_num`` and are ignored (DESIGN.md decision 1). For one-hot
    inputs the key of (sample, slot) sits at position ``sample * slot_num + slot``.
    Samples past the end of the data are padding too: ``mask`` is False for them.
    """

    label: np.ndarray  # float32 [B, label_dim]
    dense: np.ndarray  # float32 [B, dense_dim]
    keys: tuple[np.ndarray, ...]  # int64 [B * max_features_i]
    segments: tuple[np.ndarray, ...]  # int32 [B * max_features_i]
    mask: np.ndarray  # bool [B]

    @property
    def batch_size(self) -> int:
        return self.label.shape[0]

    @property
    def num_valid(self) -> int:
        return int(np.sum(self.mask))
