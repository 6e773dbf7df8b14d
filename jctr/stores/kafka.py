"""Online model updates over Kafka (``confluent-kafka``): the training side's message sink and
the serving side's reader. Topics are HugeCTR's table names, one partition each, so a table's
updates stay in order: ``hps_et.<model>.<table>`` for embedding rows and ``hps_dense.<model>``
for dense weights; messages use :mod:`jctr.stores.update_messages`.

The sink never blocks a training step: messages wait in the client's queue (at most
``max_buffered_bytes``) while the broker is slow or away, and beyond that are dropped and
counted. The reader assigns itself every matching topic, starts at the offset its group last
committed (the beginning when none), and commits only what the caller says is applied.

Example::

    sink = KafkaMessageSink("127.0.0.1:19092", "dlrm")
    sink.publish_rows("sparse_embedding1", step, keys, vectors)
    reader = UpdateReader("127.0.0.1:19092", group="jctr-hps", topics=r"^hps_(et|dense)\\.dlrm")
    for topic, offset, update in reader.poll(64, timeout_s=0.5): ...
    reader.commit()
"""

from __future__ import annotations

import logging
import re
import threading
import time

import numpy as np

from jctr.config.hps import dense_name, table_name
from jctr.stores.base import StoreError, StoreUnavailable
from jctr.stores.update_messages import (
    MessageError,
    Update,
    decode,
    encode_dense,
    encode_erase,
    encode_rows,
    join_dense,
    rows_per_message,
)

log = logging.getLogger("jctr.updates")
# librdkafka's own lines (connection attempts to an absent broker, ...) go to logging, not to
# stderr: the sink and the reader report what matters themselves
_CLIENT_LOG = logging.getLogger("jctr.kafka.client")


class _OncePerMinute(logging.Filter):
    """A client line again within a minute (numbers aside) is dropped: a dead broker makes
    librdkafka repeat its connection failure many times a second."""

    def __init__(self):
        super().__init__()
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = re.sub(r"\d+", "#", record.getMessage())
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < 60.0:
            return False
        if len(self._last) > 1000:
            self._last.clear()
        self._last[key] = now
        return True


_CLIENT_LOG.addFilter(_OncePerMinute())


def _kafka():
    try:
        import confluent_kafka
        import confluent_kafka.admin  # noqa: F401  (AdminClient, NewTopic)
    except ImportError:
        raise StoreError('online updates need confluent-kafka: pip install "jctr[serving]"') \
            from None
    return confluent_kafka


def _servers(brokers: str) -> str:
    """HugeCTR separates brokers with ";", librdkafka with ","."""
    return ",".join(b.strip() for b in re.split("[;,]", brokers) if b.strip())


FETCH_WAIT_MS = 20  # the longest a broker may hold one fetch
# while no topic matches yet, how often a poll looks at the topic list again: a trainer's
# first message creates its topic, and a poll that slept its whole timeout first held the
# first update back by up to poll_timeout_ms (docs/performance.md, thirty-fifth session)
LOOK_FOR_TOPICS_S = 0.05


def rows_topic(model: str, table: str) -> str:
    return table_name(model, table)


def dense_topic(model: str) -> str:
    return dense_name(model)


def update_topics(models: list[str]) -> str:
    """The regex of every update topic of ``models`` (rows of any table, dense weights)."""
    model = "(" + "|".join(re.escape(m) for m in models) + ")"
    rows = re.escape(table_name("MODEL", "TABLE")).replace("MODEL", model).replace("TABLE",
                                                                                   ".+")
    dense = re.escape(dense_name("MODEL")).replace("MODEL", model)
    return f"^({rows}|{dense})$"


