"""The HPS side of online model updates (``update_source`` of type ``kafka_message_queue``):
threads read the update topics of the served models (:class:`jctr.stores.kafka.UpdateReader`)
and apply each message to every layer whose ``update_filters`` match the table
(``hps_et.<model>.<table>``): the volatile database, the persistent database, and the device
cache (rows it holds are refreshed in place); a table's rows of one poll go in together, in
chunks of ``max_batch_size`` keys; dense weights are swapped between two requests.

With a persistent database that takes updates, each side commits in a consumer group of its
own, as HugeCTR's HPS does (one message source per layer): the serving side (volatile database,
device cache, dense swap; group ``<group>.serving``) is not held back by RocksDB's writes, which
the persistent side (group ``<group>``; it also keeps the dense weights a restart serves)
makes after it. The persistent side takes the serving side's batches once they are applied,
decoded (the broker serves and the interpreter decodes each message once), and reads from the
broker itself only to catch up: when it misses messages (a batch not handed over, past
``_HANDOFF_BYTES`` held; a failed write) or while the serving side fails. A restarted serving
side reads from the lower of the two groups' commits: a hash map that starts from RocksDB's
rows holds what the persistent group committed, no more (and the persistent side misses
nothing).

Delivery is at least once and applying is idempotent (a row is set, never added to; a table's
messages come in order), so a restarted consumer that reads some messages again ends in the
same state. Offsets are committed only after the group's layers hold what was read; a failed
write is retried after ``failure_backoff_ms`` from the last committed point, never acknowledged
early. A message that can never apply is refused, logged and counted, never retried: dense
weights of the wrong size or with non-finite values, rows of another width, and rows holding
NaN or infinity (the other rows of that message apply).

Example::

    applier = UpdateApplier(ps.update_source, dbs, models)
    applier.start()            # ... serve ...
    applier.close()
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time

import numpy as np

from jctr.checkpoint.model_files import ModelFileError
from jctr.config.hps import UpdateSourceParams
from jctr.ops.host_sort import isin
from jctr.serving.hps import Databases
from jctr.stores.base import StoreError, StoreUnavailable
from jctr.stores.kafka import ExpiredMessages, UpdateReader, dense_topic, update_topics

log = logging.getLogger("jctr.serving")

# the persistent side trails the serving side: a batch waits (at most _TRAIL_S) until the
# serving side has applied it, and the write batches of each chunk wait while the serving side
# has a batch in hand or more messages to read (at most _YIELD_S a chunk in all); it yields, it
# is never starved. (rocksdict holds the interpreter through a write: writing while the serving
# side still had messages to read served a burst of 1M uniform keys at 1.1-1.5M rows/s instead
# of 1.7-1.9M, docs/performance.md "Online updates: the serving side first")
_TRAIL_S = 1.0
_YIELD_S = 0.1
# the serving side's applied batches held for the persistent side at most (bytes of rows and
# dense weights): one that would pass it is not handed over, and the persistent side reads
# what it misses from the broker
_HANDOFF_BYTES = 256 << 20
_DENSE_STEPS_KEPT = 1024


class _Handoff:
    """The serving side's applied batches, decoded, on their way to the persistent side (which
    then neither fetches nor decodes them again): each with the offset its range of every
    partition starts at (the serving side's next offset before it; messages the reader
    skipped lie between), so that the persistent side sees whether it misses messages."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._items: collections.deque = collections.deque()
        self._bytes = 0
        self._ready = threading.Condition()
        self.dropped = 0  # batches not handed over (the limit passed)
        self.missed = False  # one was dropped since the persistent side last looked

    @staticmethod
    def _size(batch) -> int:
        return sum(len(u.dense) if u.keys is None
                   else u.keys.nbytes + (0 if u.values is None else u.values.nbytes)
                   for _, _, u in batch)

    def put(self, batch: list, starts: dict[tuple[str, int], int]) -> None:
        size = self._size(batch)
        with self._ready:
            if self._bytes + size > self.limit_bytes:
                self.dropped += 1
                self.missed = True
                return
            self._items.append((batch, starts, size))
            self._bytes += size
            self._ready.notify()

    def take(self, timeout_s: float) -> tuple[list, dict] | None:
        """The oldest batch handed over (waiting at most ``timeout_s``), or None."""
        with self._ready:
            if not self._items:
                self._ready.wait(timeout_s)
            if not self._items:
                return None
            batch, starts, size = self._items.popleft()
            self._bytes -= size
            return batch, starts

    def drop_applied(self, applied: dict[tuple[str, int], int]) -> None:
        """Batches whose every message is below ``applied`` (read from the broker) gone."""
        with self._ready:
            while self._items and all(o < applied.get(w, 0) for w, o, _ in self._items[0][0]):
                self._bytes -= self._items.popleft()[2]

    def starts(self) -> dict[tuple[str, int], int]:
        """Where the batches held begin, each partition's lowest."""
        with self._ready:
            out: dict[tuple[str, int], int] = {}
            for _, starts, _ in self._items:
                for w, at in starts.items():
                    out[w] = min(at, out.get(w, at))
            return out


