"""Embedding tables larger than memory for streaming training (HugeCTR's "model
oversubscription"): every row of a table -- its vector, optimizer state and input slot -- lives
in a RocksDB database (:class:`jctr.stores.rocksdb.RocksDBStore`, one column family per table)
or, with ``kind="row_file"``, in plain mapped files (:class:`jctr.stores.row_file.
RowFileStore`, a folder per table);
before a pass trains, the rows of the keys it will see are pulled into the (empty) device
table, and after it they are written back and the device table is emptied again. Only a pass's
working set is ever in memory.

Writing back is made undoable: the rows a pass pulled (and the keys it writes) are saved to
``<undo folder>/<day>_<pass>.npz`` first, and removed once the pass's checkpoint is complete;
a run that stops between the two puts the old rows back when it starts again, so the database
always matches the checkpoint the run resumes from.

Example::

    store = RowStore("runs/online/rows", specs, slot_shapes)
    stored = store.pull(0, keys)          # -> jctr.sharding.rows stored-table dict
    store.push(0, export_placed(table))
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from jctr.config.hps import PersistentDatabaseParams
from jctr.runtime.direct_io import DirectWriter, replacing
from jctr.stores.rocksdb import RocksDBStore


class RowStore:
    """The rows of every embedding table in one database (see the module docstring).
    ``slot_shapes`` holds, per table, each optimizer slot's shape per row (``()`` or
    ``(width,)``)."""

    def __init__(self, path: str, specs, slot_shapes: list[dict[str, tuple[int, ...]]],
                 kind: str = "rocks_db"):
        if kind == "row_file":  # plain mapped files: memory speed (jctr.stores.row_file)
            from jctr.stores.row_file import RowFileStore

            self.db = RowFileStore(path, label="sparse_store.path")
        else:
            self.db = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=path),
                                   label="sparse_store.path", bulk=True)
        self.path = path
        self.names = [f"online.{spec.name}" for spec in specs]
        # one float32 row per key: vector, then each slot (sorted by name), then the slot id
        self.layouts = []
        for spec, shapes in zip(specs, slot_shapes):
            parts = [("values", (spec.dim,))] + [(name, shapes[name]) for name in sorted(shapes)]
            parts.append(("slot", ()))
            self.layouts.append(parts)
        # a RocksDB row also holds its key (two float32 columns first): a pass over the
        # table then reads values alone (RocksDBStore.items); a database written before
        # rows held their keys (its width says so) is read and written as it is
        self.keyed = [kind != "row_file" and self.db.dim(name) in (None, self.width(i) + 2)
                      for i, name in enumerate(self.names)]

    def width(self, table: int) -> int:
        """Floats of a row's vector, optimizer slots and slot id."""
        return sum(int(np.prod(shape)) for _, shape in self.layouts[table])

    def stored_width(self, table: int) -> int:
        """Floats of a stored row: :meth:`width`, and two more for its key where it holds
        it."""
        return self.width(table) + 2 * self.keyed[table]

    def _columns(self, table: int, stored: dict[str, np.ndarray]) -> list[np.ndarray]:
        n = stored["keys"].size
        return [np.asarray(stored[name], np.float32).reshape(n, -1)
                for name, _ in self.layouts[table]]

    def _stored_columns(self, table: int, stored: dict[str, np.ndarray]) -> list[np.ndarray]:
        """A stored row's column blocks: the key's (its 8 bytes as two float32) first where
        rows hold their keys, then :meth:`_columns`."""
        columns = self._columns(table, stored)
        if self.keyed[table]:
            keys = np.ascontiguousarray(stored["keys"], "<i8")
            columns.insert(0, keys.view("<f4").reshape(keys.size, 2))
        return columns

    def _scan(self, table: int) -> dict:
        """A pass over the table's rows reads values alone where rows hold their keys
        (:meth:`jctr.stores.rocksdb.RocksDBStore.items`' ``keyed``)."""
        return {"keyed": True} if self.keyed[table] else {}

    def _unpack(self, table: int, keys: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
        out = {"keys": keys}
        at = 2 * self.keyed[table]  # (the key's columns)
        for name, shape in self.layouts[table]:
            w = int(np.prod(shape))
            part = rows[:, at:at + w].reshape((keys.size, *shape))
            out[name] = part.astype(np.int32) if name == "slot" else part
            at += w
        return out

    # keys of at least this share of the stored rows are read by one pass over the table
    SCAN_SHARE = 0.2

    def pull(self, table: int, keys: np.ndarray) -> dict[str, np.ndarray]:
        """The stored rows of those of ``keys`` the database holds (a stored-table dict).
        Many keys (a day's base model, a pass of mostly new keys) are read by scanning the
        table instead of point reads."""
        keys = np.asarray(keys, np.int64)
        name = self.names[table]
        if not keys.size:  # nothing to read: the database (and its lock) left alone
            return self._unpack(table, keys, np.zeros((0, self.stored_width(table)),
                                                      np.float32))
        many = keys.size >= self.SCAN_SHARE * self.db.estimated_rows(name) > 0
        width = self.stored_width(table)
        if many:
            rows, found = self.db.lookup_by_scan(name, keys, width, **self._scan(table))
        else:
            rows, found = self.db.lookup(name, keys, width)
        if found.all():  # e.g. a day's base model: no copy of every row
            return self._unpack(table, keys, rows)
        return self._unpack(table, keys[found], rows[found])

    def pull_except(self, table: int, held) -> dict[str, np.ndarray]:
        """Every stored row but those of ``held``'s keys (a
        :class:`jctr.ops.host_index.KeySet`), in one pass over the table."""
        keys = [np.zeros(0, np.int64)]
        rows = [np.zeros((0, self.stored_width(table)), np.float32)]
        for other_keys, other_rows in self._absent(table, held):
            keys.append(other_keys)
            rows.append(other_rows)
        return self._unpack(table, np.concatenate(keys), np.concatenate(rows))

    def pull_except_parts(self, table: int, held=None) -> Iterator[dict[str, np.ndarray]]:
        """:meth:`pull_except` a part at a time (a stored-table dict per chunk of the pass;
        ``held`` None: every row): a table larger than memory, never whole in memory."""
        for keys, rows in self._absent(table, held):
            if keys.size:
                yield self._unpack(table, keys, rows)

    def _absent(self, table: int, held) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for stored, vectors in self.db.items(self.names[table], **self._scan(table)):
            yield (stored, vectors) if held is None else held.absent_rows(stored, vectors)

    def row_bytes(self, table: int) -> int:
        """The memory a stored row takes when read: its key and its floats."""
        return 8 + 4 * self.stored_width(table)

    def stored_bytes(self, table: int, more: int = 0) -> int:
        """About the memory the table's stored rows (and ``more`` rows) take when read."""
        return (self.db.estimated_rows(self.names[table]) + more) * self.row_bytes(table)

    def as_stored(self, table: int, stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rows as a :meth:`pull` would give them back after a :meth:`push` of them (the
        same columns and types, bit for bit): each column as the float32 a row holds, the
        slot back to int32; no packed copy of the rows (0.3 s a pass of 2.5M rows)."""
        keys = np.asarray(stored["keys"], np.int64)
        out = {"keys": keys}
        for column, (name, shape) in zip(self._columns(table, stored), self.layouts[table]):
            part = column.reshape((keys.size, *shape))
            out[name] = part.astype(np.int32) if name == "slot" else part
        return out

    def push(self, table: int, stored: dict[str, np.ndarray]) -> None:
        """Write (overwrite) the rows of a stored-table dict (a pass's rows: one bulk load,
        laid out from the columns)."""
        if stored["keys"].size:
            self.db.ingest_columns(self.names[table], stored["keys"],
                                   self._stored_columns(table, stored))

    def erase(self, table: int, keys: np.ndarray) -> None:
        self.db.erase(self.names[table], np.asarray(keys, np.int64))

    def scale(self, table: int, slot: str, factors: tuple[float, ...]) -> None:
        """Multiply a slot's columns in every stored row (the daily decay of admission counts;
        one pass over the table, as the shrink's)."""
        at = 2 * self.keyed[table]  # (the key's columns)
        for name, shape in self.layouts[table]:
            if name == slot:
                break
            at += int(np.prod(shape))
        self.db.scale_columns(self.names[table], at, np.asarray(factors, np.float32))

    OWNER = "online.owner"  # a meta entry: the run whose rows these are

    def owner(self) -> dict | None:
        """The run that owns the rows (``{"run", "save_model_path"}``), None if unrecorded."""
        return self.db.get_meta(self.OWNER)

    def set_owner(self, run: str, save_model_path: str) -> None:
        self.db.set_meta(self.OWNER, {"run": run,
                                      "save_model_path": os.path.abspath(save_model_path)})

    def clear(self) -> None:
        """Every table's rows and records gone (a store taken over with ``--force``)."""
        for name in self.names:
            self.db.drop_table(name)
        self.db.set_meta(self.OWNER, None)

    def size(self, table: int) -> int:
        return self.db.size(self.names[table])

    # -- undo of a write-back --------------------------------------------------------------
    def save_undo(self, path: str, pulled: list[dict[str, np.ndarray]],
                  written: list[np.ndarray], marker: dict) -> None:
        """Before writing a pass back: what the database held of its keys (``pulled``), the
        keys the write-back writes (``written``) and which pass it is (plain arrays). The
        undo erases the written keys, then puts the pulled rows back: the keys the database
        did not hold are gone again without their being told apart here (a set of the pulled
        keys per pass: ~0.5 s for 1.3M keys)."""
        arrays = {"day": np.array(marker["day"]), "pass": np.array(marker["pass"])}
        for i, (old, new) in enumerate(zip(pulled, written)):
            arrays[f"{i}/written"] = np.asarray(new, np.int64)
            arrays[f"{i}/keys"] = old["keys"]
            # the stored rows' column blocks as they are: an undo (rare) joins them, not
            # every pass (a copy of every pulled row: ~0.8 s for 1.27M rows of 57 floats)
            blocks = self._stored_columns(i, old) if old["keys"].size else \
                [np.zeros((0, self.stored_width(i)), np.float32)]
            for j, block in enumerate(blocks):
                arrays[f"{i}/rows{j}"] = block
        # synced before it replaces the old one: the write-back it undoes follows
        with replacing(path, path + ".tmp.npz") as tmp, DirectWriter(tmp, direct=False) as f:
            np.savez(f, **arrays)

    def undo(self, path: str) -> tuple[str, int]:
        """Put back what :meth:`save_undo` saved; returns its (day, pass)."""
        with np.load(path, allow_pickle=False) as f:
            for i in range(len(self.names)):
                # an earlier jctr saved only the written keys the database did not hold
                # ("added"): erased, then the pulled rows put back, all the same
                erased = f"{i}/written" if f"{i}/written" in f.files else f"{i}/added"
                self.db.erase(self.names[i], f[erased])
                if f[f"{i}/keys"].size:
                    self.db.insert(self.names[i], f[f"{i}/keys"], self._undo_rows(f, i))
            return str(f["day"]), int(f["pass"])

    @staticmethod
    def _undo_rows(f, i: int) -> np.ndarray:
        """Table ``i``'s stored rows in an undo file: its column blocks joined (a file an
        earlier jctr wrote holds them joined, as ``{i}/rows``)."""
        if f"{i}/rows" in f.files:
            return f[f"{i}/rows"]
        blocks, j = [], 0
        while f"{i}/rows{j}" in f.files:
            blocks.append(f[f"{i}/rows{j}"])
            j += 1
        return np.concatenate(blocks, axis=1)

    @staticmethod
    def marker_of(path: str) -> tuple[str, int]:
        with np.load(path, allow_pickle=False) as f:
            return str(f["day"]), int(f["pass"])

    def close(self) -> None:
        self.db.close()
