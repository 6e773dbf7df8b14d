"""The loop's hooks and summary, the rows module's table edits, and the small interfaces the
Trainer's split introduced (Batch's valid-key accessors, dense weights from bytes, one place for
the update topics' names)."""

import re

import jax
import numpy as np
import pytest

from jctr.config import parse_config
from jctr.train.hooks import FitSummary, Hook, PredictionCounts
from jctr.train.trainer import Trainer
from tests.conftest import tiny_config


class Recorder(Hook):
    """Remembers what the loop handed it."""

    def __init__(self):
        self.read, self.stepped, self.ended = [], [], []

    def on_batch(self, batch):
        self.read.append(int(batch.num_valid))
        return len(self.read)  # the note: which read this was

    def on_step(self, step, state, metrics, note):
        self.stepped.append((step, note, "loss" in metrics))

    def on_fit_end(self, state, summary):
        self.ended.append((int(state.step), summary))


def test_hooks_see_every_batch_and_step_in_order_and_fit_returns_its_summary(tmp_path):
    """Each step gets the note of the batch it trained (the reader runs ahead of the steps),
    ``on_fit_end`` gets the summary ``fit`` returns, and the summary's figures are the run's."""
    cfg = tiny_config(tmp_path, "dlrm", max_iter=7, display=3, eval_interval=5, batchsize=256)
    rec = Recorder()
    t = Trainer(parse_config(cfg), log=lambda s: None, hooks=[rec])
    summary = t.fit()
    assert isinstance(summary, FitSummary)
    assert [s for s, _, _ in rec.stepped] == list(range(1, 8))
    assert [n for _, n, _ in rec.stepped] == list(range(1, 8))  # the batch's own note
    assert all(has_loss for _, _, has_loss in rec.stepped)
    assert len(rec.read) >= 7 and all(n == 256 for n in rec.read[:7])
    assert rec.ended == [(7, summary)]
    assert summary.iterations == 7 and summary.step == 7 and not summary.stopped_early
    evals = [h for h in t.history if h["kind"] == "eval"]
    assert [h["iter"] for h in evals] == [5, 7]
    assert summary.validation == {k: evals[-1][k] for k in ("AUC", "AverageLoss")}
    assert np.isfinite(summary.loss) and summary.samples_per_s > 0
    # a second fit goes on from there and calls the hooks again
    assert t.fit(9).iterations == 2 and rec.ended[-1][0] == 9


def test_prediction_counts_must_be_given_when_the_trainer_is_built(tmp_path):
    """The steps count predictions only if a hook asked when they were compiled; one added
    later says so instead of failing inside the step's metrics."""
    cfg = tiny_config(tmp_path, "dlrm", max_iter=2, display=1000, eval_interval=10_000,
                      batchsize=128)
    t = Trainer(parse_config(cfg), log=lambda s: None)
    t.hooks.append(PredictionCounts(16))
    with pytest.raises(ValueError, match="hooks=\\[...\\]"):
        t.fit()
    with pytest.raises(ValueError, match="different auc_buckets"):
        Trainer(parse_config(cfg), log=lambda s: None,
                hooks=[PredictionCounts(16), PredictionCounts(32)])