class _Erasures:
    """The erase messages the serving side applied that the persistent side has still to
    apply, each with its keys the serving side has not written since. The persistent side,
    which trails, forgets those keys in the serving side's layers again (a request that
    missed one meanwhile read the persistent row back) and no others: rows written after an
    erase bring a key back (a key evicted and trained again), and forgetting those lost rows
    the model holds from the hash map."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], dict[int, tuple[str, np.ndarray]]] = {}
        self._taken: dict[tuple[str, int], int] = {}  # partition -> the last offset taken

    def erased(self, where: tuple[str, int], offset: int, table: str,
               keys: np.ndarray) -> None:
        """The serving side erased ``keys`` of ``table`` (message ``offset`` of ``where``)."""
        with self._lock:
            if self._taken.get(where, -1) < offset:  # (the persistent side is not past it)
                self._pending.setdefault(where, {})[offset] = (table, keys)

    def written(self, table: str, keys: np.ndarray) -> None:
        """The serving side is about to write rows of ``keys``: erased keys no longer."""
        with self._lock:
            ordered = None
            for pending in self._pending.values():
                for offset, (t, erased) in pending.items():
                    if t == table and erased.size:
                        ordered = np.sort(keys) if ordered is None else ordered
                        pending[offset] = (t, erased[~isin(erased, ordered, test_sorted=True)])

    @contextlib.contextmanager
    def again(self, where: tuple[str, int], offset: int, keys: np.ndarray,
              serving_next: int):
        """The keys of the erase message at ``offset`` to forget again (held while they are
        forgotten: the serving side writes none of them meanwhile). ``serving_next``: the
        next offset the serving side applies. Where it did not note the message: all of
        ``keys`` if it has still to apply it (it writes the later rows after), none if it
        applied it before (a batch the persistent side applies twice)."""
        with self._lock:
            pending = self._pending.get(where, {})
            noted = pending.pop(offset, None)
            for o in [o for o in pending if o < offset]:  # (never to come: skipped)
                del pending[o]
            if not pending:
                self._pending.pop(where, None)
            self._taken[where] = max(offset, self._taken.get(where, -1))
            if noted is not None:
                keys = noted[1]
            elif serving_next > offset:
                keys = keys[:0]
            yield keys


class UpdateApplier:
    """Applies online updates to the layers of the served models (see the module
    docstring). ``group``: the consumer group whose committed offsets say what the layer that
    outlives the process holds (servers with layers of their own need groups of their own).

    Its counts are the layers': ``applied_rows``, ``applied_dense`` and ``last_step`` what
    every layer holds, ``dense_steps`` and ``caught_up`` (readiness) the serving side's;
    :meth:`stats` gives each side's."""

    def __init__(self, params: UpdateSourceParams, dbs: Databases, models: dict, *,
                 group: str = "jctr-hps"):
        self.params = params
        self.dbs = dbs
        self.models = models
        self.group = group
        self.erasures = _Erasures()
        # a layer that starts empty in a restarted server loses what was applied: read every
        # topic from its start then, whatever the group committed
        from_start = not all(dbs.updates_last(t.key) for m in models.values()
                             for t in m.tables)
        split = any("persistent_db" in dbs.update_layers(t.key) for m in models.values()
                    for t in m.tables)
        if split:
            self.lasting: _LastingSide | None = _LastingSide(self, group, from_start)
            self.serving: _Consumer = _ServingSide(self, f"{group}.serving", from_start,
                                                   behind=group)
            self.consumers: list[_Consumer] = [self.serving, self.lasting]
        else:
            self.lasting = None
            self.serving = _Consumer(self, group, from_start)
            self.consumers = [self.serving]

    def start(self) -> None:
        for c in self.consumers:
            c.start()

    def close(self) -> None:
        for c in self.consumers:
            c.stop()
        for c in self.consumers:
            c.join()

    # -- what every layer holds ----------------------------------------------------------------
    @property
    def applied_rows(self) -> int:
        return min(c.applied_rows for c in self.consumers)

    @property
    def applied_erased(self) -> int:
        return min(c.applied_erased for c in self.consumers)

    @property
    def applied_dense(self) -> int:
        return min(c.applied_dense for c in self.consumers)

    @property
    def failures(self) -> int:
        return sum(c.failures for c in self.consumers)

    @property
    def refused(self) -> dict:
        return self.serving.refused

    @property
    def last_step(self) -> dict[str, int]:
        """Table key / dense topic -> the step every layer holds."""
        steps = [dict(c.last_step) for c in self.consumers]
        return {k: min(s[k] for s in steps) for k in steps[0] if all(k in s for s in steps)}

    @property
    def dense_steps(self) -> list[int]:
        """The steps of the last dense messages the serving side applied, oldest first."""
        return list(self.serving.dense_steps)

    @property
    def caught_up(self) -> bool:
        """What the topics held at start is served (readiness)."""
        return self.serving.caught_up

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.consumers if c.error is not None), None)

    @property
    def expired(self) -> tuple[int, int]:
        """(messages, jumps) the broker deleted before a layer read them: the most any
        side missed (both read the same topics)."""
        return (max(c.expired.total for c in self.consumers),
                max(c.expired.jumps for c in self.consumers))

    def stats(self) -> dict:
        expired_messages, expired_jumps = self.expired
        return {"applied_rows": self.applied_rows, "applied_dense": self.applied_dense,
                "applied_erased": self.applied_erased,
                "served_rows": self.serving.applied_rows,
                "served_dense": self.serving.applied_dense,
                "failures": self.failures, "refused": dict(self.refused),
                "error": self.error, "last_step": self.last_step,
                "backlog": self.serving.backlog, "expired_messages": expired_messages,
                "expired_jumps": expired_jumps,
                "consumers": {c.group: c.stats() for c in self.consumers}}


