"""Runs that end badly -- another run's checkpoints, locks, full disks, damaged checkpoints,
changed configs, diverging losses, signals, misused export and predict -- never lose a model
and always end with one clear line."""

import json
import os
import random
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from jctr.checkpoint import Checkpointer
from jctr.train.cli import main
from jctr.train.trainer import Trainer
from tests.conftest import ROOT, xla_flags
from tests.faults.harness import (
    PY,
    error_line,
    run_cli,
    run_main,
    small_config,
    tree_digest,
    write_config,
)


def _train(tmp, capsys, *flags, status=0, **solver):
    path = write_config(tmp, small_config(tmp, **solver))
    return run_main(main, ["--config", path, *flags], capsys, status=status)


def _ckpt(tmp):
    return Checkpointer(str(tmp / "runs" / "checkpoints"))


# ---- who owns a snapshot prefix ----------------------------------------------------------


def test_fresh_run_into_another_runs_checkpoints(tmp_path, capsys):
    _train(tmp_path, capsys, snapshot=2)
    before = tree_digest(tmp_path / "runs")
    err = _train(tmp_path, capsys, status=2, snapshot=2)
    error_line(err, r"runs/checkpoints: holds checkpoints of another run \(iters 2, 4\); "
                    r"continue that run with --resume")
    assert "[jctr] iter" not in err
    assert tree_digest(tmp_path / "runs") == before


def test_force_replaces_them_after_the_first_snapshot(tmp_path, capsys):
    _train(tmp_path, capsys, snapshot=2, max_iter=6)
    assert _ckpt(tmp_path).steps() == [2, 4, 6]
    err = _train(tmp_path, capsys, "--force", snapshot=3, max_iter=3)
    assert "will be replaced by this run's first snapshot" in err
    ckpt = _ckpt(tmp_path)
    assert ckpt.steps() == [3] and ckpt.lock_owner() is None
    assert sorted(os.listdir(tmp_path / "runs/checkpoints")) == [".pending", "3",
                                                                 "non_trainable_3.json"]


def test_resume_continues_and_replaces_nothing_else(tmp_path, capsys):
    _train(tmp_path, capsys, snapshot=2)
    err = _train(tmp_path, capsys, "--resume", snapshot=2, max_iter=8)
    assert "resumed from iter 4" in err and "iter 8/8" in err
    assert _ckpt(tmp_path).steps() == [4, 6, 8]


def _lock(tmp, pid, host=None):
    d = tmp / "runs" / "checkpoints"
    d.mkdir(parents=True, exist_ok=True)
    (d / "LOCK").write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                        "started": time.time() - 60, "run": "other"}))


@pytest.mark.parametrize("flags", [[], ["--resume"]])
def test_a_live_run_holds_the_prefix(tmp_path, capsys, flags):
    other = subprocess.Popen(["sleep", "120"])
    try:
        _lock(tmp_path, other.pid)
        if flags:  # something to resume, written before the other run took the prefix
            (tmp_path / "runs/checkpoints/LOCK").rename(tmp_path / "lock.json")
            _train(tmp_path, capsys, snapshot=4)
            (tmp_path / "lock.json").rename(tmp_path / "runs/checkpoints/LOCK")
        before = tree_digest(tmp_path / "runs")
        err = _train(tmp_path, capsys, *flags, status=2, snapshot=2)
        error_line(err, rf"runs/checkpoints: in use by another run \(pid {other.pid} on host "
                        rf"{socket.gethostname()}, since .*\); wait for it")
        assert tree_digest(tmp_path / "runs") == before
    finally:
        other.kill()
        other.wait()


def test_a_lock_on_another_host_is_respected(tmp_path, capsys):
    _lock(tmp_path, 1, host="elsewhere.example")
    err = _train(tmp_path, capsys, status=2, snapshot=2)
    error_line(err, r"in use by another run \(pid 1 on host elsewhere\.example")


