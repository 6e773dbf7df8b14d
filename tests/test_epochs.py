"""Epochs as users of Keras and FuxiCTR know them: evaluation after each epoch, early stopping
with the best weights restored, the learning rate lowered on plateau (state, not a recompile),
test sets reported apart, embedding norms in the log, and bit-identical repeats."""

import jax
import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from jctr.checkpoint.manager import Checkpointer
from jctr.checkpoint.snapshots import restore_snapshot
from jctr.config.schema import EarlyStoppingConfig, PlateauConfig
from jctr.embedding.hash_table import export_items
from jctr.train.monitors import EarlyStopping, PlateauSchedule
from jctr.train.trainer import Trainer
from tests.conftest import tiny_config

STEPS_PER_EPOCH = 8  # 4096 samples in batches of 512


def epoch_config(tiny, tmp_path, **solver):
    solver = {"max_iter": None, "num_epochs": 4, "eval_interval": "epoch", "display": 1,
              "eval_batches": None, **solver}
    cfg = tiny("dlrm", **solver)
    cfg["layers"][0]["synthetic"].update(num_samples=4096, eval_num_samples=2048)
    cfg["solver"]["snapshot_prefix"] = str(tmp_path / "run_")
    return cfg


def scripted(trainer: Trainer, aucs: list[float]) -> None:
    """The validation AUC follows ``aucs``, one per evaluation (the model still trains)."""
    values = iter(aucs)
    real = trainer.evaluate

    def evaluate(num_batches=None, data=None, **kw):
        if data is not None:
            return real(num_batches, data, **kw)
        return {"AUC": next(values), "AverageLoss": 0.5}

    trainer.evaluate = evaluate


def same_model(a, b) -> bool:
    """Equal dense state, and every table maps the same keys to the same values and optimizer
    rows (where a row sits in the hash table may differ after a restore)."""
    if not leaves_equal((a.step, a.params, a.batch_stats, a.opt_state, a.lr_scale),
                        (b.step, b.params, b.batch_stats, b.opt_state, b.lr_scale)):
        return False
    for ea, eb in zip(a.embeddings, b.embeddings):
        ea, eb = jax.tree.map(np.asarray, ea), jax.tree.map(np.asarray, eb)
        if ea.values.ndim == 2:  # one device: no leading device axis
            ea, eb = jax.tree.map(lambda x: x[None], ea), jax.tree.map(lambda x: x[None], eb)
        for d in range(ea.values.shape[0]):  # each device's part of a split table
            pa_, pb = (jax.tree.map(lambda x, d=d: x[d], e) for e in (ea, eb))
            (ka, ra), (kb, rb) = export_items(pa_.table), export_items(pb.table)
            oa, ob = np.argsort(ka), np.argsort(kb)
            if not np.array_equal(ka[oa], kb[ob]):
                return False
            for x, y in zip(jax.tree.leaves((pa_.values, pa_.slots)),
                            jax.tree.leaves((pb.values, pb.slots))):
                if not np.array_equal(x[ra[oa]], y[rb[ob]]):
                    return False
    return True


def leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb))


# ---- the monitors, by hand --------------------------------------------------------------


def test_early_stopping_by_hand():
    es = EarlyStopping(EarlyStoppingConfig(metric="AUC", mode="max", patience=2,
                                           min_delta=0.01))
    # 0.705 is better than 0.70 but not by more than min_delta: it counts as no improvement
    seen = [es.update(v, it) for it, v in [(1, 0.70), (2, 0.705), (3, 0.72), (4, 0.71)]]
    assert seen == [True, False, True, False]
    assert (es.best, es.best_iter, es.wait, es.should_stop) == (0.72, 3, 1, False)
    es.update(float("nan"), 5)  # NaN never improves
    assert es.should_stop and es.best_iter == 3
    low = EarlyStopping(EarlyStoppingConfig(metric="LogLoss", mode="min", patience=1))
    assert [low.update(v, i) for i, v in enumerate([0.5, 0.4, 0.45])] == [True, True, False]
    assert low.should_stop and low.best == 0.4