class KafkaMessageSink:
    """Publishes a model's updated embedding rows and dense weights (see the module
    docstring). ``send_buffer_size``: the largest message in bytes (HugeCTR's name)."""

    def __init__(self, brokers: str, model: str, *, send_buffer_size: int = 262144,
                 max_buffered_bytes: int = 64 << 20, connect_timeout_s: float = 5.0,
                 report=print, security: tuple[tuple[str, str], ...] = ()):
        kafka = _kafka()
        self._kafka = kafka
        self.model = model
        self.brokers = _servers(brokers)
        self.send_buffer_size = send_buffer_size
        self.report = report
        self.sent = self.dropped = self.failed = 0
        self._lock = threading.Lock()
        self._warned = 0.0
        self.producer = kafka.Producer({
            "bootstrap.servers": self.brokers,
            "message.max.bytes": max(send_buffer_size + 4096, 1 << 20),
            "queue.buffering.max.kbytes": max(max_buffered_bytes >> 10, 1),
            "queue.buffering.max.messages": 1 << 20,
            "linger.ms": 5,
            "acks": "all",
            **dict(security),
        }, logger=_CLIENT_LOG)
        self._admin = kafka.admin.AdminClient({"bootstrap.servers": self.brokers,
                                               **dict(security)}, logger=_CLIENT_LOG)
        self._topics: set[str] = set()
        self._created: set[str] = set()  # topics created here, with one partition
        self.reachable = self._check(connect_timeout_s)

    def _check(self, timeout_s: float) -> bool:
        """Say at once when no broker answers (training goes on, buffering)."""
        try:
            self._admin.list_topics(timeout=timeout_s)
            return True
        except Exception as e:  # confluent_kafka.KafkaException
            self.report(f"[jctr] warning: kafka_sink: no broker answers at {self.brokers} "
                        f"({e}); training goes on, updates wait in a buffer and are dropped "
                        "(counted) once it is full")
            return False

    def _ensure_topic(self, topic: str) -> None:
        """Create the topic with one partition while the broker answers (once; never waits
        on a broker that did not answer at start). Messages carry the topic as their key, so a
        topic the broker created itself with more partitions keeps them in one, in order."""
        if topic in self._topics:
            return
        self._topics.add(topic)
        if not self.reachable:
            return
        from confluent_kafka.admin import NewTopic

        try:
            futures = self._admin.create_topics([NewTopic(topic, 1, 1)],
                                                operation_timeout=2.0, request_timeout=2.0)
            futures[topic].result(timeout=2.0)
            self._created.add(topic)
        except Exception:  # noqa: BLE001 - exists already, or the broker went: produce anyway
            pass

    def broker_restarted(self) -> bool:
        """Whether a topic this sink created is gone, or came back with other partitions: a
        broker that lost its messages (one keeping them in memory, restarted). The caller
        then sends the whole state again (applying is idempotent)."""
        if not self._created:
            return False
        try:
            topics = self._admin.list_topics(timeout=2.0).topics
        except Exception:  # noqa: BLE001 - not answering now: nothing to conclude yet
            return False
        lost = [t for t in self._created if t not in topics or len(topics[t].partitions) != 1]
        if lost:
            self.report(f"[jctr] kafka_sink: the broker at {self.brokers} lost topic(s) "
                        f"{', '.join(sorted(lost))} (restarted?): sending the whole state again")
            self._created.clear()
            self._topics.clear()
            return True
        return False

    def _delivered(self, err, _msg) -> None:
        if err is not None:
            with self._lock:
                self.failed += 1

    def _produce(self, topic: str, payload: bytes) -> bool:
        self._ensure_topic(topic)
        try:
            self.producer.produce(topic, value=payload, key=topic.encode(),
                                  on_delivery=self._delivered)
        except (BufferError, self._kafka.KafkaException) as e:
            # a full buffer, or a message the broker refuses: dropped and counted, never a
            # failed training step
            with self._lock:
                self.dropped += 1
            if not isinstance(e, BufferError):
                self.report(f"[jctr] warning: kafka_sink: {topic}: {e}")
            now = time.monotonic()
            if now - self._warned > 10:
                self._warned = now
                self.report(f"[jctr] warning: kafka_sink: the send buffer is full (broker "
                            f"{self.brokers} slow or away); {self.dropped} update message(s) "
                            "dropped so far")
            return False
        self.producer.poll(0)  # delivery reports
        with self._lock:
            self.sent += 1
        return True

    def publish_rows(self, table: str, step: int, keys: np.ndarray, values: np.ndarray) -> int:
        """Embedding rows of ``table``, in messages of at most ``send_buffer_size`` bytes;
        returns the messages queued."""
        values = np.asarray(values, np.float32)
        per = rows_per_message(values.shape[1], self.send_buffer_size)
        queued = 0
        for s in range(0, keys.size, per):
            queued += self._produce(rows_topic(self.model, table),
                                    encode_rows(self.model, table, step, keys[s:s + per],
                                                values[s:s + per]))
        return queued

    def publish_erase(self, table: str, step: int, keys: np.ndarray) -> int:
        """Keys ``table`` no longer holds, on its rows topic (after the rows sent before),
        in messages of at most ``send_buffer_size`` bytes; returns the messages queued."""
        per = rows_per_message(0, self.send_buffer_size)
        queued = 0
        for s in range(0, keys.size, per):
            queued += self._produce(rows_topic(self.model, table),
                                    encode_erase(self.model, table, step, keys[s:s + per]))
        return queued

    def publish_dense(self, step: int, dense: bytes, non_trainable: str) -> bool:
        """The dense weights, in as many messages of at most ``send_buffer_size`` bytes as
        they need (the reader puts them together)."""
        ok = True
        for part in encode_dense(self.model, step, dense, non_trainable,
                                 max_bytes=self.send_buffer_size):
            ok = self._produce(dense_topic(self.model), part) and ok
        return ok

    def flush(self, timeout_s: float = 10.0) -> int:
        """Wait up to ``timeout_s`` for queued messages; returns how many are still queued."""
        return self.producer.flush(timeout_s)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"sent": self.sent, "dropped": self.dropped, "failed": self.failed}


