"""The data sets of a run, opened as the Data layer says: the training set (this process's share,
shuffled), the validation set and the named test sets (whole, in order), and the padding a
multi-process run needs so that every process steps the same number of times per epoch.

Example::

    data = RunData(cfg)
    data.train.batches_with_position(512, epochs=1)
    data.eval                            # the Data layer's eval_source
    other = open_training_set(cfg, "data/day2/_file_list.txt")   # read like the training set
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import numpy as np

from jctr.config import ModelConfig
from jctr.config.schema import DataConfig
from jctr.data.batch import Batch
from jctr.data.dataset import Dataset
from jctr.data.loader import ReaderPosition, open_dataset
from jctr.data.records import DataError
from jctr.runtime.host_memory import room_left
from jctr.sharding.plan import format_bytes


def _label_rule(cfg: ModelConfig) -> str:
    return "class" if cfg.loss.type == "CrossEntropyLoss" else "probability"


def open_training_set(cfg: ModelConfig, source: str) -> Dataset:
    """``source`` opened as the training set is: this process's share, shuffled as the Data
    layer says (streaming training reads each pass with it, ahead of time)."""
    return open_dataset(source, cfg.data, cfg.solver.input_key_type,
                        seed=cfg.solver.seed if cfg.data.shuffle else None,
                        process_index=jax.process_index(), process_count=jax.process_count(),
                        labels=_label_rule(cfg))


def open_eval_set(cfg: ModelConfig, source: str) -> Dataset:
    """``source`` read like the Data layer's eval_source (whole, in order)."""
    return open_dataset(source, cfg.data, cfg.solver.input_key_type, eval=True,
                        labels=_label_rule(cfg))


class RunData:
    """The run's data sets, each opened when first used."""

    def __init__(self, cfg: ModelConfig, *, cache_reserve: int = 0,
                 report: Callable[[str], None] | None = None):
        self.cfg = cfg
        # what a cached evaluation set leaves room for (the steps' peak, MemoryPlan.transient)
        self.cache_reserve = cache_reserve
        self._report = report
        self._train: Dataset | None = None
        self._eval: Dataset | None = None
        self._tests: dict[str, Dataset] = {}
        self.train_records: int | None = 0  # one epoch of this process's training data

    @property
    def train(self) -> Dataset:
        if self._train is None:
            self._train = open_training_set(self.cfg, self.cfg.data.source)
        return self._train

    def use_training_set(self, data: Dataset) -> None:
        """Train on ``data`` from now on (streaming training: each pass its own files)."""
        self._train = data

    @property
    def eval(self) -> Dataset:
        if self._eval is None:
            self._eval = open_eval_set(self.cfg, self.cfg.data.eval_source)
            if self.cfg.data.cache_eval_data:  # keep the parsed evaluation set in memory
                kept = self._eval.cache_all(self.cache_reserve)
                units = len(self._eval.host_units())
                if kept < units and self._report is not None:
                    self._report(f"[jctr] cache_eval_data: {units - kept} of {units} "
                                 f"evaluation file(s) do not fit in memory beside the run: "
                                 "read from disk at each evaluation")
        return self._eval

    def test(self, name: str) -> Dataset:
        """The Data layer's test set ``name`` (``test_source``)."""
        if name not in self._tests:
            self._tests[name] = open_eval_set(self.cfg, dict(self.cfg.data.test_sources)[name])
        return self._tests[name]

    def reads(self, epochs: int | None, start: ReaderPosition | None
              ) -> Iterator[tuple[Batch, ReaderPosition]]:
        """The training reads of one fit, (batch, position) from ``start``: ``epochs`` of
        them, or endless; evaluating after each epoch, epochs end on a (padded) batch of
        their own. Every process the same count per epoch (:func:`even_epochs`)."""
        s = self.cfg.solver
        reader_epochs = epochs or (1 << 40 if s.eval_every_epoch else None)
        local_batch = s.batchsize // jax.process_count()
        reads = self.train.batches_with_position(local_batch, epochs=reader_epochs, start=start)
        if jax.process_count() > 1 and reader_epochs is not None:
            reads = even_epochs(reads, local_batch, self.train_records, start, self.cfg.data)
        return reads

    def last_iteration(self, epochs: int) -> int | None:
        """Iterations in ``epochs`` of the training set (each epoch ends on a padded batch of
        its own), once :meth:`check` counted it; None where the reader cannot tell."""
        local_batch = self.cfg.solver.batchsize // jax.process_count()
        return epochs * -(-self.train_records // local_batch) if self.train_records else None

    def check(self) -> None:
        """Every file's header, before training (raises :class:`jctr.data.records.DataError`)."""
        self.train_records = self.train.check_units()
        need, unit = self.train.shuffle_need
        room = room_left(self.cache_reserve) if need else None
        if room is not None and need > room:
            raise DataError(f"{unit}: shuffling it (the Data layer's shuffle) holds its records "
                            f"and their permuted copy, {format_bytes(need)}, in memory, and "
                            f"{format_bytes(max(room, 0))} are to spare beside the training "
                            "step: split it into smaller files, or set shuffle to false")
        self.eval.check_units()
        for name, _ in self.cfg.data.test_sources:
            self.test(name).check_units()


def even_epochs(reads: Iterator[tuple[Batch, ReaderPosition]], local_batch: int,
                train_records: int, start: ReaderPosition | None, data: DataConfig
                ) -> Iterator[tuple[Batch, ReaderPosition]]:
    """Every process the same number of steps per epoch (the processes step together): one
    whose share of the files is smaller ends each epoch with batches of padding only. An
    epoch entered part way (a resumed run) is not padded."""
    from jax.experimental import multihost_utils

    mine = -(-train_records // local_batch)  # this process's batches per epoch
    most = int(np.max(multihost_utils.process_allgather(np.array([mine], np.int64))))
    counting = start is None or (start.file_index == 0 and start.record == 0)
    count, empty = 0, None
    for batch, position in reads:
        yield batch, position
        count += 1
        if empty is None:
            empty = padding_batch(batch, data)
        if position.file_index == 0 and position.record == 0:  # the epoch ended here
            while counting and count < most:
                yield empty, position
                count += 1
            count, counting = 0, True


def padding_batch(like: Batch, data: DataConfig) -> Batch:
    """A batch shaped like ``like`` with no sample in it (every key is padding)."""
    b = like.label.shape[0]
    return Batch(np.zeros_like(like.label), np.zeros_like(like.dense),
                 tuple(np.zeros_like(k) for k in like.keys),
                 tuple(np.full_like(seg, b * sp.slot_num)
                       for seg, sp in zip(like.segments, data.sparse)),
                 np.zeros_like(like.mask))