def test_relative_min_delta_and_warm_up_epochs_by_hand():
    """Issue 37: ``min_delta_mode: relative`` compares with a share of the best's magnitude;
    ``start_from_epoch`` leaves the warm-up's evaluations unwatched (Keras' EarlyStopping,
    ``keras/src/callbacks/early_stopping.py`` ``on_epoch_end``: nothing is recorded while
    ``epoch < start_from_epoch``)."""
    rel = EarlyStopping(EarlyStoppingConfig(patience=1, min_delta=0.01,
                                            min_delta_mode="relative"))
    # 0.80 -> 0.807 is +0.875%: not more than 1% of 0.80; 0.81 is +1.25%
    assert [rel.update(v, i) for i, v in enumerate([0.80, 0.807, 0.81])] == [True, False, True]
    loss = EarlyStopping(EarlyStoppingConfig(metric="LogLoss", mode="min", patience=3,
                                             min_delta=0.1, min_delta_mode="relative"))
    assert [loss.update(v, i) for i, v in enumerate([0.5, 0.46, 0.44])] == [True, False, True]
    warm = EarlyStopping(EarlyStoppingConfig(patience=1, start_from_epoch=3))
    # the first three epochs (0-based 0..2): a high AUC that falls would stop a run
    seen = [warm.update(v, it, epoch=it - 1) for it, v in
            [(1, 0.95), (2, 0.80), (3, 0.96), (4, 0.90), (5, 0.92), (6, 0.91)]]
    assert seen == [False, False, False, True, True, False]
    assert (warm.best, warm.best_iter, warm.should_stop) == (0.92, 5, True)


def test_plateau_schedule_by_hand():
    p = PlateauSchedule(PlateauConfig(factor=0.1, patience=2, min_lr=2e-5), base_lr=1e-3)
    lowered = [p.update(v, i) for i, v in enumerate([0.70, 0.69, 0.68, 0.71, 0.70, 0.70,
                                                     0.70, 0.70])]
    # two misses lower the rate (1e-3 -> 1e-4) and start the count again; after the new best
    # 0.71 two more misses: 1e-5 would be below min_lr, so 2e-5; then it stays there
    assert lowered == [False, False, True, False, False, True, False, False]
    assert p.scale == pytest.approx(2e-2)
    restored = PlateauSchedule(p.cfg, 1e-3)
    restored.load_state_dict(p.state_dict())
    assert restored.state_dict() == p.state_dict()


# ---- the loop ------------------------------------------------------------------------------


def test_epochs_log_their_mean_training_loss_and_validation(tiny, tmp_path):
    t = Trainer.from_config(epoch_config(tiny, tmp_path, num_epochs=2))
    t.fit()
    history = t.history
    steps = [h for h in history if h["kind"] == "train"]
    epochs = [h for h in history if h["kind"] == "epoch"]
    evals = [h for h in history if h["kind"] == "eval"]
    assert [e["iter"] for e in epochs] == [8, 16] and [e["iter"] for e in evals] == [8, 16]
    assert [e["epoch"] for e in evals] == [1, 2] and evals[0]["set"] == "validation"
    # every batch is full here, so the epoch's mean is the plain mean of its steps' losses
    for e, first in zip(epochs, (0, 8)):
        want = np.mean([h["loss"] for h in steps[first:first + 8]])
        assert e["train_loss"] == pytest.approx(want, rel=1e-6)
    # the whole validation set (eval_batches unset), no repeated final evaluation
    assert len(evals) == 2


def test_embedding_norms_in_the_log_match_the_table(tiny, tmp_path):
    t = Trainer.from_config(epoch_config(tiny, tmp_path, num_epochs=1))
    t.fit()
    history = t.history
    logged = [h for h in history if h["kind"] == "eval"][-1]["embedding_norms"]
    es = t.state.embeddings[0]
    keys, rows = export_items(es.table)
    values = np.asarray(es.values)[rows]
    want = np.linalg.norm(values, axis=1).mean()
    assert logged["sparse_embedding1"]["rows"] == len(keys)
    assert logged["sparse_embedding1"]["mean_norm"] == pytest.approx(want, rel=1e-5)


