"""Online updates from training (``solver.kafka_sink``): a :class:`jctr.train.hooks.Hook` that
notes the keys each step trains and every ``every_n_steps`` steps, and at the end of each
``fit``, sends their rows and the dense weights to Kafka, where serving's update applier reads
them. The one module of the training side that talks to a store; the Trainer attaches it.

In a multi-process run every process publishes: the keys every process trained are gathered,
and each process sends the rows its devices hold (each row once, by its owner); process 0 sends
the dense weights.

Keys the table no longer holds are sent as erased keys, so that a server living on the
updates for months forgets them as the trained model did (its databases would otherwise keep
every key ever trained, and serve rows the model dropped): those the streaming shrink deletes
at once (:meth:`KafkaPublisher.on_keys_erased`), those an evicting table evicted (without a
spill: a spilled row is still the model's) when the record of keys sent is pruned (at most
every table's worth of new keys). Where the device table holds a part of the model
(``partial``: streaming training's ``sparse_store``), only the deletions are sent.

Example::

    publisher = KafkaPublisher(cfg, step_config, placements, report=print)
    trainer = Trainer(cfg, hooks=[publisher])    # what Trainer does for solver.kafka_sink
"""

from __future__ import annotations

import json
from collections.abc import Callable

import jax
import numpy as np

from jctr.checkpoint.model_files import dense_weights, host_network, non_trainable
from jctr.config import ModelConfig
from jctr.data.batch import Batch
from jctr.errors import UserError
from jctr.models.ctr import StepConfig, TrainState
from jctr.ops.host_sort import SortedRuns, isin, unique
from jctr.sharding.distributed import gather_rows
from jctr.sharding.mesh import to_host
from jctr.sharding.rows import export_own_keys, own_held_keys
from jctr.train.hooks import FitSummary, Hook


