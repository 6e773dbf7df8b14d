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

    # per sparse input (a table reads input ``i`` with ``slot_num`` slots): host batches only
    def key_mask(self, i: int, slot_num: int) -> np.ndarray:
        """Which of sparse input ``i``'s key positions hold a key (not padding)."""
        return np.asarray(self.segments[i]) < self.label.shape[0] * slot_num

    def valid_keys(self, i: int, slot_num: int) -> np.ndarray:
        """Sparse input ``i``'s keys, padding positions left out (duplicates kept)."""
        return np.asarray(self.keys[i])[self.key_mask(i, slot_num)]

    def sample_keys(self, i: int, slot_num: int) -> tuple[np.ndarray, np.ndarray]:
        """Sparse input ``i``'s keys of real samples (``mask``) and each one's sample."""
        valid = self.key_mask(i, slot_num)
        sample = np.asarray(self.segments[i])[valid] // slot_num
        real = np.asarray(self.mask)[sample]
        return np.asarray(self.keys[i])[valid][real], sample[real]


def batch_bytes(data: DataConfig, batch_size: int) -> int:
    """Bytes of one host :class:`Batch` of ``batch_size`` samples."""
    keys = sum(sp.key_positions for sp in data.sparse)
    return batch_size * (4 * (data.label_dim + data.dense_dim) + 12 * keys + 1)


class BatchError(UserError, ValueError):
    """A batch handed to ``predict`` (or a step) that does not match the config's inputs."""


def nonfinite_dense(dense: np.ndarray) -> str | None:
    """What is wrong with [n, dense_dim] features holding NaN or infinity (None if nothing):
    served models refuse them, whichever way they come."""
    bad = np.argwhere(~np.isfinite(dense))
    if not bad.size:
        return None
    r, c = (int(x) for x in bad[0])
    return (f"{bad.shape[0]} non-finite value(s) (NaN or infinity), the first at sample {r}, "
            f"feature {c} ({dense[r, c]}); dense features must be finite")


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
        width = sp.key_positions
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


def batch_from_features(data: DataConfig, dense, sparse, *, label=None,
                        batch_size: int | None = None) -> Batch:
    """A :class:`Batch` from raw features, padded to ``batch_size`` samples (default: as many
    as given).

    ``dense`` is ``[n, dense_dim]``; ``sparse`` holds one entry per sparse input of the Data
    layer: an integer array ``[n, slot_num]`` (one key per slot), or a pair ``(keys,
    row_offsets)`` in CSR form, where the keys of sample ``s``, slot ``j`` are
    ``keys[row_offsets[s * slot_num + j]:row_offsets[s * slot_num + j + 1]]``
    (``row_offsets`` has ``n * slot_num + 1`` entries). ``label`` defaults to zeros.

    Example::

        batch = batch_from_features(cfg.data, dense=np.zeros((2, 13), np.float32),
                                    sparse=[np.array([[1, 2, 3], [4, 5, 6]])])
    """
    dense = np.asarray(dense)
    if dense.ndim != 2 or dense.shape[1] != data.dense_dim:
        raise BatchError(f"dense: expected shape [samples, {data.dense_dim}], got "
                         f"{list(dense.shape)}")
    if dense.dtype.kind not in "fiu":
        raise BatchError(f"dense: expected numbers, got dtype {dense.dtype}")
    n = dense.shape[0]
    b = n if batch_size is None else batch_size
    if n > b:
        raise BatchError(f"dense: {n} samples do not fit a batch of {b}")
    if len(sparse) != len(data.sparse):
        raise BatchError(f"sparse: expected {len(data.sparse)} input(s) "
                         f"({', '.join(s.top for s in data.sparse)}), got {len(sparse)}")
    keys_out, segs_out = [], []
    for sp, given in zip(data.sparse, sparse):
        k, s = _sparse_input(sp, given, n, b)
        keys_out.append(k)
        segs_out.append(s)
    lab = np.zeros((b, data.label_dim), np.float32)
    if label is not None:
        lab[:n] = np.asarray(label, np.float32).reshape(n, data.label_dim)
    dn = np.zeros((b, data.dense_dim), np.float32)
    dn[:n] = dense
    mask = np.zeros(b, bool)
    mask[:n] = True
    return Batch(lab, dn, tuple(keys_out), tuple(segs_out), mask)


def _sparse_input(sp, given, n: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    slots = sp.slot_num
    width = sp.key_positions
    if isinstance(given, tuple):
        keys, offsets = (np.asarray(x) for x in given)
        if keys.ndim != 1 or keys.dtype.kind not in "iu":
            raise BatchError(f"{sp.top} keys: expected a flat integer array, got shape "
                             f"{list(keys.shape)} of {keys.dtype}")
        if offsets.shape != (n * slots + 1,) or offsets.dtype.kind not in "iu":
            raise BatchError(f"{sp.top} row offsets: expected {n * slots + 1} integers "
                             f"(samples x slot_num + 1), got shape {list(offsets.shape)} of "
                             f"{offsets.dtype}")
        offsets = offsets.astype(np.int64)
        counts = np.diff(offsets)
        if offsets[0] != 0 or offsets[-1] != keys.size or (counts < 0).any():
            raise BatchError(f"{sp.top} row offsets: expected non-decreasing offsets from 0 to "
                             f"the key count {keys.size}")
    else:
        keys = np.asarray(given)
        if keys.shape != (n, slots) or keys.dtype.kind not in "iu":
            raise BatchError(f"{sp.top}: expected integer keys of shape [{n}, {slots}] (one per "
                             f"slot) or (keys, row_offsets), got shape {list(keys.shape)} of "
                             f"{keys.dtype}")
        keys = keys.reshape(-1)
        counts = np.ones(n * slots, np.int64)
        offsets = np.arange(n * slots + 1)
    keys = keys.astype(np.int64, copy=False)
    segment = np.repeat(np.arange(n * slots, dtype=np.int64), counts)
    out_keys = np.zeros(b * width, np.int64)
    out_segs = np.full(b * width, b * slots, np.int32)
    if sp.one_hot:
        if (counts > 1).any():
            raise BatchError(f"{sp.top}: one-hot input takes at most one key per slot; slot "
                             f"{int(np.argmax(counts > 1)) % slots} of sample "
                             f"{int(np.argmax(counts > 1)) // slots} has "
                             f"{int(counts.max())}")
        pos = segment
    else:
        per_sample = counts.reshape(n, slots).sum(1)
        if (per_sample > width).any():
            s = int(np.argmax(per_sample > width))
            raise BatchError(f"{sp.top}: sample {s} has {int(per_sample[s])} keys; "
                             f"max_feature_num_per_sample is {width}")
        sample = segment // slots
        pos = sample * width + (np.arange(keys.size) - offsets[sample * slots])
    out_keys[pos] = keys
    out_segs[pos] = segment
    return out_keys, out_segs
