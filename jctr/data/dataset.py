"""The reader interface and batch assembly: units (files or record ranges) in a deterministic,
optionally shuffled order, split over processes, packed into fixed-shape padded batches and
checked (finite values, labels the loss accepts). Formats subclass :class:`Dataset`.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from jctr.config.schema import DataConfig, SparseInputConfig
from jctr.data.batch import Batch
from jctr.data.fixed import FixedChunk, FixedRecords, decode_batch
from jctr.data.records import DataError, RecordBlock
from jctr.data.varlen import VarChunk, VarRecords, decode_var_batch
from jctr.runtime.host_memory import room_left


def build_batch(block: RecordBlock, batch_size: int, sparse: tuple[SparseInputConfig, ...],
                source: str = "<data>", first_record: int = 0) -> Batch:
    """Pack up to ``batch_size`` records into a Batch (missing samples are masked padding)."""
    n = len(block)
    if n > batch_size:
        raise ValueError(f"{n} records for a batch of {batch_size}")
    label = np.zeros((batch_size, block.label.shape[1]), np.float32)
    label[:n] = block.label
    dense = np.zeros((batch_size, block.dense.shape[1]), np.float32)
    dense[:n] = block.dense
    mask = np.zeros(batch_size, bool)
    mask[:n] = True
    key_start = None  # [R, slots]: index of each slot's first key, built only when needed
    keys_out, segs_out = [], []
    s0 = 0
    for sp in sparse:
        sl = slice(s0, s0 + sp.slot_num)
        s0 += sp.slot_num
        nnz = block.nnz[:, sl]
        needs_starts = not (block.nnz.shape[1] == sp.slot_num
                            and (not sp.one_hot or block.keys.size == nnz.size))
        if needs_starts and key_start is None:
            key_start = block.key_offsets()[:-1, None] + np.cumsum(block.nnz, axis=1) - block.nnz
        starts = key_start[:, sl] if needs_starts else None
        pad_seg = batch_size * sp.slot_num
        if sp.one_hot:
            if nnz.size and nnz.max() > 1:
                r, s = np.argwhere(nnz > 1)[0]
                raise DataError(f"{source}: record {first_record + r}: slot {sl.start + s} has "
                                f"{nnz[r, s]} keys but sparse input \"{sp.top}\" is one-hot "
                                "(max_nnz 1)")
            keys = np.zeros(batch_size * sp.slot_num, np.int64)
            segs = np.full(batch_size * sp.slot_num, pad_seg, np.int32)
            if block.nnz.shape[1] == sp.slot_num and block.keys.size == nnz.size:
                # every slot of every record holds its one key: already in batch order
                keys[:nnz.size] = block.keys
                segs[:nnz.size] = np.arange(nnz.size, dtype=np.int32)
            else:
                pos = np.nonzero(nnz.ravel() == 1)[0]
                keys[pos] = block.keys[starts.ravel()[pos]]
                segs[pos] = pos
        else:
            m = sp.max_feature_num_per_sample
            per_sample = nnz.sum(axis=1)
            if per_sample.size and per_sample.max() > m:
                r = int(np.argmax(per_sample > m))
                raise DataError(f"{source}: record {first_record + r}: {per_sample[r]} keys in "
                                f"sparse input \"{sp.top}\" exceed max_feature_num_per_sample {m}")
            if nnz.size and nnz.max() > sp.max_nnz:
                r, s = np.argwhere(nnz > sp.max_nnz)[0]
                raise DataError(f"{source}: record {first_record + r}: slot {sl.start + s} has "
                                f"{nnz[r, s]} keys, more than max_nnz {sp.max_nnz}")
            counts = nnz.ravel()
            total = int(per_sample.sum())
            # the segment (sample * slot_num + slot) of every key of this input, in order
            seg = np.repeat(np.arange(n * sp.slot_num, dtype=np.int32), counts)
            # key i of sample b goes to b * m + i: one repeat of each sample's shift
            sample_first = np.cumsum(per_sample) - per_sample
            pos = np.repeat(np.arange(n, dtype=np.int64) * m - sample_first, per_sample)
            pos += np.arange(total, dtype=np.int64)
            if block.nnz.shape[1] == sp.slot_num:  # the input owns every slot: keys in order
                picked = block.keys
            else:
                first = np.cumsum(counts) - counts
                key_idx = np.arange(total) + np.repeat(starts.ravel() - first, counts)
                picked = block.keys[key_idx]
            keys = np.zeros(batch_size * m, np.int64)
            segs = np.full(batch_size * m, pad_seg, np.int32)
            keys[pos] = picked
            segs[pos] = seg
        keys_out.append(keys)
        segs_out.append(segs)
    return Batch(label, dense, tuple(keys_out), tuple(segs_out), mask)


@dataclass
class ReaderPosition:
    """Where a reader stands: enough to continue exactly (checkpoints store it)."""

    epoch: int = 0
    file_index: int = 0
    record: int = 0  # records of that file already consumed

    @property
    def last_epoch(self) -> int:
        """The 0-based epoch of the last batch read (a position at an epoch's start follows
        the last batch of the epoch before: Keras counts an epoch-end evaluation so)."""
        at_start = self.epoch > 0 and self.file_index == 0 and self.record == 0
        return self.epoch - 1 if at_start else self.epoch


def _shuffle_bytes(unit) -> int:
    """The memory a unit takes while a seeded epoch permutes its records
    (:meth:`Dataset._records`): a read unit in memory and its permuted copy; a Norm file of
    variable records, its body and the permuted offsets."""
    if isinstance(unit, VarRecords):
        return unit.body_size + 8 * len(unit)
    if isinstance(unit, FixedRecords):
        return 2 * unit.n * unit.layout.record_bytes
    return 2 * sum(a.nbytes for a in (unit.label, unit.dense, unit.nnz, unit.keys))


class Dataset(abc.ABC):
    """Fixed-shape batches from a sequence of *units* (files, or record ranges of one file).

    Units are read whole, in a deterministic order: the order of the source, or with ``seed`` a
    permutation per epoch (records inside a unit are permuted too). With ``process_count > 1``
    each process takes every ``process_count``-th unit, so hosts never overlap.

    Subclasses define :meth:`num_units`, :meth:`unit_name` and :meth:`_read_unit`.
    """

    def __init__(self, data: DataConfig, *, seed: int | None = None, process_index: int = 0,
                 process_count: int = 1, labels: str | None = None):
        self.data = data
        self.seed = seed
        self.process_index = process_index
        self.process_count = process_count
        if labels not in LABEL_RULES:
            raise ValueError(f"labels: expected one of {sorted(LABEL_RULES, key=str)}")
        self.label_rule = labels  # what the loss accepts: a key of LABEL_RULES
        self._cache: dict[int, RecordBlock] = {}
        # (bytes, unit name): the largest unit's memory while shuffled, by check_units
        self.shuffle_need: tuple[int, str] = (0, "")

    @abc.abstractmethod
    def num_units(self) -> int:
        """How many units the source has (before host splitting)."""

    @abc.abstractmethod
    def unit_name(self, index: int) -> str:
        """A name for error messages (a file, or a file and its record range)."""

    @abc.abstractmethod
    def _read_unit(self, index: int) -> RecordBlock:
        """The records of one unit, validated against the config."""

    # -- shared
    def _unit(self, index: int) -> RecordBlock | FixedRecords | VarRecords:
        if index in self._cache:
            return self._cache[index]
        return self._read_unit(index)

    def read_unit(self, index: int) -> RecordBlock:
        """The records of one unit, decoded into memory."""
        unit = self._unit(index)
        if isinstance(unit, (FixedRecords, VarRecords)):
            unit = unit.load()
            if isinstance(unit, (FixedRecords, VarRecords)):
                return unit.slice(0, len(unit)).to_block()
        return unit

    def cache_all(self, reserve: int = 0) -> int:
        """Keep the units' records in memory (evaluation sets, a streaming pass), each while
        the machine has room for it beside ``reserve`` bytes (what the work under way still
        takes at its peak) and a margin (:func:`jctr.runtime.host_memory.room_left`); from
        the first unit that has none on, units are read from their files as they are needed,
        as without a cache (slower, but a pass larger than memory trains instead of the
        process being killed). Returns how many of this process's units are kept."""
        kept = 0
        for i in self.host_units():
            unit = self._read_unit(i)
            lazy = isinstance(unit, (FixedRecords, VarRecords))
            room = room_left(reserve)
            # a decoded block (Parquet, ...) holds its memory already: kept while room is left
            if room is not None and (unit.load_bytes() > room if lazy else room < 0):
                break
            self._cache[i] = unit.load() if lazy else unit
            kept += 1
        return kept

    def check_units(self) -> int:
        """Open every unit this process reads, so that a broken header or a missing file is
        found before training rather than when it is reached (records are checked as read).
        Returns the records of those units (what one epoch of this process reads); with
        shuffling, :attr:`shuffle_need` is then known."""
        records, self.shuffle_need = 0, (0, "")
        for i in self.host_units():
            unit = self._unit(i)
            records += len(unit)
            need = _shuffle_bytes(unit) if self.seed is not None else 0
            if need > self.shuffle_need[0]:
                self.shuffle_need = (need, self.unit_name(i))
        return records

    def host_units(self) -> list[int]:
        units = list(range(self.num_units()))[self.process_index::self.process_count]
        if not units:
            raise DataError(f"{self.unit_name(0)}: {self.num_units()} data unit(s) cannot be "
                            f"split over {self.process_count} processes")
        return units

    def unit_order(self, epoch: int) -> list[int]:
        units = self.host_units()
        if self.seed is None:
            return units
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(units))
        return [units[i] for i in perm]

    def _records(self, unit: int, epoch: int) -> RecordBlock | FixedRecords | VarRecords:
        block = self._unit(unit)
        if self.seed is None:
            return block
        perm = np.random.default_rng([self.seed, epoch, unit, 1]).permutation(len(block))
        return block.take(perm)  # every kind of unit permutes its records

    def num_records(self) -> int:
        return sum(len(self._unit(i)) for i in self.host_units())

    def batches(self, batch_size: int, epochs: int | None = None,
                start: ReaderPosition | None = None) -> Iterator[Batch]:
        """Fixed-size batches from ``start`` (default: the beginning). With ``epochs`` the last
        batch of each epoch is padded (masked); with ``epochs=None`` the data repeats forever
        and batches run across epoch ends."""
        for batch, _ in self.batches_with_position(batch_size, epochs, start):
            yield batch

    def batches_with_position(self, batch_size: int, epochs: int | None = None,
                              start: ReaderPosition | None = None
                              ) -> Iterator[tuple[Batch, ReaderPosition]]:
        """Like :meth:`batches`, each batch paired with the position right after it: resuming
        from that position continues with the next batch exactly (checkpoints store it).
        ``file_index`` counts units in this epoch's order."""
        pos = ReaderPosition(**vars(start)) if start is not None else ReaderPosition()
        pending: list[RecordBlock] = []
        sources: list[tuple[str, int, int]] = []  # (unit, first record, count) per piece
        pending_n = 0
        order = self.unit_order(pos.epoch)
        n_units = len(order)
        if start is not None and pos.file_index >= max(n_units, 1):
            raise DataError(f"resuming at file {pos.file_index + 1} (record {pos.record}) of "
                            f"epoch {pos.epoch + 1}, where the checkpoint's reader stopped, but "
                            f"the data source now has {n_units} file(s) for this process: "
                            "resume with the file list the checkpoint was trained on, or "
                            "train from the start")
        records_this_epoch = 0
        while epochs is None or pos.epoch < epochs:
            unit = order[pos.file_index]
            block = self._records(unit, pos.epoch)
            name = self.unit_name(unit)
            start_rec = pos.record
            if start_rec > len(block):
                raise DataError(f"{name}: resuming at record {start_rec}, where the "
                                f"checkpoint's reader stopped, but the file holds "
                                f"{len(block)} record(s) now: resume with the data the "
                                "checkpoint was trained on, or train from the start")
            records_this_epoch += len(block)
            while start_rec < len(block):
                take = min(batch_size - pending_n, len(block) - start_rec)
                pending.append(block.slice(start_rec, start_rec + take))
                sources.append((name, start_rec, take))
                pending_n += take
                start_rec += take
                pos.record = start_rec
                if pending_n == batch_size:
                    # "end of a unit" is reported as the start of the next one
                    nxt = (_advance_file(pos, n_units) if start_rec == len(block)
                           else ReaderPosition(**vars(pos)))
                    yield (self._checked(assemble_batch(pending, batch_size, self.data.sparse, name,
                                                     start_rec - take), sources), nxt)
                    pending, sources, pending_n = [], [], 0
            if isinstance(block, VarRecords):
                block.check_complete()
            new = _advance_file(pos, n_units)
            if new.epoch != pos.epoch:
                if not records_this_epoch and start is None:
                    raise DataError(f"{self.unit_name(order[0])}: the data source holds no "
                                    f"records ({n_units} unit(s) read)")
                records_this_epoch = 0
                start = None
                order = self.unit_order(new.epoch)
            pos = new
            if pos.file_index == 0 and epochs is not None and pending_n:
                yield (self._checked(assemble_batch(pending, batch_size, self.data.sparse, name),
                                     sources), ReaderPosition(**vars(pos)))
                pending, sources, pending_n = [], [], 0

    def _checked(self, batch: Batch, sources: list[tuple[str, int, int]]) -> Batch:
        """Refuse non-finite label or dense values, and labels the loss cannot take, naming the
        file, record and field (one vectorized pass per batch)."""
        n = sum(count for _, _, count in sources)
        label, dense = batch.label[:n], batch.dense[:n]
        bad_label = ~np.isfinite(label)
        rule = LABEL_RULES[self.label_rule]
        if rule is not None:
            bad_label |= ~rule[0](label)
        bad_dense = ~np.isfinite(dense)
        rows = bad_label.any(axis=1) | bad_dense.any(axis=1)
        if not rows.any():
            return batch
        row = r = int(np.argmax(rows))
        k = 0
        while r >= sources[k][2]:  # the piece of the batch the row came from
            r -= sources[k][2]
            k += 1
        name, first, _ = sources[k]
        if bad_label[row].any():
            col = int(np.argmax(bad_label[row]))
            value = float(label[row, col])
            why = "not finite" if not np.isfinite(value) else rule[1]
            field = f"label[{col}]" if label.shape[1] > 1 else "label"
        else:
            col = int(np.argmax(bad_dense[row]))
            value, why, field = float(dense[row, col]), "not finite", f"dense[{col}]"
        raise DataError(f"{name}: record {first + r}: {field} is {value} ({why})")