@settings(max_examples=3, deadline=None, derandomize=True, phases=[Phase.explicit,
                                                                  Phase.generate])
@example([0.72, 0.70, 0.70])  # stops at epoch 3, back to epoch 1
@example([0.70, 0.74, 0.72, 0.76])  # the last epoch is the best: nothing to restore
@given(st.lists(st.sampled_from([0.70, 0.72, 0.74, 0.76]), min_size=3, max_size=4))
def test_restored_weights_are_the_best_epochs_checkpoint(tmp_path_factory, aucs):
    """Whatever the validation curve, the weights after fit are those of the best epoch's
    snapshot: dense, tables and optimizer state alike."""
    tmp_path = tmp_path_factory.mktemp("run")
    tiny = lambda model, **solver: tiny_config(tmp_path, model, **solver)  # noqa: E731
    cfg = epoch_config(tiny, tmp_path, num_epochs=len(aucs), snapshot=STEPS_PER_EPOCH,
                       snapshot_keep=8, early_stopping={"patience": 2})
    t = Trainer.from_config(cfg)
    scripted(t, aucs)
    t.fit()
    history = t.history
    best = int(np.argmax(aucs))  # the first of equal values is the best
    best_iter = (best + 1) * STEPS_PER_EPOCH
    stopped = any(h["kind"] == "early_stop" for h in history)
    assert stopped == (len(aucs) - 1 - best >= 2)
    assert int(t.state.step) == best_iter
    fresh = Trainer.from_config(cfg).state
    ckpt = Checkpointer(cfg["solver"]["snapshot_prefix"] + "checkpoints")
    saved, _, _ = restore_snapshot(ckpt, t.cfg, t.step_config, fresh, t.placements, best_iter,
                                   keep_positions=False)
    assert same_model(t.state, saved)


def test_plateau_lowers_the_rate_without_compiling_again(tiny, tmp_path):
    cfg = epoch_config(tiny, tmp_path, num_epochs=4, lr_policy="plateau",
                       lr_plateau={"factor": 0.5, "patience": 1, "min_lr": 0.1})
    t = Trainer.from_config(cfg)  # SGD at 0.5: 0.25, then 0.125, then min_lr 0.1
    scripted(t, [0.7, 0.69, 0.68, 0.67])
    t.fit()
    history = t.history
    assert [round(h["lr"], 6) for h in history if h["kind"] == "lr"] == [0.25, 0.125, 0.1]
    assert float(t.state.lr_scale) == pytest.approx(0.2)
    assert t.train_step._cache_size() == 1


def test_warm_up_epochs_and_a_patience_of_its_own_after_each_rate_drop(tiny, tmp_path):
    """In the loop: the evaluations at the end of the first two epochs (0.85, then a noisy
    dip) are not watched; with ``restart_after_lr_drop`` each plateau rate drop gives the
    lower rate ``patience`` evaluations of its own (FuxiCTR reduces the rate on a plateau and
    stops only when the lowered rates keep missing), so the run goes on to its last epoch
    where it would stop at the fifth."""
    aucs = [0.85, 0.70, 0.82, 0.81, 0.81, 0.81, 0.81, 0.81]

    def run(**es):
        cfg = epoch_config(tiny, tmp_path, num_epochs=len(aucs), lr_policy="plateau",
                           lr_plateau={"factor": 0.5, "patience": 1},
                           early_stopping={"patience": 2, "start_from_epoch": 2,
                                           "restore_best_weights": False, **es})
        t = Trainer.from_config(cfg)
        scripted(t, aucs)
        t.fit()
        return [h for h in t.history if h["kind"] == "early_stop"]

    plain = run()
    assert [(h["iter"], h["best_iter"]) for h in plain] == [
        (5 * STEPS_PER_EPOCH, 3 * STEPS_PER_EPOCH)]
    patient = run(restart_after_lr_drop=True)
    # drops at epochs 4, 5, 6, 7 (patience 1 each) keep restarting the count: no early stop
    assert patient == []