class _Consumer:
    """One consumer group's thread: it reads a batch, applies it to its layers, then commits.
    This one writes every layer (no persistent database takes updates); where one does,
    :class:`_ServingSide` and :class:`_LastingSide` split the layers between two groups."""

    name = "all"
    serves = True  # writes the volatile database and the device cache, swaps dense weights
    keeps = True  # writes the persistent database and keeps the dense weights a restart serves

    def __init__(self, owner: UpdateApplier, group: str, from_start: bool, *,
                 behind: str | None = None):
        self.owner = owner
        self.params = owner.params
        self.dbs = owner.dbs
        self.models = owner.models
        self.group = group
        self.behind = behind
        self.from_start = from_start
        self.topics = update_topics(list(self.models))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.busy = False  # a batch read and not yet applied (the persistent side yields)
        # messages the broker held beyond the serving side's last poll (the persistent side
        # yields while there are; set by the serving thread: a client is not shared)
        self.backlog = 0
        self.offsets: dict[tuple[str, int], int] = {}  # (topic, partition) -> next to apply
        self.applied_rows = 0
        self.applied_erased = 0  # keys forgotten (erase messages)
        self.applied_dense = 0
        self.failures = 0
        self.refused = {"dense": 0, "rows_width": 0, "rows_nonfinite": 0,
                        "other_model": 0}  # never applied
        self._strangers: set[str] = set()  # model names of messages not for us, said once
        self._said: str | None = None  # the source's failure last said
        self.last_step: dict[str, int] = {}  # table key / dense topic -> step applied
        # the step of each dense message applied, the last _DENSE_STEPS_KEPT (a server
        # lives for months)
        self.dense_steps: collections.deque[int] = collections.deque(maxlen=_DENSE_STEPS_KEPT)
        self.error: str | None = None
        self.caught_up = False  # what the topics held at start is applied
        self.expired = ExpiredMessages()  # what the broker deleted before it was read

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"hps-updates-{self.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=10)

    def stats(self) -> dict:
        return {"applied_rows": self.applied_rows, "applied_dense": self.applied_dense,
                "applied_erased": self.applied_erased,
                "failures": self.failures, "error": self.error,
                "last_step": dict(self.last_step), "caught_up": self.caught_up,
                "expired_messages": self.expired.total, "expired_jumps": self.expired.jumps}

    def has_work(self) -> bool:
        """A batch in hand or messages left to read (what the persistent side waits for)."""
        return self.busy or self.backlog > 0

    def _say(self, level: int, message: str, *args) -> None:
        log.log(level, message, *args)

    # -- what the sides do differently ---------------------------------------------------------
    def _opened(self, reader: UpdateReader) -> None:
        """A reader was made (at start, or after the client failed)."""

    def _next_batch(self, reader: UpdateReader) -> list:
        p = self.params
        return reader.poll(p.max_commit_interval, p.poll_timeout_ms / 1000.0)

    def _polled(self, reader: UpdateReader) -> None:
        """After every poll, whatever it returned: what the serving side has left to read."""
        if self.serves:
            self.backlog = reader.backlog()  # (cached watermarks: no request to the broker)

    def _applying(self, batch: list) -> None:
        """Before a batch is applied."""

    def _failed(self, reader: UpdateReader) -> None:
        """A batch failed to apply: read again from the last commit."""
        reader.rewind()

    def _mark(self, reader: UpdateReader, batch: list) -> None:
        """A batch applied: its offsets are what the next commit covers."""
        for topic, offset, _ in batch:
            reader.mark_applied(topic, offset)
            self.offsets[topic] = offset + 1

    def _write_plan(self, rows: int) -> tuple[int, object]:
        """(rows a write, a callback the database calls between its write batches)."""
        return self.params.max_batch_size, None

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        p = self.params
        backoff = p.failure_backoff_ms / 1000.0
        reader = None
        if self.serves:
            for name, model in self.models.items():  # before the first update, on this thread
                try:
                    model.compile_refresh()
                except Exception as e:  # the first refresh then compiles it
                    log.warning("update_source: the device cache refresh of %s was not "
                                "compiled ahead: %s", name, e)
        while not self._stop.is_set():
            try:
                if reader is None:
                    reader = UpdateReader(p.brokers, group=self.group, topics=self.topics,
                                          metadata_refresh_interval_ms=
                                          p.metadata_refresh_interval_ms,
                                          receive_buffer_size=p.receive_buffer_size,
                                          poll_timeout_ms=p.poll_timeout_ms,
                                          security=p.security, from_start=self.from_start,
                                          behind=self.behind, expired=self.expired)
                    self._opened(reader)
                batch = self._next_batch(reader)
            except (StoreUnavailable, StoreError) as e:
                self._down(str(e))
                self._stop.wait(backoff)
                continue
            except Exception as e:  # noqa: BLE001 - the client's errors: try again later
                self._down(f"update_source: {e}")
                if reader is not None:
                    reader.close()
                reader = None
                self._stop.wait(max(backoff, 1.0))
                continue
            self._polled(reader)
            if self.error is not None and self._said is not None:
                self._say(logging.WARNING, "update_source: the broker answers again")
                self._said = None
            if not batch:
                self.caught_up = self.caught_up or reader.caught_up()
                continue
            self._applying(batch)
            self.busy = True
            try:
                self._apply(batch)
            except (StoreError, StoreUnavailable, OSError, ValueError) as e:
                # nothing of this batch is acknowledged: read again from the last commit
                self.busy = False
                self.failures += 1
                self.error = f"applying updates failed ({e}); retrying"
                log.warning("update_source: %s", self.error)
                self._stop.wait(backoff)
                self._failed(reader)
                continue
            self.busy = False
            self._mark(reader, batch)
            self.caught_up = self.caught_up or reader.caught_up()
            try:
                reader.commit()
                self.error = None
            except Exception as e:  # noqa: BLE001 - confluent_kafka.KafkaException
                self.error = f"commit failed ({e}); the next commit covers it"
        if reader is not None:
            reader.close()

    def _down(self, error: str) -> None:
        """The source failed: said once (not at every retry), kept for readiness; its backlog
        is unknown (the persistent side no longer waits for it)."""
        self.error = error
        self.backlog = 0
        if self._said != error.split(" (")[0]:
            self._said = error.split(" (")[0]
            self._say(logging.WARNING, "%s; retrying every %.1f s (readiness says so meanwhile)",
                      error, max(self.params.failure_backoff_ms / 1000.0, 1.0))

    def _apply(self, batch) -> None:
        newest_dense = {u.model: n for n, (_, _, u) in enumerate(batch) if u.kind == "dense"}
        # a table's rows of every message read are applied together, in their order (the
        # latest row of a key wins, as one message after the other would leave it), in chunks
        # of max_batch_size keys (HugeCTR's meaning): RocksDB takes 65,536 sorted rows at
        # ~1.8x the rate of 18 writes of one message's 3,623 (docs/performance.md)
        pending: dict[tuple[str, int], list] = {}
        for n, (where, offset, u) in enumerate(batch):
            model = self.models.get(u.model)
            if model is None:  # a topic of ours whose message names another model
                self.refused["other_model"] += 1
                if u.model not in self._strangers:
                    self._strangers.add(u.model)
                    self._say(logging.ERROR, "update_source: a message for model %r, which "
                              "this server does not serve (%s), skipped (counted in "
                              "jctr_updates_refused)", u.model, ", ".join(sorted(self.models)))
                continue
            if u.kind == "dense":
                if newest_dense[u.model] != n:  # a newer one in this batch replaces it
                    continue
                self._apply_pending(pending)  # the rows read before it are served with it
                try:
                    if self.serves:
                        model.swap_dense(u.dense, u.non_trainable, step=u.step)
                    else:
                        model.check_dense(u.dense, u.non_trainable)
                except ModelFileError as e:  # poison: retrying cannot help
                    self.refused["dense"] += 1
                    self._say(logging.ERROR, "update_source: dense update of %s at step %d "
                              "refused: %s", u.model, u.step, e)
                    continue
                if self.keeps:
                    # kept where it outlives the process: a restart serves it, not the files'
                    self.dbs.save_dense(dense_topic(u.model), u.dense,
                                        {"step": u.step, "non_trainable": u.non_trainable,
                                         "base": model.base_link()})
                self.applied_dense += 1
                self.dense_steps.append(u.step)
                self.last_step[dense_topic(u.model)] = u.step
                continue
            i = model.table_index(u.table)
            if i is None:
                self._say(logging.ERROR, "update_source: model %s has no table %s; skipped",
                          u.model, u.table)
                continue
            t = model.tables[i]
            if u.kind == "erase":  # after the rows read before it; rows after bring keys back
                self._apply_pending(pending)
                self._apply_erase(model, i, u.keys, u.step, (where, offset))
                continue
            if u.values.shape[1] != t.dim:
                self.refused["rows_width"] += int(u.keys.size)
                self._say(logging.ERROR, "update_source: %s rows of size %d, the table has %d; "
                          "skipped", t.key, u.values.shape[1], t.dim)
                continue
            keys, values = u.keys, u.values
            # a NaN row would fail every request that reads its key. The message as a whole
            # first: a reduction over rows took 11x as long (89 against 8 us a message)
            if not np.isfinite(values).all():
                finite = np.isfinite(values).all(axis=1)
                bad = int((~finite).sum())
                self.refused["rows_nonfinite"] += bad
                self._say(logging.ERROR, "update_source: %s: %d row(s) with NaN or infinity "
                          "refused (first key %d)", t.key, bad, int(keys[~finite][0]))
                keys, values = keys[finite], values[finite]
            pending.setdefault((u.model, i), []).append((keys, values, u.step))
        self._apply_pending(pending)

    def _apply_pending(self, pending: dict) -> None:
        for (name, i), parts in pending.items():
            self._apply_rows(self.models[name], i, parts)
        pending.clear()

    def _layers(self, table: str) -> list[str]:
        return [x for x in self.dbs.update_layers(table)
                if (self.keeps if x == "persistent_db" else self.serves)]

    def _apply_rows(self, model, i: int, parts: list) -> None:
        """One table's rows of the messages read, ``parts`` [(keys, values, step)] in their
        order, to this consumer's layers in chunks (:meth:`_write_plan`)."""
        t = model.tables[i]
        keys_all = np.concatenate([k for k, _, _ in parts])
        values_all = np.concatenate([v for _, v, _ in parts])
        layers = self._layers(t.key)
        step, pause = self._write_plan(keys_all.size)
        if self.serves and self.owner.lasting is not None:
            self.owner.erasures.written(t.key, keys_all)  # (before: see _Erasures.again)
        # under this side's lock: a model taking new files keeps what it wrote (journal)
        with self.dbs.update_lock(t.key, self.name):
            for s in range(0, keys_all.size, step):
                keys = keys_all[s:s + step]
                values = np.ascontiguousarray(values_all[s:s + step])
                for layer in layers:
                    self.dbs.write_rows(layer, t.key, keys, values, pause=pause)
                if self.serves:
                    model.refresh_rows(i, keys, values)
            for layer in layers + (["device_cache"] if self.serves else []):
                self.dbs.journal(layer, t.key, parts)
        self.applied_rows += int(keys_all.size)
        self.last_step[t.key] = parts[-1][2]

    def _apply_erase(self, model, i: int, keys: np.ndarray, step: int,
                     message: tuple[tuple[str, int], int]) -> None:
        """Keys the trained table no longer holds (erase message ``message``: (partition,
        offset)), forgotten by this consumer's layers. The persistent side, which follows
        the serving side, forgets them in the volatile database and the device cache again
        (a request that missed them there meanwhile read the persistent row back,
        ``cache_missed_embeddings``), less those the serving side wrote since
        (:class:`_Erasures`)."""
        t = model.tables[i]
        with self.dbs.update_lock(t.key, self.name):  # (see _apply_rows)
            for layer in self._layers(t.key):
                self.dbs.erase_rows(layer, t.key, keys)
                self.dbs.journal(layer, t.key, [(keys, None, step)])
            if self.serves:
                if self.owner.lasting is not None:
                    self.owner.erasures.erased(*message, t.key, keys)
                model.forget_rows(i, keys)
                self.dbs.journal("device_cache", t.key, [(keys, None, step)])
            else:
                self._forget_again(model, i, keys, step, message)
        self.applied_erased += int(keys.size)
        self.last_step[t.key] = step

    def _forget_again(self, model, i: int, keys: np.ndarray, step: int,
                      message: tuple[tuple[str, int], int]) -> None:
        """The persistent side: an erase message's keys forgotten again in the serving
        side's layers, at best (a volatile database that is down holds nothing back here)."""
        t = model.tables[i]
        where, offset = message
        serving_next = self.owner.serving.offsets.get(where, -1)
        with self.owner.erasures.again(where, offset, keys, serving_next) as again:
            if not again.size:
                return
            erased = [(again, None, step)]
            try:
                if "volatile_db" in self.dbs.update_layers(t.key):
                    self.dbs.erase_rows("volatile_db", t.key, again)
                    self.dbs.journal("volatile_db", t.key, erased)
            except (StoreError, StoreUnavailable) as e:
                self._say(logging.WARNING, "update_source: %s: erased keys not forgotten "
                          "again in volatile_db (%s)", t.key, e)
            model.forget_rows(i, again)
            self.dbs.journal("device_cache", t.key, erased)