# what each loss accepts as labels: (test, what the error says) or None (anything finite)
LABEL_RULES = {
    None: None,
    "probability": (lambda y: (y >= 0) & (y <= 1), "labels must lie in [0, 1] for a "
                    "cross-entropy loss"),
    "class": (lambda y: (y == 0) | (y == 1), "CrossEntropyLoss takes the class 0 or 1"),
}


def assemble_batch(parts: list, batch_size: int, sparse: tuple[SparseInputConfig, ...],
                   source: str, first_record: int = 0) -> Batch:
    """The one place batches are assembled, from consecutive pieces of units: fixed-size record
    chunks of one-hot inputs and chunks of indexed variable-length records are decoded straight
    from their bytes into the batch; columnar blocks (Parquet, feature spec, the general Norm
    parser), and records that break a sparse input's limits (for the error), go through
    :func:`build_batch`, the reference the fast decoders are tested against."""
    if all(isinstance(p, FixedChunk) for p in parts) and all(sp.one_hot for sp in sparse):
        return Batch(*decode_batch(parts, batch_size, tuple(sp.slot_num for sp in sparse)))
    if all(isinstance(p, VarChunk) for p in parts):
        fields = decode_var_batch(parts, batch_size, sparse)
        if fields is not None:
            return Batch(*fields)
    blocks = [p.to_block() if isinstance(p, (FixedChunk, VarChunk)) else p for p in parts]
    return build_batch(RecordBlock.concat(blocks), batch_size, sparse, source, first_record)


def _advance_file(pos: ReaderPosition, num_files: int) -> ReaderPosition:
    nxt = ReaderPosition(pos.epoch, pos.file_index + 1, 0)
    if nxt.file_index == num_files:
        nxt = ReaderPosition(pos.epoch + 1, 0, 0)
    return nxt
