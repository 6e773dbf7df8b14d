"""Checkpoints: exact resume, crash safety, clear errors, model files."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jctr.checkpoint import Checkpointer, CheckpointError
from jctr.checkpoint.model_files import (
    ModelFileError,
    dense_weights,
    load_dense_model,
    non_trainable,
    read_sparse_model,
)
from jctr.train.trainer import Trainer
from tests.conftest import ROOT, tiny_config


def _losses(history, after=0):
    return {h["iter"]: h["loss"] for h in history if h["kind"] == "train" and h["iter"] > after}


def _cfg(tmp_path, model="dlrm", **solver):
    base = dict(max_iter=30, display=1, eval_interval=10_000, eval_batches=4,
                snapshot_prefix=str(tmp_path / "run_"))
    base.update(solver)
    return tiny_config(tmp_path, model, **base)


@pytest.mark.parametrize("model", ["dlrm", "deepfm"])
def test_resume_is_exact(tmp_path, model):
    # DeepFM adds dropout (RNG), AdaGrad embeddings and a second table; Adam dense state
    full = Trainer.from_config(_cfg(tmp_path, model))
    full.fit()
    reference = _losses(full.history)
    first = Trainer.from_config(_cfg(tmp_path, model, max_iter=13, snapshot=13))
    first.fit()
    resumed = Trainer.from_config(_cfg(tmp_path, model))
    assert resumed.restore_checkpoint() == 13
    resumed.fit()
    got = _losses(resumed.history, after=13)
    assert sorted(got) == list(range(14, 31))
    for it, loss in got.items():
        assert loss == reference[it], (it, loss, reference[it])


def test_resume_after_sigkill_at_a_random_step(tmp_path):
    cfg = _cfg(tmp_path, max_iter=40, snapshot=5)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    ref = Trainer.from_config(_cfg(tmp_path, max_iter=40))
    ref.fit()
    reference = _losses(ref.history)
    # after the second snapshot has started, which first waits for the asynchronous save of
    # the first: some checkpoint is always complete when the process dies
    kill_at = random.Random(os.getpid()).randint(11, 30)
    proc = subprocess.Popen([sys.executable, "-m", "jctr.train", "--config", str(path)],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if line.startswith(f"[jctr] iter {kill_at}/"):
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    resumed = Trainer.from_config(cfg)
    step = resumed.restore_checkpoint()
    assert step % 5 == 0 and 5 <= step <= kill_at
    resumed.fit()
    got = _losses(resumed.history, after=step)
    assert sorted(got) == list(range(step + 1, 41))
    for it, loss in got.items():
        assert loss == reference[it], (it, loss, reference[it])


_SAVER = r"""
import sys, jax
import jctr
from jctr.train.trainer import Trainer
from tests.conftest import tiny_config
import pathlib
cfg = tiny_config(pathlib.Path(sys.argv[1]), "dlrm", max_iter=2, display=1000,
                  eval_interval=1000, snapshot_prefix=sys.argv[1] + "/run_")
# a big table so that a save takes a while
cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = 2_000_000
t = Trainer.from_config(cfg)
t.fit()
t.save_checkpoint(); t.checkpoints.wait()
print("first", int(t.state.step), flush=True)
# fill many rows so the second save writes a lot
from jctr.sharding.rows import import_table
import numpy as np
es = import_table(t.specs[0], t.state.embeddings[0],
                  {"keys": np.arange(10**9, 10**9 + 1_500_000, dtype=np.int64),
                   "values": np.ones((1_500_000, t.specs[0].dim), np.float32)})