def test_a_stale_lock_and_an_unfinished_snapshot_are_reported_and_cleaned(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    _lock(tmp_path, dead.pid)
    pending = tmp_path / "runs/checkpoints/.pending/6"
    pending.mkdir(parents=True)
    (pending / "half_written").write_bytes(b"x" * 100)
    err = _train(tmp_path, capsys, snapshot=2)
    assert f"(pid {dead.pid} on host" in err and "is gone; taking over its lock" in err
    assert "removing the unfinished snapshot .pending/6" in err
    assert _ckpt(tmp_path).steps() == [2, 4] and not pending.exists()


# ---- where a run cannot write -------------------------------------------------------------


def test_snapshot_prefix_under_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("keep me")
    err = _train(tmp_path, capsys, status=2, snapshot=2,
                 snapshot_prefix=str(tmp_path / "afile" / "run_"))
    error_line(err, r"afile/run_checkpoints: cannot create the checkpoint directory: Not a "
                    r"directory")
    assert "[jctr] iter" not in err and (tmp_path / "afile").read_text() == "keep me"


def test_log_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "log").write_text("keep me")
    err = _train(tmp_path, capsys, status=2, log_dir=str(tmp_path / "log"))
    error_line(err, r"solver\.log_dir: .*/log exists and is not a folder")
    assert "[jctr] iter" not in err and (tmp_path / "log").read_text() == "keep me"


def test_a_second_run_into_a_log_folder_is_refused_unless_resumed_or_forced(tmp_path, capsys):
    logs = tmp_path / "logs"
    _train(tmp_path, capsys, log_dir=str(logs), max_iter=4, snapshot=4)
    first = (logs / "metrics.jsonl").read_text()
    err = _train(tmp_path, capsys, status=2, log_dir=str(logs), max_iter=4,
                 snapshot_prefix=str(tmp_path / "second_"))
    error_line(err, r"solver\.log_dir: .*/logs/metrics.jsonl holds another run's log; continue "
                    r"that run with --resume, give another --log-dir, or pass --force")
    assert (logs / "metrics.jsonl").read_text() == first
    # --resume continues the same run's log
    _train(tmp_path, capsys, "--resume", log_dir=str(logs), max_iter=6, snapshot=4)
    resumed = (logs / "metrics.jsonl").read_text()
    assert resumed.startswith(first) and len(resumed) > len(first)
    # --force starts a new log; the old run's files are kept aside
    err = _train(tmp_path, capsys, "--force", log_dir=str(logs), max_iter=4,
                 snapshot_prefix=str(tmp_path / "third_"))
    assert f"--force: the previous run's log files are in {logs / 'previous-1'}" in err
    assert (logs / "previous-1" / "metrics.jsonl").read_text() == resumed
    assert (logs / "previous-1" / "tensorboard").is_dir()
    starts = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()
              if '"kind": "start"' in x]
    assert len(starts) == 1


def test_sources_that_are_devices_or_not_lists_and_resume_below_the_checkpoint(tmp_path,
                                                                               capsys):
    _train(tmp_path, capsys, max_iter=2)  # writes the data
    cfg = small_config(tmp_path, max_iter=2)
    cfg["layers"][0]["source"] = "/dev/zero"
    err = run_main(main, ["--config", write_config(tmp_path, cfg)], capsys, status=2)
    error_line(err, r"/dev/zero: not a regular file \(a folder or a device\); a source is a "
                    r"file list")
    # a data file given where the list belongs
    cfg["layers"][0]["source"] = str(sorted((tmp_path / "data" / "train").glob("*.data"))[0])
    err = run_main(main, ["--config", write_config(tmp_path, cfg)], capsys, status=2)
    error_line(err, r"\.data: (not a text file list|line 1: expected the number of files)")
    # --resume with --max-iter at or below the checkpoint: nothing to train, said so
    _train(tmp_path, capsys, max_iter=6, snapshot=6, snapshot_prefix=str(tmp_path / "r_"))
    err = _train(tmp_path, capsys, "--resume", "--max-iter", "4", status=2, max_iter=6,
                 snapshot=6, snapshot_prefix=str(tmp_path / "r_"))
    error_line(err, r"solver\.max_iter: 4, but the state is at iteration 6 already \(resumed "
                    r"from a checkpoint\): nothing to train")


def test_a_missing_optional_package_names_its_extra(capsys):
    from jctr.errors import run_command

    def needs_uvicorn():
        raise ModuleNotFoundError("No module named 'uvicorn'", name="uvicorn")

    assert run_command(needs_uvicorn) == 2
    assert ('this command needs the Python package \'uvicorn\', which comes with jctr\'s '
            '"serving" extra: pip install "jctr[serving]"') in capsys.readouterr().err
    assert run_command(lambda: __import__("jctr_no_such_module")) == 1
    assert "internal error (ModuleNotFoundError" in capsys.readouterr().err


