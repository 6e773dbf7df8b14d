"""Data: the Batch type, the Norm format, synthetic power-law data, batching and prefetch."""

from jctr.data.batch import Batch
from jctr.data.dataset import Dataset
from jctr.data.loader import NormDataset, Prefetcher, build_batch, open_dataset
from jctr.data.norm import read_norm_file, write_norm_file
from jctr.data.records import DataError, RecordBlock

__all__ = [
    "Batch", "DataError", "Dataset", "NormDataset", "Prefetcher", "RecordBlock", "build_batch",
    "open_dataset", "read_norm_file", "write_norm_file",
]