t.state = t.state._replace(step=t.state.step + 1, embeddings=(es,))
print("saving", flush=True)
t.save_checkpoint(); t.checkpoints.wait()
print("done", flush=True)
"""


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = None
    try:
        for line in proc.stdout:
            if line.startswith("first"):
                first = int(line.split()[1])
            if line.startswith("saving"):
                time.sleep(0.3)
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=300)
    assert first == 2
    ckpt = Checkpointer(str(tmp_path / "run_checkpoints"))
    steps = ckpt.steps()
    # killed mid-save: the partial step is invisible and the previous one loads
    assert steps[0] == 2 and steps[-1] in (2, 3)
    t = Trainer.from_config(tiny_config(tmp_path, "dlrm", max_iter=2,
                                        snapshot_prefix=str(tmp_path / "run_")))
    assert t.restore_checkpoint(step=2) == 2


def test_corrupted_checkpoint_names_the_path(tmp_path):
    t = Trainer.from_config(_cfg(tmp_path, max_iter=4, snapshot=4, display=100))
    t.fit()
    step_dir = tmp_path / "run_checkpoints" / "4"
    victims = [p for p in (step_dir / "dense").rglob("*") if p.is_file() and p.stat().st_size]
    for p in victims:
        p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 3)])
    fresh = Trainer.from_config(_cfg(tmp_path, max_iter=4))
    with pytest.raises(CheckpointError, match=r"/4/dense/\S+: damaged checkpoint file"):
        fresh.restore_checkpoint()
    # the integrity record is part of every sealed checkpoint: its absence is named too
    os.remove(step_dir / "jctr_integrity.json")
    with pytest.raises(CheckpointError, match=r"/4/jctr_integrity.json: missing"):
        fresh.restore_checkpoint()
    (step_dir / "meta" / "metadata").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"meta/metadata: checkpoint metadata unreadable"):
        fresh.restore_checkpoint()
    empty = Checkpointer(str(tmp_path / "nothing"))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        empty.restore(fresh.state, fresh.specs)


def test_model_files_round_trip_and_warm_start(tmp_path):
    t = Trainer.from_config(_cfg(tmp_path, "deepfm", max_iter=20, display=100))
    t.fit()
    paths = t.save_model_files(str(tmp_path / "files" / "m_"))
    dense_path, bn_path, *sparse = paths
    assert os.path.getsize(dense_path) == 4 * dense_weights(t.network()).size
    for spec, es, path in zip(t.specs, t.state.embeddings, sparse):
        keys, vectors = read_sparse_model(path, spec.dim)
        assert keys.size == int(es.table.size)
        from jctr.embedding.hash_table import export_items

        k2, rows = export_items(es.table)
        np.testing.assert_array_equal(keys, k2)
        np.testing.assert_array_equal(vectors, np.asarray(es.values)[rows])
    cfg = _cfg(tmp_path, "deepfm", max_iter=20)
    cfg["solver"]["dense model_file"] = dense_path
    cfg["solver"]["sparse_model_file"] = sparse
    warm = Trainer.from_config(cfg)
    np.testing.assert_array_equal(dense_weights(warm.network()), dense_weights(t.network()))
    batch = next(iter(t.data.eval.batches(512, epochs=1)))
    np.testing.assert_allclose(warm.predict(batch), t.predict(batch), rtol=1e-6)
    with open(dense_path, "ab") as f:
        f.write(b"\0\0\0\0")
    with pytest.raises(ModelFileError, match="dense model file holds"):
        load_dense_model(dense_path, t.network())


def test_batchnorm_json_matches_the_state(tmp_path):
    cfg = _cfg(tmp_path, "dcn", max_iter=10, snapshot=10, display=100)
    layers = cfg["layers"]
    i = next(k for k, layer in enumerate(layers) if layer.get("name") == "fc1")
    layers.insert(i + 1, {"name": "bn1", "type": "BatchNorm", "bottom": "fc1", "top": "bn1",
                          "bn_param": {"factor": 0.1, "eps": 1e-5}})
    layers[i + 2]["bottom"] = "bn1"
    t = Trainer.from_config(cfg)
    t.fit()
    path = tmp_path / "run_checkpoints" / "non_trainable_10.json"
    data = json.loads(path.read_text())
    from jctr.models.layers import BatchNorm

    mods = [m for m in t.network().layers if isinstance(m, BatchNorm)]
    assert len(data["layers"]) == 1 and data["layers"][0]["type"] == "BatchNorm"
    np.testing.assert_allclose(data["layers"][0]["mean"], np.asarray(mods[0].mean[...]),
                               rtol=1e-6)
    np.testing.assert_allclose(data["layers"][0]["var"], np.asarray(mods[0].var[...]),
                               rtol=1e-6)
    assert not np.allclose(data["layers"][0]["var"], 1.0)  # statistics were collected
    assert data == non_trainable(t.network())


def test_tables_restore_into_another_capacity(tmp_path):
    """Tables are stored by key: a table of another size (another device count) loads them."""
    t = Trainer.from_config(_cfg(tmp_path, max_iter=10, snapshot=10, display=100))
    t.fit()
    cfg = _cfg(tmp_path, max_iter=10)
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] *= 3
    bigger = Trainer.from_config(cfg)
    bigger.restore_checkpoint()
    assert bigger.specs[0].capacity == 3 * t.specs[0].capacity
    batch = next(iter(t.data.eval.batches(512, epochs=1)))
    np.testing.assert_allclose(bigger.predict(batch), t.predict(batch), rtol=1e-6)


def test_cli_resume(tmp_path):
    cfg = _cfg(tmp_path, max_iter=12, snapshot=6, display=6)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    run = [sys.executable, "-m", "jctr.train", "--config", str(path)]
    first = subprocess.run(run + ["--max-iter", "6"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    second = subprocess.run(run + ["--resume"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr
    assert "resumed from iter 6" in second.stderr and "iter 12/12" in second.stderr
    assert "iter 6/12" not in second.stderr


def _at_step(t: Trainer, step: int, dtype=None) -> None:
    """Move ``t``'s state to iteration ``step`` (a run that has trained that long), its
    count of the state's own type unless ``dtype``."""
    import jax

    count = np.asarray(step, dtype or t.state.step.dtype)
    t.state = t.state._replace(step=jax.device_put(count, t.state.step.sharding))