def test_a_damaged_metrics_log_is_a_clear_report_error(tmp_path, capsys):
    from jctr.train.report import main as report_main

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_bytes(b'{"kind": "start", "iter": 0}\n{"kind": "tr\xff"}\n')
    err = run_main(report_main, [str(logs)], capsys, status=2)
    error_line(err, r"metrics.jsonl: line 2: byte 13 is not UTF-8 text")


def _in_tmpfs(tmp, size: str, args: list[str]) -> subprocess.CompletedProcess:
    """Run ``python -m jctr.train args`` with a tmpfs of ``size`` mounted at tmp/disk, in a
    mount namespace of its own (nothing to unmount afterwards)."""
    disk = tmp / "disk"
    disk.mkdir()
    cmd = (f"mount -t tmpfs -o size={size} tmpfs {disk} && cd {ROOT} && "
           f"exec {PY} -m jctr.train " + " ".join(args))
    return subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True,
                          timeout=300)


def test_disk_too_small_for_one_snapshot(tmp_path, capsys):
    cfg = write_config(tmp_path, small_config(tmp_path, snapshot=2,
                                              snapshot_prefix=str(tmp_path / "disk/run_")))
    out = _in_tmpfs(tmp_path, "256k", ["--config", cfg])
    assert out.returncode == 2, out.stderr[-2000:]
    error_line(out.stderr, r"disk/run_checkpoints: 2\d\d\.\d\d KiB free, but one snapshot may need "
                           r"up to (9\d\d\.\d\d KiB|1\.\d+ MiB)")
    assert "[jctr] iter" not in out.stderr


def test_disk_full_during_a_snapshot_keeps_the_earlier_ones(tmp_path):
    cfg = small_config(tmp_path, snapshot=2, max_iter=40, snapshot_keep=10,
                       snapshot_prefix=str(tmp_path / "disk/run_"))
    out = _in_tmpfs(tmp_path, "1200k", ["--config", write_config(tmp_path, cfg)])
    assert out.returncode == 2, out.stderr[-2000:]
    error_line(out.stderr, r"snapshot of iter \d+ not written \(No space left on device\); "
                           r"the earlier checkpoints are kept")
    # the tmpfs is gone with its namespace: what was sealed was reported before the failure
    sealed = [line for line in out.stderr.splitlines() if "] snapshot of iter" in line]
    assert sealed, out.stderr[-2000:]


# ---- damaged checkpoints and changed configs ------------------------------------------------