class _ServingSide(_Consumer):
    """The volatile database, the device cache and the dense swap (group ``<group>.serving``),
    read first; each batch it applied goes on to the persistent side, decoded."""

    name = "serving"
    keeps = False

    def _mark(self, reader: UpdateReader, batch: list) -> None:
        # where the batch's range of each partition starts (the persistent side, which
        # takes it from here, sees whether it follows what it applied)
        starts: dict[tuple[str, int], int] = {}
        for topic, offset, _ in batch:
            starts.setdefault(topic, reader.applied.get(topic, offset))
        super()._mark(reader, batch)
        self.owner.lasting.handoff.put(batch, starts)


class _LastingSide(_Consumer):
    """The persistent database and the kept dense weights (group ``<group>``): it loads the
    serving side's batches as they are handed over, and reads from the broker itself only to
    catch up (``from_broker``); ``batches`` counts the batches taken each way. It yields to
    the serving side (one interpreter runs both) and says nothing the serving side says."""

    name = "lasting"
    serves = False

    def __init__(self, owner: UpdateApplier, group: str, from_start: bool):
        super().__init__(owner, group, from_start)
        self.handoff = _Handoff(_HANDOFF_BYTES)
        self.from_broker = False
        self.batches = {"handed": 0, "read": 0}

    def stats(self) -> dict:
        return {**super().stats(), "batches": dict(self.batches)}

    def _say(self, level: int, message: str, *args) -> None:
        """Silent: it reads the same messages as the serving side, which says everything."""

    def _opened(self, reader: UpdateReader) -> None:
        self.from_broker = False  # the serving side's batches, to begin with
        reader.stop_fetching()

    def _applying(self, batch: list) -> None:
        if self.from_broker:
            self._trail(batch)

    def _failed(self, reader: UpdateReader) -> None:
        self.from_broker = True  # (a handed batch is gone: the broker has it)
        super()._failed(reader)

    def _mark(self, reader: UpdateReader, batch: list) -> None:
        super()._mark(reader, batch)
        if self.from_broker:
            self._back_to_handoff(reader)

    def _write_plan(self, rows: int) -> tuple[int, object]:
        # all in one write (the serving side applied these rows first): the database's
        # insert takes many rows as one bulk load (the interpreter let go while the file is
        # laid out) and yields between its write batches while the serving side has work
        # (at most _YIELD_S for max_batch_size rows in all: under a steady stream the
        # persistent side still writes)
        step = self.params.max_batch_size
        share = _YIELD_S * min(1.0, self.dbs.persistent_params.max_set_batch_size / step)

        def pause():
            self._wait_while(self.owner.serving.has_work, share)
        return max(step, rows), pause

    def _next_batch(self, reader: UpdateReader) -> list:
        """The serving side's next batch, handed over once it applied it (the messages below
        what this side applied left out), or, to catch up, read from the broker: when a
        handed batch starts past what this side applied (it missed messages: its start, a
        batch not handed over, a failed write), or while the serving side fails."""
        p = self.params
        if not self.from_broker:
            reader.refresh()  # every partition's starting offset (the group's commit)
            handed = None if self.handoff.missed else \
                self.handoff.take(p.poll_timeout_ms / 1000.0)
            if handed is None:
                if self.owner.serving.error is None and not self.handoff.missed:
                    return []
            else:
                batch, starts = handed
                if any(w not in reader.applied for w in starts):  # a topic new since
                    reader.refresh(force=True)
                if all(at <= reader.applied.get(w, -1) for w, at in starts.items()):
                    self.batches["handed"] += 1
                    return [m for m in batch if m[1] >= reader.applied[m[0]]]
            self.from_broker = True
            self.handoff.missed = False  # (what it missed is read now)
            reader.rewind()
        self._yield_to_serving()
        batch = super()._next_batch(reader)
        if batch:
            self.batches["read"] += 1
        else:
            self._back_to_handoff(reader)
        return batch

    def _back_to_handoff(self, reader: UpdateReader) -> None:
        """After a batch read from the broker: the handed batches it covered dropped, and the
        broker left once this side holds every message the serving side applied but the
        handed batches held (read before them: an offset the serving side moved before
        handing its batch over keeps this side reading)."""
        self.handoff.drop_applied(reader.applied)
        serving = self.owner.serving
        if serving.error is not None:
            return
        # a batch dropped from here on is seen in handoff mode; one dropped before moved the
        # serving side's offsets first, read below
        self.handoff.missed = False
        need = dict(serving.offsets)  # (a copy: the serving thread moves them)
        for w, at in self.handoff.starts().items():
            need[w] = min(at, need.get(w, at))
        if all(reader.applied.get(w, -1) >= at for w, at in need.items()):
            self.from_broker = False
            reader.stop_fetching()

    def _wait_while(self, busy, limit_s: float) -> None:
        """Wait while ``busy()`` holds, at most ``limit_s`` (it yields, never starves)."""
        end = time.monotonic() + limit_s
        while busy() and time.monotonic() < end and not self._stop.is_set():
            time.sleep(0.002)

    def _yield_to_serving(self) -> None:
        """Before it reads, wait (at most _TRAIL_S) while the serving side has messages in
        hand or to read: reading and decoding here took the interpreter from the serving
        side (a burst served at 0.53-0.63x the broker's rate without this wait, 0.63-0.80x
        with it)."""
        self._wait_while(self.owner.serving.has_work, _TRAIL_S)

    def _trail(self, batch) -> None:
        """Wait (a while) until the serving side has applied ``batch``: what this side writes
        then never delays a served update (one interpreter runs both)."""
        serving = self.owner.serving
        last = {where: offset for where, offset, _ in batch}
        self._wait_while(lambda: serving.error is None and any(
            serving.offsets.get(w, -1) <= o for w, o in last.items()), _TRAIL_S)


def wait_for(applier: UpdateApplier, predicate, timeout_s: float = 30.0) -> bool:
    """Wait until ``predicate(applier)`` holds (tests and benchmarks)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate(applier):
            return True
        time.sleep(0.02)
    return False
