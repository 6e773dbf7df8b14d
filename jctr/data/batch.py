"""The Batch every reader produces and every step consumes."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jctr.config.schema import DataConfig
from jctr.errors import UserError


class Batch(NamedTuple):
    """A fixed-shape batch (host numpy or device arrays; a pytree either way).

    Sparse input ``i`` is a flat key array of static length ``batch * max_feature_num_per_sample``
    (int64) with the segment of each key, ``sample * slot_num + slot``; padding keys carry the
    out-of-range segment ``batch * slot_num`` and are ignored (static shapes: one compiled step
    for every batch). For one-hot inputs the key of (sample, slot) sits at position
    ``sample * slot_num + slot``.
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


class BatchError(UserError, ValueError):
    """A batch handed to ``predict`` (or a step) that does not match the config's inputs."""


def check_batch(batch: Batch, data: DataConfig) -> Batch:
    """``batch`` checked against the Data layer and cast to the step's dtypes; raises
    :class:`BatchError` naming the field and the shape or dtype expected.

    Integer keys of any width become int64; floating-point keys are refused (they would be
    truncated into other keys silently).

    Example::

        probs = model.predict(check_batch(batch, cfg.data))
    """
    if not isinstance(batch, Batch):
        raise BatchError(f"expected a jctr Batch (label, dense, keys, segments, mask), got "
                         f"{type(batch).__name__}")
    b = int(np.shape(batch.label)[0]) if np.ndim(batch.label) else -1

    def array(name: str, x, shape: tuple[int, ...], kind: str, dtype) -> np.ndarray:
        x = np.asarray(x)
        if x.shape != shape:
            raise BatchError(f"Batch.{name}: expected shape {shape}, got {x.shape}")
        ok = {"float": "fiub", "int": "iu", "bool": "b"}[kind]
        if x.dtype.kind not in ok:
            raise BatchError(f"Batch.{name}: expected {kind} values, got dtype {x.dtype}")
        return x.astype(dtype, copy=False)

    if b <= 0:
        raise BatchError(f"Batch.label: expected shape (batch, {data.label_dim}), got "
                         f"{np.shape(batch.label)}")
    label = array("label", batch.label, (b, data.label_dim), "float", np.float32)
    dense = array("dense", batch.dense, (b, data.dense_dim), "float", np.float32)
    mask = array("mask", batch.mask, (b,), "bool", bool)
    n = len(data.sparse)
    if len(batch.keys) != n or len(batch.segments) != n:
        raise BatchError(f"Batch.keys / Batch.segments: expected {n} sparse input(s) "
                         f"({', '.join(s.top for s in data.sparse)}), got {len(batch.keys)} and "
                         f"{len(batch.segments)}")
    keys, segs = [], []
    for i, sp in enumerate(data.sparse):
        width = sp.slot_num if sp.one_hot else sp.max_feature_num_per_sample
        keys.append(array(f"keys[{i}] ({sp.top})", batch.keys[i], (b * width,), "int",
                          np.int64))
        seg = array(f"segments[{i}] ({sp.top})", batch.segments[i], (b * width,), "int",
                    np.int32)
        if seg.size and (seg.min() < 0 or seg.max() > b * sp.slot_num):
            raise BatchError(f"Batch.segments[{i}] ({sp.top}): expected values in "
                             f"[0, {b * sp.slot_num}] (sample * slot_num + slot; the last for "
                             "padding)")
        segs.append(seg)
    return Batch(label, dense, tuple(keys), tuple(segs), mask)