class ExpiredMessages:
    """Update messages the broker deleted (its retention) before a consumer group read them:
    ``messages`` per (topic, partition) found where the group's committed offset lies below
    the first message kept, ``jumps`` the client's own skips past deleted messages while it
    read (a server further behind than the retention; their count is not known)."""

    def __init__(self):
        self.messages: dict[tuple[str, int], int] = {}
        self.upto: dict[tuple[str, int], int] = {}  # where the deleted ones counted end
        self.jumps = 0

    @property
    def total(self) -> int:
        return sum(list(self.messages.values()))  # (read while the reader's thread adds)


class UpdateReader:
    """Reads update messages from every topic matching ``topics`` (a regex), in order per
    topic, from the group's committed offsets (see the module docstring)."""

    def __init__(self, brokers: str, *, group: str, topics: str,
                 metadata_refresh_interval_ms: int = 30000, receive_buffer_size: int = 262144,
                 poll_timeout_ms: int = 500, security: tuple[tuple[str, str], ...] = (),
                 from_start: bool = False, behind: str | None = None,
                 expired: ExpiredMessages | None = None):
        kafka = _kafka()
        self._kafka = kafka
        self.pattern = re.compile(topics)
        self.refresh_s = metadata_refresh_interval_ms / 1000.0
        # librdkafka wants fetch.max.bytes >= message.max.bytes and the receive buffer above
        # both; HugeCTR's receive_buffer_size is the largest message. Some brokers (Tansu)
        # answer a fetch with more than fetch.max.bytes: the receive buffer may grow to 1 GiB
        message = max(receive_buffer_size + 1024, 1000)
        fetch = max(message, 1 << 20)
        config = {
            "bootstrap.servers": _servers(brokers),
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "message.max.bytes": message,
            "fetch.max.bytes": fetch,
            "receive.message.max.bytes": max(fetch + 4096, 1 << 30),
            "topic.metadata.refresh.interval.ms": metadata_refresh_interval_ms,
            # a broker may hold a fetch this long even when a message arrives meanwhile
            # (Tansu does): short, whatever a poll may wait, so that an update is seen
            # within tens of milliseconds (docs/performance.md, "Online updates")
            "fetch.wait.max.ms": min(poll_timeout_ms, FETCH_WAIT_MS),
            # a reader whose queue of fetched messages filled (the persistent side waits for
            # the serving side) fetched again only after librdkafka's 1 s back-off: the last
            # messages of a burst then came ~0.3-1 s late (docs/performance.md)
            "fetch.queue.backoff.ms": FETCH_WAIT_MS,
            **dict(security)}
        try:
            self.consumer = kafka.Consumer({**config, "group.id": group}, logger=_CLIENT_LOG)
        except kafka.KafkaException as e:
            raise StoreError(f"update_source: cannot create the consumer: {e}") from None
        self.assigned: dict[tuple[str, int], int] = {}  # (topic, partition) -> next to read
        self.applied: dict[tuple[str, int], int] = {}  # (topic, partition) -> next applied
        self._parts: dict[tuple[str, int], list[Update]] = {}  # dense parts read so far
        self._reconnected = False  # the connection was lost: offsets to be fetched again
        self._looked = 0.0
        # from_start: every topic from its earliest retained message, whatever the group
        # committed (a server whose layers start empty reads everything again)
        self.from_start = from_start
        # behind: another group whose commits this one must not start past (the serving side
        # of a server whose hash map starts from what the persistent side committed)
        self.behind = behind
        # what the broker deleted before this group read it: the caller's, so that a reader
        # made again counts on
        self.expired = ExpiredMessages() if expired is None else expired
        self._behind_consumer = None
        self._config = config
        self.targets: dict[tuple[str, int], int] = {}  # the end of each topic when first seen
        self._listed = False  # the topics were listed once
        # whether the client fetches (off: the messages come another way, see
        # stop_fetching; the offsets are still kept and committed)
        self.fetching = True

    def refresh(self, force: bool = False) -> None:
        """The topics looked up (at most once every ``metadata_refresh_interval_ms`` unless
        ``force``) and each new partition's starting offset taken (assigned to the client
        while it fetches), as a poll does first: also what a reader that does not fetch
        needs to know where it stands."""
        now = time.monotonic()
        if not force and now - self._looked < min(self.refresh_s, 1.0) and self.assigned:
            return
        self._looked = now
        try:
            topics = self.consumer.list_topics(timeout=2.0).topics
        except Exception as e:
            raise StoreUnavailable(f"update_source: no broker answers ({e})") from None
        gone = [w for w in self.assigned if w[0] not in topics]
        if self._reconnected or gone:
            # after a lost connection start again from what the group committed: the same
            # offsets from a broker that kept them, the beginning from one that restarted
            # empty (applying twice changes nothing)
            for w in set(gone) | (set(self.assigned) if self._reconnected else set()):
                self.assigned.pop(w, None)
                self.applied.pop(w, None)
            self._parts.clear()
            self._reconnected = False
        known = {t for t, _ in self.assigned}
        new = [self._kafka.TopicPartition(t, p) for t, meta in topics.items()
               if self.pattern.search(t) and t not in known for p in meta.partitions]
        self._listed = True
        if not new:
            if gone and self.fetching:
                self._assign(self.assigned)
            return
        bound = self._behind_offsets(new)
        for tp in self.consumer.committed(new, timeout=5.0):
            where = (tp.topic, tp.partition)
            low, high = self.consumer.get_watermark_offsets(tp, timeout=5.0)
            offset = tp.offset if bound is None else min(tp.offset, bound.get(where, -1))
            if not self.from_start and 0 <= offset < low:
                self._expired_below(where, offset, low)
            start = low if self.from_start or offset < 0 else max(offset, low)
            self.assigned[where] = start
            self.applied[where] = start
            self.targets.setdefault(where, high)
        if self.fetching:
            self._assign(self.assigned)

    def _expired_below(self, where: tuple[str, int], offset: int, low: int) -> None:
        """Messages ``offset`` to ``low - 1`` were deleted by the broker (the topic's
        retention) before this group read them: said, and counted in :attr:`expired`."""
        upto = self.expired.upto.get(where, 0)
        new = low - max(offset, upto)
        if new <= 0:  # counted already (a reader made again before the next commit)
            return
        self.expired.messages[where] = self.expired.messages.get(where, 0) + new
        self.expired.upto[where] = low
        log.error("update_source: %s partition %d: %d update message(s) (offsets %d to %d) "
                  "expired before this server read them (the topic keeps messages for less "
                  "time than the server was away); the rows they changed keep older values "
                  "until later updates or the next base or delta model (python -m jctr.serve "
                  "load)", where[0], where[1], new, max(offset, upto), low - 1)

    def _behind_offsets(self, parts: list) -> dict[tuple[str, int], int] | None:
        """The ``behind`` group's commits of ``parts`` (-1: none), or None without one."""
        if self.behind is None:
            return None
        if self._behind_consumer is None:
            self._behind_consumer = self._kafka.Consumer({**self._config,
                                                         "group.id": self.behind},
                                                        logger=_CLIENT_LOG)
        return {(tp.topic, tp.partition): tp.offset
                for tp in self._behind_consumer.committed(parts, timeout=5.0)}

    def caught_up(self) -> bool:
        """Every topic's messages up to where it ended when first seen are read (ask after
        applying what :meth:`poll` returned; a failed apply rewinds)."""
        return self._listed and all(self.assigned.get(w, 0) >= end
                                    for w, end in self.targets.items())

    def _assign(self, offsets: dict[tuple[str, int], int]) -> None:
        self.consumer.assign([self._kafka.TopicPartition(t, p, o)
                              for (t, p), o in offsets.items()])

    def poll(self, max_messages: int, timeout_s: float) -> list[tuple[tuple[str, int], int,
                                                                      Update]]:
        """Up to ``max_messages`` decoded updates ``((topic, partition), offset, update)``, in
        order per topic; messages that are not jctr updates are logged and skipped."""
        self.refresh()
        deadline = time.monotonic() + timeout_s
        while not self.assigned:  # (a refresh with nothing assigned always lists the topics)
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            time.sleep(min(left, LOOK_FOR_TOPICS_S))
            self.refresh()
        timeout_s = max(0.0, deadline - time.monotonic())
        out = []
        # wait (up to timeout_s) for the first message only, then take what is there: a
        # consume of max_messages would hold a small update until the batch fills or the
        # timeout passes (p50 524 ms at the default 500 ms; docs/performance.md)
        first = self.consumer.consume(1, timeout_s)
        rest = self.consumer.consume(max_messages - 1, 0) if first and max_messages > 1 else []
        for msg in first + rest:
            if msg.error():
                code = msg.error().code()
                if code in (self._kafka.KafkaError._TRANSPORT,
                            self._kafka.KafkaError._ALL_BROKERS_DOWN):
                    self._reconnected = True
                    self._looked = 0.0
                elif code == self._kafka.KafkaError._AUTO_OFFSET_RESET:
                    # the next message to read was deleted while the server read (it fell
                    # further behind than the topic's retention): the client skipped on
                    self.expired.jumps += 1
                    log.error("update_source: %s; the messages skipped are lost to this "
                              "server until the next base or delta model", msg.error())
                elif code != self._kafka.KafkaError._PARTITION_EOF:
                    log.warning("update_source: %s", msg.error())
                continue
            where, offset = (msg.topic(), msg.partition()), msg.offset()
            self.assigned[where] = offset + 1
            try:
                update = decode(msg.value())
            except MessageError as e:
                log.error("update_source: %s offset %d skipped: %s", where, offset, e)
                continue
            if update.kind == "dense_part":  # dense weights come in parts, in order
                parts = self._parts.setdefault(where, [])
                if update.part == 0:
                    parts.clear()
                parts.append(update)
                if len(parts) < update.parts or parts[0].step != update.step:
                    continue
                try:
                    update = join_dense(self._parts.pop(where))
                except MessageError as e:
                    log.error("update_source: %s skipped: %s", where, e)
                    continue
            out.append((where, offset, update))
        return out

    def backlog(self) -> int:
        """Messages the broker holds beyond what :meth:`poll` has returned, by the high
        watermarks of the last fetches (no request to the broker)."""
        left = 0
        for (t, p), at in self.assigned.items():
            try:
                _, high = self.consumer.get_watermark_offsets(
                    self._kafka.TopicPartition(t, p), cached=True)
            except Exception:  # noqa: BLE001 - not fetched yet
                continue
            left += max(0, high - at)
        return left

    def mark_applied(self, where: tuple[str, int], offset: int) -> None:
        # in order per partition; lower again only when a restarted broker begins anew
        self.applied[where] = offset + 1
        if not self.fetching:  # applied from messages read another way: read up to there
            self.assigned[where] = offset + 1

    def rewind(self) -> None:
        """Read again from what was applied (after a failed write); a reader that stopped
        fetching fetches again."""
        self._parts.clear()
        self.assigned = dict(self.applied)
        self.fetching = True
        self._assign(self.assigned)

    def stop_fetching(self) -> None:
        """No more fetches from the broker (the messages come another way, and are marked
        applied all the same); :meth:`rewind` fetches again from what was applied."""
        self.fetching = False
        self._parts.clear()
        self.assigned = dict(self.applied)
        self.consumer.assign([])

    def commit(self) -> None:
        """Commit what :meth:`mark_applied` recorded (never what was only read)."""
        if self.applied:
            self.consumer.commit(offsets=[self._kafka.TopicPartition(t, p, o)
                                          for (t, p), o in self.applied.items()],
                                 asynchronous=False)

    def close(self) -> None:
        self.consumer.close()
        if self._behind_consumer is not None:
            self._behind_consumer.close()
