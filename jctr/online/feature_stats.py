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

The statistics live on the host, keyed by key (column arrays and a hashed index of their
keys), independent of where a key's row sits in a device table; a batch is added where it is
read, by a compiled loop over its occurrences (:mod:`jctr.online.key_index`), never a Python
loop per key. (Admission, ``embedx_threshold``, is decided by the
table itself as it trains: :func:`jctr.embedding.row_optimizers.admits`.) A table that outgrows
memory (``sparse_store``) outgrows it in its statistics too (~45 bytes a key): given a folder,
columns that would take more than ``in_memory_bytes`` move into unnamed files there, mapped,
so that the operating system pages them as it pages the table's rows; the day's decisions
then run a part of the columns at a time.

Example::

    stats = FeatureStats()
    stats.observe(keys, show=np.ones(n), click=labels)   # per key occurrence
    deleted = stats.shrink(ShrinkRule())                  # the end of a day
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from jctr.online import key_index
from jctr.runtime.mapped import MappedArrays


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
    """Show, click, unseen days, delta score and "pushed since last saved" per key.

    The columns (``keys``, ``show``, ``click``, ``unseen_days``, ``delta_score``,
    ``since_delta``) are arrays in storage order (the order keys first came; a shrink keeps
    it), writable views. A hashed index
    (:mod:`jctr.online.key_index`) finds a key's row, so adding a batch costs its occurrences,
    whatever the table's size. With ``gather=True`` (a multi-process run) new occurrences wait
    in :meth:`take_pending` until every process has them (:meth:`merge`). :meth:`observe` runs
    on the reader thread while a pass trains; everything else runs between passes, after the
    reader is done, so nothing here locks."""

    _FIELDS = ("keys", "show", "click", "unseen_days", "delta_score", "since_delta")
    _DTYPES = (np.int64, np.float64, np.float64, np.int32, np.float64, bool)
    # and a column of its own: "saved", the rows a save set back since the last mark_base
    # (rows stay where they are between two shrinks, and a base is marked after each)
    _COLUMNS = (*_FIELDS, "saved")
    _COLUMN_DTYPES = (*_DTYPES, bool)

    PRESIZE_MAX = 1 << 23
    """Most keys room is made for up front (``expected_keys``); beyond, the columns double."""
    ROW_BYTES = sum(np.dtype(d).itemsize for d in _COLUMN_DTYPES)
    """Bytes of a key's columns (its index slots take 8-16 bytes more)."""
    CHUNK = 1 << 22
    """Rows a day's decisions take at a time (their temporaries stay this size)."""

    def __init__(self, score: ScoreRule | None = None, *, gather: bool = False,
                 expected_keys: int = 0, files: str | None = None,
                 in_memory_bytes: int | None = None,
                 report: Callable[[str], None] | None = None):
        """``files``: a folder where the columns move (in unnamed, mapped files) once they
        would take ``in_memory_bytes`` or more (0: from the start); ``report`` is told
        when they do."""
        self.rule = score or ScoreRule()
        self.gather = gather
        self._n = 0
        self._folder, self._limit, self._report = files, in_memory_bytes, report
        self._files: MappedArrays | None = None  # the columns' files, once they moved
        self._cols = self._empty_columns(0)
        self._indexing = None  # a shrink's index rebuild still running (a Future)
        self._index = self._new_index(key_index.index_size(0))
        self._index[:] = -1
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        # room for the keys the table can hold (``expected_keys``, at most PRESIZE_MAX): the
        # first day then grows no column and rebuilds no index on the reader thread while
        # the pass trains (each doubling copied every column and re-inserted every key:
        # 0.5-0.6 s of a 4.8M-key day, docs/performance.md "Day-end cost, fourth round")
        self._reserve(min(int(expected_keys), self.PRESIZE_MAX))

    keys = property(lambda self: self._column("keys"))
    show = property(lambda self: self._column("show"))
    click = property(lambda self: self._column("click"))
    unseen_days = property(lambda self: self._column("unseen_days"))
    delta_score = property(lambda self: self._column("delta_score"))
    since_delta = property(lambda self: self._column("since_delta"))

    @property
    def _index(self) -> np.ndarray:
        """The hashed index of the keys (once a shrink's rebuild of it is done)."""
        self._index_built()
        return self._key_index

    @_index.setter
    def _index(self, index: np.ndarray) -> None:
        self._index_built()  # a rebuild in flight finishes before its index is let go
        self._key_index = index

    def _index_built(self) -> None:
        if self._indexing is not None:
            indexing, self._indexing = self._indexing, None
            indexing.result()  # its error, if any, is raised here

    def _column(self, name: str) -> np.ndarray:
        self.flush()
        return self._cols[name][: self._n]

    @property
    def mapped(self) -> bool:
        """Whether the columns live in mapped files (``files``)."""
        return self._files is not None

    def _empty_columns(self, rows: int) -> dict[str, np.ndarray]:
        """Columns of ``rows`` rows; once in files, the same files grown (their rows kept).
        Where the files cannot take them (a full disk) nothing changes and the error says so."""
        files = self._files
        moving = files is None and self._folder is not None and self._limit is not None \
            and rows * self.ROW_BYTES >= self._limit
        if moving:
            files = MappedArrays(self._folder)
        # one array per column (not one array of rows: measured no faster to add to, and the
        # whole-column decisions at a day's end then run on contiguous arrays)
        if files is None:
            return {name: np.zeros(rows, dtype)
                    for name, dtype in zip(self._COLUMNS, self._COLUMN_DTYPES)}
        try:
            cols = {name: files.array(name, dtype, rows)
                    for name, dtype in zip(self._COLUMNS, self._COLUMN_DTYPES)}
        except OSError:
            if moving:
                files.close()
            raise
        if moving:
            self._files = files
            if self._report is not None:
                self._report(f"[jctr] feature statistics: {rows:,} keys' room would take "
                             f"{rows * self.ROW_BYTES / 2**20:,.0f} MiB (more than the "
                             f"{self._limit / 2**20:,.0f} MiB kept in memory): in mapped "
                             f"files in {self._folder} from now on")
        return cols

    INT32_ROWS = 2**31 - 1
    """Rows an index of int32 row numbers holds; past them, int64 (twice the memory)."""

    def _new_index(self, size: int) -> np.ndarray:
        """Room for an index of ``size`` slots (its contents to be written): int32 row
        numbers while every row it may hold (half its slots) fits them."""
        dtype = np.int32 if size // 2 <= self.INT32_ROWS else np.int64
        if self._files is not None:
            return self._files.array("index", dtype, size)
        return np.empty(size, dtype)

    def __len__(self) -> int:
        self.flush()
        return self._n

    def observe(self, keys: np.ndarray, show: np.ndarray, click: np.ndarray) -> None:
        """Add one occurrence per entry: ``keys[i]`` was shown ``show[i]`` times and clicked
        ``click[i]`` times (a batch's keys with each sample's show and click broadcast)."""
        keys = np.asarray(keys, np.int64).reshape(-1)
        show = np.broadcast_to(np.asarray(show, np.float64).reshape(-1), keys.shape)
        click = np.broadcast_to(np.asarray(click, np.float64).reshape(-1), keys.shape)
        if not keys.size:
            return
        if self.gather:
            self._pending.append((keys, show, click))
        else:
            self.merge(keys, show, click)

    def flush(self) -> None:
        """Merge what :meth:`observe` kept pending (``gather`` only)."""
        if self._pending:
            self.merge(*self.take_pending())

    def take_pending(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What :meth:`observe` kept pending (``gather=True``) since, summed per key:
        ``(keys, show, click)`` (sorted keys), no longer pending. A multi-process run gathers
        every process's and :meth:`merge` s them all, so that every process holds the same
        statistics."""
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
        """Add shows and clicks of ``keys`` (seen now: unseen days back to 0)."""
        keys = np.ascontiguousarray(keys, np.int64)
        if not keys.size:
            return
        self._reserve(self._n + keys.size)
        c, before = self._cols, self._n
        self._n = int(key_index.accumulate(
            self._index, c["keys"], c["show"], c["click"], c["delta_score"],
            c["unseen_days"], c["since_delta"], self._n, keys,
            np.ascontiguousarray(show, np.float64), np.ascontiguousarray(click, np.float64),
            float(self.rule.nonclk_coeff), float(self.rule.click_coeff)))
        c["saved"][before:self._n] = False  # new rows (a shrink leaves old ones past the end)

    def _reserve(self, rows: int) -> None:
        """Room for ``rows`` rows in the columns and the index (doubling: amortized O(1))."""
        cap = self._cols["keys"].size
        before = self._files
        if rows > cap:
            grown = self._empty_columns(max(rows, 2 * cap, 1024))
            if before is None:  # in files already, the rows are there
                for name, col in grown.items():
                    col[: self._n] = self._cols[name][: self._n]
            self._cols = grown
        if 2 * rows > self._index.size or before is not self._files:  # (moved: it too)
            self._index = self._new_index(key_index.index_size(max(rows, self._index.size)))
            key_index.rebuild_distinct(self._index, self._cols["keys"], self._n)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found, score)`` per key (score 0 where unknown)."""
        self.flush()
        rows = self.rows_of(keys)
        found = rows >= 0
        score = np.zeros(rows.size)
        at = rows[found]
        score[found] = self.rule.score(self._cols["show"][at], self._cols["click"][at])
        return found, score

    def rows_of(self, keys: np.ndarray) -> np.ndarray:
        """The storage row of each key, -1 where it has none."""
        self.flush()
        return key_index.find(self._index, self._cols["keys"],
                              np.ascontiguousarray(keys, np.int64).reshape(-1))

    def scores(self) -> np.ndarray:
        """Every key's score, in storage order."""
        return self.rule.score(self.show, self.click)

    def shrink(self, rule: ShrinkRule) -> np.ndarray:
        """The end of a day (Paddle's ``CtrCommonAccessor::Shrink``): show and click decay,
        and the keys the rule removes (score below ``delete_threshold``, unseen for more than
        ``delete_after_unseen_days``) are deleted; returns them sorted (their table rows are to
        be freed). Keys age afterwards, with :meth:`age`."""
        self.flush()
        c = self._cols
        deleted = np.empty(self._n, np.int64)  # memory of the keys written to only
        kept, gone = key_index.shrink(
            c["keys"], c["show"], c["click"], c["unseen_days"], c["delta_score"],
            c["since_delta"], self._n, float(rule.show_click_decay_rate),
            float(self.rule.nonclk_coeff), float(self.rule.click_coeff),
            float(rule.delete_threshold), int(rule.delete_after_unseen_days), deleted)
        if gone:  # the kept rows moved up: the index again (its memory kept), on a thread
            # of its own while the caller erases the keys from the tables; what needs the
            # index waits for it (0.13 s of 9M keys beside the table's erase, 0.14 s)
            self._n = int(kept)
            index = self._index
            pool = ThreadPoolExecutor(1, thread_name_prefix="jctr-stats-index")
            self._indexing = pool.submit(key_index.rebuild_distinct, index, c["keys"], self._n)
            pool.shutdown(wait=False)
        return np.sort(deleted[:gone])

    def age(self) -> None:
        """The day's batch model is saved: every key is one day older (a key seen since is
        back at 0 with its next push); Paddle's ``UpdateStatAfterSave`` with param 3."""
        self.unseen_days[:] += 1

    def base_keys(self, base_threshold: float, delta_keep_days: int) -> np.ndarray:
        """Keys a base model holds (Paddle's ``Save`` with param 2): score >=
        ``base_threshold`` and unseen for at most ``delta_keep_days`` days. They count as
        saved: their delta score starts again from 0. Sorted."""
        def take(c):
            return (self.rule.score(c["show"], c["click"]) >= base_threshold) \
                & (c["unseen_days"] <= delta_keep_days)
        return self._saved(self._select(take, save=True))

    def delta_keys(self, base_threshold: float, delta_threshold: float,
                   delta_keep_days: int) -> np.ndarray:
        """Keys the next delta model holds (Paddle's ``Save`` with param 1): pushed since
        they were last saved, score >= ``base_threshold``, delta score >=
        ``delta_threshold``, unseen for at most ``delta_keep_days`` days. They count as
        saved. Sorted."""
        def take(c):
            return c["since_delta"] \
                & (self.rule.score(c["show"], c["click"]) >= base_threshold) \
                & (c["delta_score"] >= delta_threshold) & (c["unseen_days"] <= delta_keep_days)
        return self._saved(self._select(take, save=True))

    def _select(self, test: Callable[[dict[str, np.ndarray]], np.ndarray], *,
                save: bool = False) -> np.ndarray:
        """The rows (ascending) where ``test`` of the columns holds, ``CHUNK`` rows at a time:
        the temporaries of a day's decisions stay that size whatever the keys. ``save``:
        those rows count as saved (their delta score back to 0, not pushed since)."""
        self.flush()
        n, found = self._n, []
        for start in range(0, n, self.CHUNK):
            part = {name: col[start:min(start + self.CHUNK, n)]
                    for name, col in self._cols.items()}
            take = test(part)
            if save:
                part["delta_score"][take] = 0.0
                part["since_delta"][take] = False
                part["saved"][take] = True
            found.append(start + np.flatnonzero(take))
        return np.concatenate(found) if found else np.zeros(0, np.int64)

    def _saved(self, rows: np.ndarray) -> np.ndarray:
        return np.sort(self._cols["keys"][rows])

    def mark_base(self) -> None:
        """The statistics as they are now were saved whole (after a day's shrink and
        :meth:`age`): :meth:`changes` are counted from here."""
        self._cols["saved"][: self._n] = False

    def changes(self) -> dict[str, np.ndarray]:
        """The rows that differ from the statistics at the last :meth:`mark_base`, by storage
        position: those pushed since (unseen 0: the base was marked after every key aged) and
        those a delta save set back. ``{"positions", "rows" (the row count), and each
        column at the positions}``; :meth:`apply_changes` over the base's state gives these
        statistics. A long-lived table meets a day's keys, not all its keys, between two
        bases: a pass's checkpoint writes these, not every key's statistics."""
        pos = self._select(lambda c: (c["unseen_days"] == 0) | c["saved"])
        return {"positions": pos, "rows": np.int64(self._n),
                **{name: self._cols[name][pos] for name in self._FIELDS}}

    def apply_changes(self, base: dict[str, np.ndarray], changes: dict[str, np.ndarray]
                      ) -> None:
        """These statistics become ``base`` (a :meth:`state_dict`) with ``changes`` (a
        :meth:`changes` made over it) applied; the changed rows count as changed until the
        next :meth:`mark_base`."""
        rows, pos = int(changes["rows"]), np.asarray(changes["positions"], np.int64)
        n = np.asarray(base["keys"]).size
        if rows < n or (pos.size and (pos[0] < 0 or pos[-1] >= rows)) or \
                np.any(pos[1:] <= pos[:-1]) or np.count_nonzero(pos >= n) != rows - n:
            raise ValueError(f"feature statistics: changes of {pos.size} row(s) to {rows} rows "
                             f"do not fit a base of {n} rows (ascending positions, every "
                             "row past the base among them)")

        def put(name, dtype, col):  # the base's rows, then the changed ones
            col[:n] = np.asarray(base[name], dtype)
            col[pos] = np.asarray(changes[name], dtype)

        self._fill(rows, put)
        self._cols["saved"][pos] = True

    def state_dict(self) -> dict[str, np.ndarray]:
        """Plain arrays in storage order (for a checkpoint; no pickle)."""
        self.flush()
        return {name: self._cols[name][: self._n] for name in self._FIELDS}

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
        for name in self._FIELDS:
            shape = np.shape(state[name])
            if shape != (n,):
                raise ValueError(f"feature statistics: {name} holds {shape}, expected ({n},)")
        self._fill(n, lambda name, dtype, col: col.__setitem__(
            slice(0, n), np.asarray(state[name], dtype)))

    def _fill(self, rows: int, put: Callable[[str, object, np.ndarray], None]) -> None:
        """``rows`` rows of columns that ``put(name, dtype, column)`` writes (a column at a
        time: in files, no copy of the whole in memory), then their index."""
        self._index_built()
        self._pending = []
        cols = self._empty_columns(rows)
        for name, dtype in zip(self._FIELDS, self._DTYPES):
            put(name, dtype, cols[name])
        cols["saved"][:rows] = False
        index = self._new_index(key_index.index_size(rows))
        again = key_index.rebuild(index, cols["keys"], rows)
        if again >= 0:
            raise ValueError(f"feature statistics: key {cols['keys'][again]} is there twice")
        self._cols, self._n, self._index = cols, rows, index

    def close(self) -> None:
        """Let go of the columns' files (mapped: their space comes back once the last
        view of them goes)."""
        if self._files is not None:
            self._index_built()
            self._files.close()