def test_rows_put_drop_and_scale_keep_the_table_consistent(tmp_path):
    """jctr.sharding.rows: put_rows inserts stored rows (replace: into an empty table),
    drop_keys frees the rows of deleted keys and keeps the others' vectors and optimizer rows,
    scale_slot multiplies an optimizer slot's columns."""
    from jctr.sharding.rows import drop_keys, export_placed, put_rows, scale_slot

    cfg = tiny_config(tmp_path, "dlrm", max_iter=1, display=1000)
    for layer in cfg["layers"]:
        if "sparse_embedding_hparam" in layer:
            layer["optimizer"] = {"type": "SparseAdaGradSGDRule"}
    t = Trainer(parse_config(cfg), log=lambda s: None)
    spec, es, pl = t.specs[0], t.state.embeddings[0], t.placements[0]
    keys = np.array([5, 17, 1 << 40, -3], np.int64)
    rng = np.random.default_rng(0)
    stored = {"keys": keys, "values": rng.normal(size=(4, spec.dim)).astype(np.float32),
              "slot": np.zeros(4, np.int32)}
    stored.update({name: rng.random((4, *arr.shape[1:])).astype(np.float32)
                   for name, arr in es.slots.items()})
    es = put_rows(spec, es, pl, stored, replace=True)
    got = export_placed(es, pl)
    np.testing.assert_array_equal(np.sort(got["keys"]), np.sort(keys))
    es, rows = drop_keys(spec, es, pl, np.array([17, 99], np.int64))
    assert rows == 3
    kept = export_placed(es, pl)
    order = np.argsort(kept["keys"])
    want = np.isin(keys, [5, 1 << 40, -3])
    want_order = np.argsort(keys[want])
    np.testing.assert_array_equal(kept["keys"][order], keys[want][want_order])
    np.testing.assert_allclose(kept["values"][order], stored["values"][want][want_order])
    name = next(iter(es.slots))
    before = np.asarray(es.slots[name])
    factors = (0.5,) * before.shape[-1] if before.ndim > 1 else (0.5,)
    scaled = scale_slot(es, name, factors)
    np.testing.assert_allclose(np.asarray(scaled.slots[name]), before * 0.5)
    assert es.values.sharding == t.state.embeddings[0].values.sharding


def test_batch_valid_key_accessors(tmp_path):
    """Per sparse input: which positions hold keys, the keys, and those of real samples with
    their sample."""
    from jctr.data.batch import Batch

    b, slots = 3, 2
    keys = np.array([10, 11, 20, 21, 30, 0], np.int64)
    segs = np.array([0, 1, 2, 3, 4, b * slots], np.int32)  # the last is padding
    batch = Batch(np.zeros((b, 1), np.float32), np.zeros((b, 0), np.float32), (keys,),
                  (segs,), np.array([True, False, True]))
    np.testing.assert_array_equal(batch.key_mask(0, slots), [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(batch.valid_keys(0, slots), [10, 11, 20, 21, 30])
    k, sample = batch.sample_keys(0, slots)  # sample 1 is padding (mask False)
    np.testing.assert_array_equal(k, [10, 11, 30])
    np.testing.assert_array_equal(sample, [0, 0, 2])


def test_dense_weights_from_bytes_leave_the_served_ones_alone(tmp_path):
    """dense_from_bytes builds new dense parameters from a dense model file's bytes without
    touching the ones passed in (serving swaps them between requests) and checks the size."""
    from jctr.checkpoint.model_files import ModelFileError, dense_from_bytes, dense_weights

    cfg = tiny_config(tmp_path, "dlrm", max_iter=1, display=1000)
    t = Trainer(parse_config(cfg), log=lambda s: None)
    sc, st = t.step_config, t.state
    flat = dense_weights(t.network())
    before = [np.asarray(x).copy() for x in jax.tree.leaves(st.params)]
    params, _ = dense_from_bytes(sc.graphdef, st.params, st.batch_stats,
                                 (flat + 1.0).astype("<f4").tobytes())
    for old, now in zip(before, jax.tree.leaves(st.params)):
        np.testing.assert_array_equal(old, np.asarray(now))  # untouched
    moved = [np.asarray(a) - b for a, b in zip(jax.tree.leaves(params), before)]
    assert all(np.allclose(m, 1.0) for m in moved if m.size)
    with pytest.raises(ModelFileError, match="dense update: dense model file holds 8 bytes"):
        dense_from_bytes(sc.graphdef, st.params, st.batch_stats, b"\0" * 8,
                         where="dense update")


def test_update_topics_are_named_in_one_place():
    """The rows topic is the table's name in the databases; the applier's pattern matches
    exactly the topics of the served models."""
    from jctr.config.hps import dense_name, table_name
    from jctr.stores.kafka import dense_topic, rows_topic, update_topics

    assert rows_topic("m", "t") == table_name("m", "t") == "hps_et.m.t"
    assert dense_topic("m") == dense_name("m") == "hps_dense.m"
    pattern = re.compile(update_topics(["dlrm", "a.b"]))
    for topic, want in [("hps_et.dlrm.emb", True), ("hps_dense.a.b", True),
                        ("hps_et.axb.t", False), ("hps_dense.other", False),
                        ("hps_et.dlrm", False)]:
        assert bool(pattern.match(topic)) is want, topic