def test_damaged_byte_is_named_on_resume(tmp_path, capsys):
    _train(tmp_path, capsys, snapshot=4)
    victim = max((p for p in (tmp_path / "runs/checkpoints/4/rows").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    err = _train(tmp_path, capsys, "--resume", status=2, snapshot=4, max_iter=8)
    error_line(err, rf"{victim.name}: damaged checkpoint file \(checksum mismatch\)")


def test_resume_without_integrity_record(tmp_path, capsys):
    _train(tmp_path, capsys, snapshot=4)
    os.remove(tmp_path / "runs/checkpoints/4/jctr_integrity.json")
    err = _train(tmp_path, capsys, "--resume", status=2, max_iter=8)
    error_line(err, r"checkpoints/4/jctr_integrity\.json: missing")


def test_resume_with_another_model_names_the_fields(tmp_path, capsys):
    _train(tmp_path, capsys, snapshot=4)
    cfg = small_config(tmp_path, max_iter=8)
    cfg["layers"][2]["fc_param"]["num_output"] = 32
    cfg["layers"][1]["sparse_embedding_hparam"]["combiner"] = 1
    err = run_main(main, ["--config", write_config(tmp_path, cfg), "--resume"], capsys,
                   roots=(tmp_path / "runs",))
    error_line(err, r"checkpoints: the checkpoint was written with another model \(2 field\(s\) "
                    r"differ, checkpoint -> config\): .*combiner: 'sum' -> 'mean'.*"
                    r"layers\[2\] \"bot_fc1\"\.params\.num_output: 64 -> 32")
    assert "Orbax" not in err and len(err.splitlines()) < 12


def test_resume_with_another_learning_rate_is_allowed_and_said(tmp_path, capsys):
    _train(tmp_path, capsys, snapshot=4)
    cfg = small_config(tmp_path, max_iter=6)
    cfg["optimizer"]["sgd_hparam"]["learning_rate"] = 0.1
    err = run_main(main, ["--config", write_config(tmp_path, cfg), "--resume"], capsys,
                   status=0)
    assert "resuming with changed settings (checkpoint -> config): " \
           "optimizer.learning_rate: 0.5 -> 0.1" in err


def test_resume_with_nothing_to_resume(tmp_path, capsys):
    err = _train(tmp_path, capsys, "--resume", status=2)
    error_line(err, r"runs/checkpoints: no complete checkpoint found")


# ---- losses that stop being numbers -----------------------------------------------------------


def _diverging(tmp, **solver):
    cfg = small_config(tmp, display=1, max_iter=30, **solver)
    cfg["optimizer"]["sgd_hparam"].update(learning_rate=1e30, warmup_steps=0)
    return write_config(tmp, cfg)


def test_non_finite_loss_stops_before_saving_the_bad_state(tmp_path, capsys):
    err = run_main(main, ["--config", _diverging(tmp_path, snapshot=1)], capsys,
                   pattern=r"training loss is nan at iter (\d+): the run stopped and saved "
                           r"nothing of this state \(the last checkpoint \(iter \d+\) is kept|"
                           r"no checkpoint was written")
    bad = int(err.split("training loss is nan at iter ")[1].split(":")[0])
    ckpt = _ckpt(tmp_path)
    assert all(step < bad for step in ckpt.steps())
    fresh = Trainer.from_config(json.loads((tmp_path / "cfg.json").read_text()))
    for step in ckpt.steps():
        state, _ = ckpt.restore(fresh.state, fresh.specs, step)
        leaves = [np.asarray(x) for x in __import__("jax").tree.leaves(state.params)]
        assert all(np.isfinite(x).all() for x in leaves), step


def test_skip_policy_trains_through_bad_batches(tmp_path, capsys):
    err = run_main(main, ["--config", _diverging(tmp_path), "--nan-policy", "skip",
                          "--log-dir", str(tmp_path / "log")], capsys, status=0)
    summary = [json.loads(x) for x in (tmp_path / "log/metrics.jsonl").read_text().splitlines()
               if '"summary"' in x][0]
    assert summary["skipped_nonfinite"] > 0 and "non-finite batches skipped" in err


# ---- signals: a snapshot in flight is finished or removed -------------------------------------


_SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def _big_table_config(tmp):
    cfg = small_config(tmp, snapshot=3, max_iter=200, display=1, snapshot_keep=100)
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = 3_000_000
    return write_config(tmp, cfg)


@pytest.mark.parametrize("sig,status,seed", [(signal.SIGINT, 130, 0), (signal.SIGTERM, 143, 1),
                                             (signal.SIGINT, 130, 2)])
def test_signal_at_a_random_step_or_mid_save(tmp_path, sig, status, seed):
    cfg = _big_table_config(tmp_path)
    stop_at = random.Random(seed).choice([3, 4, 6, 7])  # 3 and 6: a save has just started
    # a shell's background job starts with SIGINT ignored; the user's terminal would not. Set
    # back in a first program that then becomes the run (exec keeps a default disposition):
    # a preexec_fn would run Python in a fork of this multithreaded process (JAX's threads),
    # which can deadlock before the exec
    proc = subprocess.Popen([PY, "-c", _SIGINT_DEFAULT, "-m", "jctr.train", "--config", cfg],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith(f"[jctr] iter {stop_at}/"):
                proc.send_signal(sig)
                break
        lines += proc.stderr.readlines()
    finally:
        proc.wait(timeout=300)
    err = "".join(lines)
    assert proc.returncode == status, err[-3000:]
    assert "Traceback" not in err and ("interrupted" in err or "terminated" in err)
    ckpt = _ckpt(tmp_path)
    assert os.listdir(tmp_path / "runs/checkpoints/.pending") == []  # nothing half-written
    assert ckpt.lock_owner() is None
    reported = {int(x.split("snapshot of iter ")[1].split()[0]) for x in lines
                if "] snapshot of iter" in x}
    assert set(ckpt.steps()) == reported
    fresh = Trainer.from_config(json.loads(open(cfg).read()))
    for step in ckpt.steps():
        ckpt.restore(fresh.state, fresh.specs, step)  # verified and loadable


# ---- export -------------------------------------------------------------------------------


@pytest.fixture
def trained(tmp_path, capsys):
    _train(tmp_path, capsys, snapshot=4)
    return tmp_path


def _export(tmp, output, capsys, status=0, pattern=None, roots=()):
    from jctr.export import main as export

    return run_main(export, ["--checkpoint", str(tmp / "runs/checkpoints"), "--output", output],
                    capsys, status=status, pattern=pattern, roots=roots)


def test_export_refuses_the_checkpoint_parent(trained, capsys):
    _export(trained, str(trained / "runs"), capsys, status=2, roots=(trained / "runs",),
            pattern=r"runs: holds 1 entries \(checkpoints\) that are not part of a jctr "
                    r"inference bundle")


def test_export_refuses_the_working_directory(trained, capsys, monkeypatch):
    monkeypatch.chdir(trained)
    _export(trained, ".", capsys, status=2, roots=(trained,),
            pattern=r"that are not part of a jctr inference bundle; export writes only into "
                    r"a new or empty folder")


def test_export_refuses_a_file(trained, capsys):
    (trained / "model.bin").write_bytes(b"mine")
    _export(trained, str(trained / "model.bin"), capsys, status=2, roots=(trained,),
            pattern=r"model\.bin: exists and is not a folder")


def test_export_into_empty_and_over_a_previous_bundle(trained, capsys):
    (trained / "bundle").mkdir()
    _export(trained, str(trained / "bundle"), capsys)
    first = (trained / "bundle/manifest.json").read_text()
    _export(trained, str(trained / "bundle"), capsys)
    assert (trained / "bundle/manifest.json").read_text() == first
    assert sorted(os.listdir(trained)) == sorted(["bundle", "cfg.json", "data", "runs"])
    (trained / "bundle" / "notes.txt").write_text("mine")
    _export(trained, str(trained / "bundle"), capsys, status=2, roots=(trained,),
            pattern=r"bundle: holds 1 entries \(notes\.txt\) that are not part of")


def test_export_from_nothing_and_of_a_missing_step(trained, capsys):
    from jctr.export import main as export

    run_main(export, ["--checkpoint", str(trained / "nothing"), "--output",
                      str(trained / "b")], capsys, pattern=r"nothing: no complete checkpoint")
    run_main(export, ["--checkpoint", str(trained / "runs/checkpoints"), "--output",
                      str(trained / "b"), "--step", "999"], capsys,
             pattern=r"no checkpoint for step 999; available: \[4\]")
    assert not (trained / "b").exists()


# ---- predict misuse -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("predict")
    t = Trainer.from_config(small_config(tmp, max_iter=2, snapshot=2))
    t.fit()
    bundle = str(tmp / "bundle")
    from jctr.serving import InferenceModel, export_bundle

    export_bundle(t.cfg, t.state, bundle, t.placements)
    batch = next(iter(t.data.eval.batches(64, epochs=1)))
    return t, InferenceModel.load(bundle), batch


MISUSE = {
    "float keys": (lambda b: b._replace(keys=(b.keys[0].astype(np.float64),)),
                   r"Batch\.keys\[0\] \(data1\): expected int values, got dtype float64"),
    "two key arrays": (lambda b: b._replace(keys=b.keys * 2, segments=b.segments * 2),
                       r"expected 1 sparse input\(s\) \(data1\), got 2 and 2"),
    "dense too narrow": (lambda b: b._replace(dense=b.dense[:, :12]),
                         r"Batch\.dense: expected shape \(64, 13\), got \(64, 12\)"),
    "keys of fewer slots": (lambda b: b._replace(keys=(b.keys[0][:-64],)),
                            r"Batch\.keys\[0\] \(data1\): expected shape \(512,\)"),
    "segments out of range": (lambda b: b._replace(segments=(b.segments[0] + 1000,)),
                              r"Batch\.segments\[0\] \(data1\): expected values in \[0, 512\]"),
    "labels as text": (lambda b: b._replace(label=b.label.astype(str)),
                       r"Batch\.label: expected float values"),
    "not a batch": (lambda b: tuple(b), r"expected a jctr Batch"),
}


@pytest.mark.parametrize("name", sorted(MISUSE))
@pytest.mark.parametrize("who", ["trainer", "bundle"])
def test_predict_refuses_a_batch_that_does_not_fit(model, name, who):
    from jctr.data.batch import BatchError

    trainer, bundle, batch = model
    spoil, pattern = MISUSE[name]
    predictor = trainer if who == "trainer" else bundle
    with pytest.raises(BatchError, match=pattern):
        predictor.predict(spoil(batch))


def test_predict_takes_int32_keys(model):
    trainer, bundle, batch = model
    narrow = batch._replace(keys=(batch.keys[0].astype(np.int32),))
    if int(batch.keys[0].max()) < 2**31:
        np.testing.assert_array_equal(bundle.predict(narrow), bundle.predict(batch))
        np.testing.assert_array_equal(trainer.predict(narrow), trainer.predict(batch))


# ---- several processes ----------------------------------------------------------------------


def test_two_processes_with_a_partial_device_list_are_refused(tmp_path):
    cfg = write_config(tmp_path, small_config(tmp_path))
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_local.sh"), "2", cfg],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ,
                              "XLA_FLAGS": xla_flags(2)})
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "gloo" not in out.stderr.lower()
    assert "solver.gpu: process 0 uses devices [0] of its 2; a multi-process run needs every " \
           "local device of every process: write [[0, 1], [0, 1]] (or --gpu \"0,1;0,1\")" \
           in out.stderr


def test_cli_errors_exit_nonzero_without_traceback_in_a_subprocess(tmp_path):
    cfg = small_config(tmp_path)
    cfg["solver"]["batchsize"] = 0
    run_cli(["--config", write_config(tmp_path, cfg)],
            pattern=r"solver\.batchsize: expected a positive integer, got 0")
    out = run_cli(["--config", write_config(tmp_path, cfg), "--debug"])
    assert "Traceback" in out.stderr  # --debug shows it


def test_a_check_failing_on_one_process_stops_every_process(tmp_path):
    """Process 0 alone owns the checkpoint folder; when it cannot, process 1 must not wait for
    it in a collective forever."""
    (tmp_path / "afile").write_text("keep me")
    cfg = small_config(tmp_path, snapshot=2, snapshot_prefix=str(tmp_path / "afile" / "run_"))
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_local.sh"), "2",
                          write_config(tmp_path, cfg)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ,
                              "XLA_FLAGS": xla_flags(1)})
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert "[p0] error: " in out.stderr and "cannot create the checkpoint directory" in out.stderr
    assert "[p1] error: process(es) [0] could not pass the checks before training; see their " \
           "messages" in out.stderr
    assert (tmp_path / "afile").read_text() == "keep me"