def test_the_rate_factor_scales_dense_and_table_updates(tiny, tmp_path):
    """One step at lr_scale 0.25 moves every weight a quarter as far as at 1 (SGD)."""
    cfg = epoch_config(tiny, tmp_path, num_epochs=1)
    cfg["optimizer"]["sgd_hparam"]["warmup_steps"] = 0  # full-size steps
    t = Trainer.from_config(cfg)
    batch = next(t.data.train.batches(512, epochs=1))
    dev = t.placed.to_devices(batch, True)
    state, _ = t.train_step(t.state, dev)  # the batch's keys are in the table from here on
    start = t.placed.copy_to_host(state)
    moved = {}
    for scale in (1.0, 0.25):
        state = t.placed.copy_to_devices(start)
        state = state._replace(lr_scale=jax.numpy.float32(scale))
        new, _ = t.train_step(state, dev)
        before = t.placed.copy_to_devices(start)
        moved[scale] = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b),
                                    (new.params, new.embeddings[0].values),
                                    (before.params, before.embeddings[0].values))
    for full, quarter in zip(jax.tree.leaves(moved[1.0]), jax.tree.leaves(moved[0.25])):
        # (w + d) - w carries the rounding of w (~3e-8 for |w| ~ 0.3)
        assert np.abs(full).max() > 1e-4
        np.testing.assert_allclose(quarter, 0.25 * full, rtol=1e-4, atol=1e-6)


def test_plateau_and_early_stopping_resume_exactly(tiny, tmp_path):
    cfg = epoch_config(tiny, tmp_path, num_epochs=2, snapshot=2 * STEPS_PER_EPOCH,
                       lr_policy="plateau", early_stopping={"patience": 3})
    t = Trainer.from_config(cfg)
    scripted(t, [0.7, 0.6])
    t.fit()
    resumed = Trainer.from_config(cfg)
    resumed.restore_checkpoint()
    assert float(resumed.state.lr_scale) == pytest.approx(0.1)
    assert resumed.judge.plateau.state_dict() == t.judge.plateau.state_dict()
    assert resumed.judge.early_stopping.state_dict() == {"best": 0.7, "best_iter": 8, "wait": 1}


def test_test_sets_are_scored_apart_after_training(tiny, tmp_path):
    cfg = epoch_config(tiny, tmp_path, num_epochs=1)
    data = cfg["layers"][0]
    data["test_source"] = {"same_as_validation": data["eval_source"], "train": data["source"]}
    t = Trainer.from_config(cfg)
    t.fit()
    history = t.history
    tests = {h["set"]: h for h in history if h["kind"] == "test"}
    assert set(tests) == {"same_as_validation", "train"}
    val = [h for h in history if h["kind"] == "eval"][-1]
    assert tests["same_as_validation"]["AUC"] == val["AUC"]
    assert tests["train"]["AUC"] == t.evaluate(data=data["source"])["AUC"]
    assert history[-1]["kind"] == "test"


def test_same_config_and_seed_give_bit_identical_losses(tiny, tmp_path):
    runs = []
    for _ in range(2):
        t = Trainer.from_config(epoch_config(tiny, tmp_path, num_epochs=1))
        t.fit()
        history = t.history
        runs.append(([h["loss"] for h in history if h["kind"] == "train"],
                     t.placed.copy_to_host(t.state.params)))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == STEPS_PER_EPOCH
    assert leaves_equal(*[jax.tree.map(lambda h: list(h.shards.values()), r[1],
                                       is_leaf=lambda x: hasattr(x, "shards")) for r in runs])