def test_a_run_trains_past_two_to_the_31_iterations_and_resumes(tmp_path):
    """The iteration count was int32: at 2**31 updates (~8 months at 100 steps a second; a
    streaming run resumed day after day gets there) it wrapped, the warm-up schedule's
    ``t <= warmup_steps`` held for the negative count and gave a negative learning rate
    (gradient ascent), and the snapshots' folders, named by the count, sorted the newest
    last-but-old (resume picked an old one; ``keep`` removed the new ones). A run moved to
    just below 2**31 trains on with the losses a run at iteration 10**6 has on the same
    batches (both past warm-up, no decay; the dropout key folds the count's low 32 bits),
    its snapshots are named by the true count and the newest resumes; a snapshot written
    with the old int32 count still restores."""
    near, far = 2**31 - 4, 10**6
    losses = []
    for start in (near, far):
        t = Trainer.from_config(_cfg(tmp_path, max_iter=start + 6, snapshot=2, display=1,
                                     snapshot_prefix=str(tmp_path / f"run{start}_")))
        _at_step(t, start)
        summary = t.fit()
        assert summary.step == start + 6 and t.state.step.dtype == np.int64
        losses.append([h["loss"] for h in t.history if h["kind"] == "train"])
    assert losses[0] == losses[1]
    ckpt = Checkpointer(str(tmp_path / f"run{near}_checkpoints"))
    assert ckpt.steps()[-2:] == [near + 4, near + 6]  # 2**31 and past it, newest last
    resumed = Trainer.from_config(_cfg(tmp_path, max_iter=near + 8,
                                       snapshot_prefix=str(tmp_path / f"run{near}_")))
    assert resumed.restore_checkpoint() == near + 6
    assert resumed.fit().step == near + 8
    # a snapshot saved by a jctr whose count was int32 restores as the 64-bit count
    old = Trainer.from_config(_cfg(tmp_path, max_iter=12, snapshot=12,
                                   snapshot_prefix=str(tmp_path / "old_")))
    old.fit(10)
    _at_step(old, 11, np.int32)
    old.save_checkpoint()
    old.checkpoints.finish()
    back = Trainer.from_config(_cfg(tmp_path, max_iter=12,
                                    snapshot_prefix=str(tmp_path / "old_")))
    assert back.restore_checkpoint() == 11 and back.state.step.dtype == np.int64
    assert back.fit().step == 12


def test_ctrl_c_while_a_save_starts_is_an_interrupt_not_a_failed_save(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) landing while a snapshot's save starts was reported as a failed
    save ("snapshot of iter 3 not written (KeyboardInterrupt: )", exit 2, as for a full disk):
    ``Checkpointer.save`` wrapped every exception in a CheckpointError. It now removes the
    snapshot and lets the interrupt go on (exit 130 "interrupted" from the command), as its
    ``wait`` already did; a real failure is still a CheckpointError naming the folder. Found
    by signalling ``python -m jctr.train`` 0-50 ms after its iteration line, 24 times: 5
    exits with status 2."""
    from orbax.checkpoint import args as ocp_args

    from jctr.errors import Terminated

    t = Trainer.from_config(_cfg(tmp_path, max_iter=4, snapshot=100, display=100))
    t.fit(2)
    real = ocp_args.Composite
    for raised, expected in ((KeyboardInterrupt(), KeyboardInterrupt),
                             (Terminated(), Terminated),
                             (OSError(28, "No space left on device"), CheckpointError)):
        def interrupted(*a, _e=raised, **k):
            raise _e

        monkeypatch.setattr(ocp_args, "Composite", interrupted)
        with pytest.raises(expected):
            t.save_checkpoint()
        assert os.listdir(tmp_path / "run_checkpoints" / ".pending") == []
    monkeypatch.setattr(ocp_args, "Composite", real)
    t.save_checkpoint()
    t.checkpoints.finish()
    assert Checkpointer(str(tmp_path / "run_checkpoints")).steps() == [2]