def test_resume_with_fewer_files_than_the_checkpoint_read(tmp_path, capsys):
    """``--resume`` after the file list lost files the checkpoint had reached was an internal
    IndexError ("please report it"); now the position and the file count are named (issue
    35), and nothing is written."""
    _train(tmp_path, capsys, snapshot=6, max_iter=6)  # 4 batches a file: stopped in file 2
    file_list = tmp_path / "data" / "train" / "_file_list.txt"
    lines = file_list.read_text().split()
    file_list.write_text(f"1\n{lines[1]}\n")
    before = tree_digest(tmp_path / "runs")
    err = _train(tmp_path, capsys, "--resume", status=2, snapshot=6, max_iter=8)
    error_line(err, r"resuming at file 2 \(record 512\) of epoch 1, where the checkpoint's "
                    r"reader stopped, but the data source now has 1 file\(s\)")
    assert tree_digest(tmp_path / "runs") == before


def test_a_table_beyond_the_address_space_limit_is_refused_with_the_figures(tmp_path):
    """Under ``ulimit -v`` a table that cannot be mapped failed anywhere: an internal
    MemoryError, a thread that could not start, even a NaN loss from a half-made state (issue
    35). The memory plan now counts the address-space limit and refuses with the figures."""
    cfg = small_config(tmp_path)
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = 100_000_000
    path = write_config(tmp_path, cfg)
    out = subprocess.run(["bash", "-c", f"ulimit -v 6000000; exec {PY} -m jctr.train "
                          f"--config {path}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    error_line(out.stderr, r"the training step does not fit: it needs [\d.]+ GiB in all .*"
                           r"but this process's address-space limit \(ulimit -v\) has")
    assert "sparse_embedding1: single (device 0); rows/device 100,000,000" in out.stderr