class KafkaPublisher(Hook):
    """Sends what training changed to ``solver.kafka_sink`` (see the module docstring). The
    messages queue; nothing waits for the broker. A broker that lost its topics gets every
    key trained so far again."""

    def __init__(self, cfg: ModelConfig, step_config: StepConfig, placements, *,
                 report: Callable[[str], None]):
        ks = cfg.solver.kafka_sink
        from jctr.stores.kafka import KafkaMessageSink

        self.every = ks.every_n_steps
        self.step_config = step_config
        self.specs = step_config.specs
        self.placements = placements
        self.report = report
        # a broker that does not answer is reported now, before the first step
        self.sink = KafkaMessageSink(ks.brokers, ks.model_name,
                                     send_buffer_size=ks.send_buffer_size,
                                     max_buffered_bytes=ks.max_buffered_mb << 20,
                                     report=report, security=ks.security)
        self._touched: list[list[np.ndarray]] = [[] for _ in self.specs]
        # keys sent and not erased since: the same in every process
        self._published = [SortedRuns() for _ in self.specs]
        self.partial = False  # True: the device tables hold a part of the model's rows
        # a checkpoint restored: its tables' keys may be served (sent by the run before):
        # in the record at the next publish, so that their eviction is sent
        self._restored = False
        self.erased = 0  # keys sent as erased

    def on_model_rebuilt(self, step_config: StepConfig, placements) -> None:
        """A table grew: its rows are exported from the new placement."""
        self.step_config, self.specs, self.placements = (step_config, step_config.specs,
                                                         placements)

    def before_restore(self, step: int | None, directory: str | None) -> None:
        self._restored = True

    def on_batch(self, batch: Batch) -> list[np.ndarray]:
        """The keys this batch's step updates, per table."""
        return [unique(batch.valid_keys(s.input_index, s.slot_num)) for s in self.specs]

    def on_step(self, step: int, state: TrainState, metrics, note: list[np.ndarray]) -> None:
        for seen, keys in zip(self._touched, note):
            seen.append(keys)
        if self.every and step % self.every == 0:
            self.publish(state)

    def on_fit_end(self, state: TrainState, summary: FitSummary) -> None:
        """What the last steps changed and the final dense weights; then a short wait for
        delivery."""
        self.publish(state)
        left = self.sink.flush(10.0 if self.sink.reachable else 0.0)
        if left:
            self.report(f"[jctr] warning: kafka_sink: {left} update message(s) not delivered "
                        f"yet ({self.sink.stats()['dropped']} dropped)")

    def on_run_end(self) -> None:
        """The last wait for delivery; messages still undelivered (or dropped from a full
        buffer) are an error that says so: the served model misses them."""
        left = self.sink.flush(10.0 if self.sink.reachable else 2.0)
        dropped = self.sink.stats()["dropped"]
        if left or dropped:
            raise UserError(
                f"kafka_sink: {left + dropped} update message(s) never reached "
                f"{self.sink.brokers} ({left} undelivered, {dropped} dropped from a full "
                "buffer): servers reading them miss these updates. The run's checkpoints and "
                "model files hold the "
                "trained model: load those into serving (python -m jctr.serve load), or "
                "publish again once a broker answers")

    def publish(self, state: TrainState) -> int:
        """Send the rows of every key trained since the last call, and the dense weights;
        returns the rows sent."""
        step = int(to_host(state.step))
        rows = 0
        resend = self.sink.broker_restarted()  # it lost what it had: all trained so far
        for i, spec in enumerate(self.specs):
            keys = (unique(np.concatenate(self._touched[i])) if self._touched[i]
                    else np.zeros(0, np.int64))
            self._touched[i] = []
            if jax.process_count() > 1:  # every process's: each sends the rows it holds
                keys = self._everyones(keys)
            record = self._published[i]
            if self._restored:
                record.add(self._everyones(own_held_keys(state.embeddings[i],
                                                         self.placements[i])))
            record.add(keys)
            pl = self.placements[i]  # a sharded table holds capacity rows a part
            limit = 2 * spec.capacity * (pl.num_shards if pl is not None and pl.sharded else 1)
            if record.size_bound() > limit and record.values().size > limit:
                self._prune(i, spec, state, step)
            if resend:
                keys = record.values()
            if not keys.size:
                continue
            stored = export_own_keys(state.embeddings[i], keys, self.placements[i])
            if stored["keys"].size:
                self.sink.publish_rows(spec.name, step, stored["keys"], stored["values"])
            rows += int(stored["keys"].size)
        self._restored = False
        net = host_network(self.step_config, state)
        if jax.process_index() == 0:
            self.sink.publish_dense(step, dense_weights(net).astype("<f4").tobytes(),
                                    json.dumps(non_trainable(net)))
        return rows

    def _prune(self, i: int, spec, state: TrainState, step: int) -> None:
        """The record of keys sent, past twice table ``i``'s rows (a run of months meets many
        times its rows), cut to the keys the table holds (every process's); those it no
        longer holds were evicted: sent as erased where the table is the model's whole."""
        record = self._published[i].values()
        held = self._everyones(export_own_keys(state.embeddings[i], record,
                                               self.placements[i], keys_only=True)["keys"])
        gone = record[~isin(record, held)]
        self._published[i].replace(held)
        whole = not self.partial and not (spec.eviction is not None and spec.eviction.spill)
        if whole:
            self._send_erased(spec.name, step, gone)

    @staticmethod
    def _everyones(keys: np.ndarray) -> np.ndarray:
        """Every process's ``keys``, sorted and each once (the record is the same in every
        process: the same calls)."""
        if jax.process_count() > 1:
            keys = np.concatenate([p["keys"] for p in gather_rows({"keys": keys})])
        return unique(keys)

    def on_keys_erased(self, table: int, keys: np.ndarray, state: TrainState) -> None:
        """Keys the run deleted from table ``table`` (the streaming shrink): those sent
        before go as erased keys now."""
        keys = np.asarray(keys, np.int64)
        if not self.partial:  # the record holds every key sent that the table still holds
            keys = keys[self._published[table].contains(keys)]
        # (partial: a key sent may have left the record with its pass: all of them go)
        if not keys.size:
            return
        self._published[table].remove(keys)
        self._send_erased(self.specs[table].name, int(to_host(state.step)), keys)

    def _send_erased(self, table: str, step: int, keys: np.ndarray) -> None:
        if keys.size and jax.process_index() == 0:
            self.sink.publish_erase(table, step, keys)
        self.erased += int(keys.size)
