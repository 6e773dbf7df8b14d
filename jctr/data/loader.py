"""Opening a dataset: the reader for each format of the Data layer (Norm's here: per file the
fixed-size record path or the compiled variable-length one), and the prefetch thread.

Example::

    ds = open_dataset(cfg.data.source, cfg.data, cfg.solver.input_key_type)
    for batch in Prefetcher(ds.batches(1024, epochs=1)):
        ...
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator

from jctr.config.schema import DataConfig
from jctr.data.dataset import LABEL_RULES, Dataset, ReaderPosition, build_batch
from jctr.data.feature_spec import FeatureSpecDataset
from jctr.data.fixed import open_norm_records
from jctr.data.parquet import ParquetDataset
from jctr.data.raw import RawDataset
from jctr.data.records import DataError, RecordBlock, read_file_list
from jctr.data.varlen import open_varlen_records

__all__ = ["LABEL_RULES", "Dataset", "NormDataset", "Prefetcher", "ReaderPosition",
           "build_batch", "open_dataset"]


class NormDataset(Dataset):
    """Batches from a Norm file list; a unit is a file.

    Example::

        ds = NormDataset("data/train/_file_list.txt", cfg.data, key_type="I64")
        for batch in ds.batches(1024, epochs=1):
            ...
    """

    def __init__(self, file_list: str, data: DataConfig, key_type: str = "I32", **kw):
        super().__init__(data, **kw)
        self.file_list = file_list
        self.files = read_file_list(file_list)
        if not self.files:
            raise DataError(f"{file_list}: the file list names no data file")
        self.key_type = key_type

    def num_units(self) -> int:
        return len(self.files)

    def unit_name(self, index: int) -> str:
        return self.files[index]

    def _read_unit(self, index: int) -> RecordBlock:
        d = self.data
        kw = dict(label_dim=d.label_dim, dense_dim=d.dense_dim, slot_num=d.total_slots,
                  key_type=self.key_type, check=d.check)
        return (open_norm_records(self.files[index], **kw)
                or open_varlen_records(self.files[index], **kw))


def open_dataset(path: str, data: DataConfig, key_type: str, *, eval: bool = False,
                 seed: int | None = None, process_index: int = 0,
                 process_count: int = 1, labels: str | None = None) -> Dataset:
    """The reader for the Data layer's format. ``eval`` picks Raw's ``eval_num_samples`` and the
    feature specification's ``test`` mapping; ``labels`` (a key of :data:`LABEL_RULES`) is what
    the loss accepts."""
    kw = dict(seed=seed, process_index=process_index, process_count=process_count,
              labels=labels)
    if not os.path.exists(path):
        hint = " (add a \"synthetic\" clause to the Data layer to generate it)" \
            if data.synthetic is None else ""
        raise DataError(f"{path}: does not exist{hint}")
    if data.format == "Raw":
        n = data.eval_num_samples if eval else data.num_samples
        return RawDataset(path, data, n, **kw)
    if data.format == "Parquet":
        return ParquetDataset(path, data, **kw)
    if data.format == "FeatureSpec":
        return FeatureSpecDataset(path, "test" if eval else "train", data, **kw)
    return NormDataset(path, data, key_type, **kw)


class Prefetcher:
    """Runs an iterator on a background thread, ``depth`` items ahead, applying ``transform``
    (e.g. ``jax.device_put``) there too. Errors surface on the consumer side."""

    _END = object()

    def __init__(self, it: Iterator, depth: int = 2, transform=None):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._transform = transform or (lambda x: x)
        self._thread = threading.Thread(target=self._run, args=(it,), daemon=True)
        self._thread.start()

    def _run(self, it):
        try:
            for item in it:
                item = self._transform(item)
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._q.put(self._END)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            self._q.put(e)

    def __iter__(self):
        return self

    def __next__(self):
        item = self._q.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self, timeout: float = 30.0):
        """Stop the thread and wait for it: a thread left inside XLA or numba while the
        interpreter shuts down aborts the process."""
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._q.get_nowait()  # unblock a put
            self._thread.join(0.05)
            timeout -= 0.05
            if timeout <= 0:
                break