def test_best_weights_come_back_on_a_mesh(tiny, tmp_path):
    """Tables split over 4 devices: the host copy holds every shard and puts each back."""
    cfg = epoch_config(tiny, tmp_path, num_epochs=3, gpu=[0, 1, 2, 3],
                       snapshot=STEPS_PER_EPOCH, early_stopping={"patience": 2})
    t = Trainer.from_config(cfg)
    scripted(t, [0.72, 0.70, 0.70])
    placed_as = t.state.embeddings[0].values.sharding
    t.fit()
    assert int(t.state.step) == STEPS_PER_EPOCH
    assert t.state.embeddings[0].values.sharding == placed_as
    ckpt = Checkpointer(cfg["solver"]["snapshot_prefix"] + "checkpoints")
    saved, _, _ = restore_snapshot(ckpt, t.cfg, t.step_config, Trainer.from_config(cfg).state,
                                   t.placements, STEPS_PER_EPOCH, keep_positions=False)
    assert same_model(t.state, saved)


def test_early_stopping_saves_the_restored_best_and_export_takes_it(tiny, tmp_path, capsys):
    """The best evaluation (iter 8) is no snapshot step: after the restore the run writes one,
    keeps it past the rotation (snapshot_keep 1), names it in best.json; export takes it and
    the final line shows its figures, not the last evaluation's."""
    import json

    from jctr.serving.export import main as export_main

    cfg = epoch_config(tiny, tmp_path, num_epochs=4, snapshot=2 * STEPS_PER_EPOCH,
                       snapshot_keep=1, early_stopping={"patience": 2})
    t = Trainer.from_config(cfg)
    scripted(t, [0.72, 0.70, 0.69, 0.68])
    t.fit()
    assert int(t.state.step) == STEPS_PER_EPOCH
    ckpt = Checkpointer(cfg["solver"]["snapshot_prefix"] + "checkpoints")
    assert ckpt.steps() == [STEPS_PER_EPOCH, 3 * STEPS_PER_EPOCH] or \
        ckpt.steps() == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    assert ckpt.best() == {"step": STEPS_PER_EPOCH, "metric": "AUC", "value": 0.72}
    saved, _, _ = restore_snapshot(ckpt, t.cfg, t.step_config, Trainer.from_config(cfg).state,
                                   t.placements, STEPS_PER_EPOCH, keep_positions=False)
    assert same_model(t.state, saved)
    out = capsys.readouterr()
    final = [x for x in (out.out + out.err).splitlines() if "[jctr] done:" in x][-1]
    assert f"restored best (iter {STEPS_PER_EPOCH}): validation AUC 0.72000" in final, final
    bundle = tmp_path / "bundle"
    assert export_main(["--checkpoint", ckpt.directory, "--output", str(bundle)]) == 0
    err = capsys.readouterr().err
    assert f"exporting the checkpoint of iter {STEPS_PER_EPOCH} (early stopping's best" in err
    assert json.loads((bundle / "manifest.json").read_text())["step"] == STEPS_PER_EPOCH


def test_shuffling_a_file_larger_than_memory_is_refused_before_training(tiny, monkeypatch):
    """A seeded epoch permutes each unit's records in memory: a Norm file read whole and its
    permuted copy, twice its size. A 30 GB file on a 24 GB machine was a process killed at
    its first epoch; now the largest unit's need is checked with the files' headers before
    the first step (``RunData.check``, ``Dataset.check_units``) and refused, naming the
    file, its need and what is to spare."""
    import os
    import re

    from jctr.data.records import DataError
    from jctr.train import datasets

    cfg = tiny(max_iter=2, display=1, eval_interval=10**6, eval_batches=1)
    cfg["layers"][0]["shuffle"] = True
    t = Trainer.from_config(cfg)
    t.data.train.check_units()
    need, unit = t.data.train.shuffle_need
    size = os.path.getsize(unit)  # a Norm file: its header, then its records
    assert 2 * (size - 1024) <= need <= 2 * size
    monkeypatch.setattr(datasets, "room_left", lambda reserve=0: need - 1)
    with pytest.raises(DataError, match=re.escape(unit) + r": shuffling it .* holds its "
                       r"records and their permuted copy, [0-9.]+ [KMG]iB, in memory, and "
                       r".* are to spare beside the training step: split it into smaller "
                       r"files, or set shuffle to false"):
        t.fit()
    monkeypatch.setattr(datasets, "room_left", lambda reserve=0: need)
    assert t.fit().iterations == 2
