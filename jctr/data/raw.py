"""HugeCTR's Raw format: one binary file of fixed-size int32 records, one-hot keys.

Record layout (little endian): ``label_dim`` labels, ``dense_dim`` dense features, then one key
per slot, every field 4 bytes. Labels and dense features are int32 unless ``float_label_dense``
makes them float32; int dense features are turned into ``log(x + 1)`` (negative values count as
0). Slot ``s`` holds keys in ``[0, slot_size_array[s])``; jctr adds the slot's offset (the sum of
the earlier slot sizes) so that the slots share one hash table without collisions.
"""

from __future__ import annotations

import os

import numpy as np

from jctr.config.schema import DataConfig
from jctr.data.dataset import Dataset
from jctr.data.fixed import FixedLayout, FixedRecords
from jctr.data.records import DataError, slot_offsets
from jctr.runtime.direct_io import replacing

UNIT_RECORDS = 1 << 18


class RawDataset(Dataset):
    """Batches from a Raw file; a unit is a range of ``UNIT_RECORDS`` records."""

    def __init__(self, path: str, data: DataConfig, num_samples: int, **kw):
        super().__init__(data, **kw)
        self.path = path
        self.width = data.label_dim + data.dense_dim + data.total_slots
        if not os.path.isfile(path):
            raise DataError(f"{path}: Raw data file does not exist")
        size = os.path.getsize(path)
        rec_bytes = 4 * self.width
        layout = (f"4 x (label_dim {data.label_dim} + dense_dim {data.dense_dim} + slots "
                  f"{data.total_slots})")
        if size % rec_bytes:  # HugeCTR would read it; a partial record means another layout
            raise DataError(f"{path}: size {size} bytes is not a multiple of the record size "
                            f"{rec_bytes} ({layout})")
        # HugeCTR maps num_samples records of the file and reads those (a longer file's rest
        # is never read); a shorter file is an error here, where HugeCTR would crash
        if size < num_samples * rec_bytes:
            raise DataError(f"{path}: holds {size // rec_bytes} records of {rec_bytes} bytes "
                            f"({layout}) but the config's num_samples / eval_num_samples says "
                            f"{num_samples}")
        self.n = num_samples
        ld, dd = data.label_dim, data.dense_dim
        self.layout = FixedLayout(
            record_bytes=rec_bytes, label_at=0, label_dim=ld, dense_at=4 * ld, dense_dim=dd,
            key_at=4 * (ld + dd), key_stride=4, key_width=4, slot_num=data.total_slots,
            int_label_dense=not data.float_label_dense,
            # without slot_size_array (HugeCTR 3.x allows it) keys are global already
            slot_offsets=slot_offsets(data.slot_size_array) if data.slot_size_array else None,
            slot_sizes=np.minimum(np.asarray(data.slot_size_array, np.int64),
                                  2**32 - 1).astype(np.uint32) if data.slot_size_array else None)

    def num_units(self) -> int:
        return max(1, -(-self.n // UNIT_RECORDS))

    def unit_name(self, index: int) -> str:
        return f"{self.path} [records {index * UNIT_RECORDS}..]"

    def _read_unit(self, index: int) -> FixedRecords:
        start = index * UNIT_RECORDS
        count = min(UNIT_RECORDS, self.n - start)
        return FixedRecords(self.path, start * 4 * self.width, count, self.layout,
                            first_record=start)


def write_raw_file(path: str, label: np.ndarray, dense: np.ndarray, keys: np.ndarray, *,
                   float_label_dense: bool = False) -> None:
    """Write records; ``keys`` [n, slots] are per-slot (without offsets)."""
    if float_label_dense:
        lab = np.asarray(label, "<f4").view("<i4")
        den = np.asarray(dense, "<f4").view("<i4")
    else:
        lab = np.asarray(label).astype("<i4")
        den = np.asarray(dense).astype("<i4")
    rec = np.concatenate([lab, den, np.asarray(keys).astype("<i4")], axis=1)
    with replacing(path) as tmp:
        rec.tofile(tmp)
