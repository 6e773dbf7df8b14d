"""What a run leaves and shows besides metrics.jsonl: TensorBoard event files, report.html with
its plots (rendered in headless Chromium), the progress display, and the ``jctr`` command."""

import dataclasses
import os
import shutil
import struct
import subprocess
import sys

import pytest

from jctr.config import load_config
from jctr.train.progress import Progress, format_seconds
from jctr.train.report import ReportError, write_report
from jctr.train.trainer import Trainer
from tests.conftest import ROOT, tiny_config


def _events(folder: str) -> dict[str, list[tuple[int, float]]]:
    """Scalars of the TensorBoard event files in ``folder`` (TFRecord framing, Event protos)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            record = data[pos + 12:pos + 12 + length]
            pos += 12 + length + 4
            event = Event.FromString(record)
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def _png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outputs")
    cfg = tiny_config(tmp, "wdl", max_iter=30, display=10, eval_interval=15, eval_batches=2,
                      log_dir=str(tmp / "logs"))
    lines: list[str] = []
    t = Trainer(load_config(cfg), log=lines.append)
    t.fit()
    return tmp / "logs", lines, t


def test_tensorboard_event_files_hold_the_runs_scalars(run):
    logs, _, t = run
    scalars = _events(str(logs / "tensorboard"))
    for tag in ("train/loss", "train/samples_per_s", "train/step_time_ms", "train/lr",
                "validation/AUC", "tables/sparse_embedding1/fill",
                "tables/sparse_embedding2/rows"):
        assert tag in scalars, sorted(scalars)
    assert [s for s, _ in scalars["train/loss"]] == [10, 20, 30]
    assert [s for s, _ in scalars["validation/AUC"]] == [15, 30]
    evals = [h for h in t.history if h["kind"] == "eval"]
    assert scalars["validation/AUC"][-1][1] == pytest.approx(evals[-1]["AUC"], abs=1e-6)
    fill = scalars["tables/sparse_embedding1/fill"][-1][1]
    assert 0 < fill <= 1


def test_tensorboard_logs_without_importing_torch(tmp_path):
    """tensorboardX imports torch whenever it is installed (``tensorboardX/writer.py``: a
    module-level ``import torch`` to accept torch tensors), seconds of every run's start; the
    log imports it with torch held off, writes the same events, and torch imports as before
    afterwards."""
    code = (
        "import sys\n"
        "from jctr.train.tensorboard import TensorBoardLog\n"
        "b = TensorBoardLog(sys.argv[1])\n"
        "b.write({'kind': 'train', 'iter': 3, 'loss': 0.25}); b.close()\n"
        "print('torch' in sys.modules)\n"
        "try:\n"
        "    import torch\n"
        "    print(torch.zeros(1).shape[0])\n"
        "except ImportError:\n"
        "    print('absent')\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out[0] == "False" and out[1] in ("1", "absent"), out
    assert _events(str(tmp_path / "tensorboard")) == {"train/loss": [(3, 0.25)]}


def test_report_html_plots_render_in_chromium(run, tmp_path):
    logs, _, _ = run
    report = logs / "report.html"
    assert report.is_file()
    text = report.read_text()
    for png in ("loss.png", "validation.png", "throughput.png", "tables.png"):
        assert f"report_files/{png}" in text
        assert _png_size(str(logs / "report_files" / png)) == (800, 360)
    assert '"max_iter": 30' in text  # the run's config
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is installed by scripts/setup_services.sh"
    out = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'chromium'}",
         "--virtual-time-budget=10000", "--dump-dom", report.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count('data-rendered="800x360"') == 4, out.stdout[:3000]


def test_report_command_and_foreign_reports(run, tmp_path):
    logs, _, _ = run
    copy = tmp_path / "copy"
    shutil.copytree(logs, copy)
    (copy / "report.html").unlink()
    out = subprocess.run([sys.executable, "-m", "jctr.report", str(copy)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(copy / "report.html")
    (copy / "report.html").write_text("<html>my own notes</html>")
    with pytest.raises(ReportError, match="was not written by jctr; not replaced"):
        write_report(str(copy))
    assert (copy / "report.html").read_text() == "<html>my own notes</html>"
    with pytest.raises(ReportError, match="metrics.jsonl: no such file"):
        write_report(str(tmp_path / "empty"))


def test_terminal_shows_compile_time_eta_and_a_summary(run):
    _, lines, _ = run
    text = "\n".join(lines)
    assert "steps compiled in" in text and "first step" in text
    iter_lines = [x for x in lines if x.startswith("[jctr] iter ")]
    assert len(iter_lines) == 3 and all("elapsed" in x for x in iter_lines)
    assert "ETA" in iter_lines[0]
    assert any(x.startswith("[jctr] done: 30 iterations") for x in lines), text


def test_progress_bar_on_a_terminal(capsys):
    p = Progress(total=100, start=0, write=print, bar=True)
    p.first_step_done(1.5)
    p.update(50, loss=0.5, rate=1234.0)
    p.write("[jctr] a log line")
    p.close()
    err = capsys.readouterr().err
    assert "50/100" in err and "loss 0.50000" in err and "a log line" in err
    assert format_seconds(59) == "59s" and format_seconds(61) == "1m01s"
    assert format_seconds(3700) == "1h01m"


def test_jctr_command_mirrors_the_module_commands(tmp_path):
    def jctr(*args):
        return subprocess.run([sys.executable, "-m", "jctr", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    from jctr.version import __version__

    out = jctr("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"jctr {__version__}"
    out = jctr("--help")
    assert out.returncode == 0
    for name in ("train", "export", "serve", "report", "synth", "convert", "from-csv"):
        assert f"  {name} " in out.stdout
    out = jctr("nope")
    assert out.returncode == 2 and "unknown command 'nope'" in out.stderr
    out = jctr("train", "--config", str(tmp_path / "missing.json"))
    assert out.returncode == 2 and "missing.json" in out.stderr
    out = jctr("report", str(tmp_path))
    assert out.returncode == 2 and "metrics.jsonl: no such file" in out.stderr


@pytest.mark.parametrize("command", [
    ["-m", "jctr", "--help"], ["-m", "jctr", "--version"], ["-m", "jctr.train", "--help"],
    ["-m", "jctr", "train", "--help"], ["-m", "jctr.export", "--help"],
    ["-m", "jctr.serve", "--help"], ["-m", "jctr.report", "--help"],
    ["-m", "jctr.online", "--help"], ["-m", "jctr", "online", "--help"],
])
def test_help_answers_without_starting_jax(command):
    out = subprocess.run([sys.executable, "-X", "importtime", *command], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip()
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:")}
    assert "jctr" in imported and "jax" not in imported


def test_bfloat16_on_a_cpu_without_bf16_warns(tmp_path, monkeypatch):
    import jctr.runtime.cpu as cpu

    monkeypatch.setattr(cpu, "has_bf16_matmul", lambda: False)
    lines: list[str] = []
    Trainer(load_config(tiny_config(tmp_path, "dlrm", compute_dtype="bfloat16")),
            log=lines.append)
    assert any("warning: compute_dtype bfloat16 on a CPU without AVX512-BF16" in x
               for x in lines)
    monkeypatch.setattr(cpu, "has_bf16_matmul", lambda: True)
    lines.clear()
    Trainer(load_config(tiny_config(tmp_path, "dlrm", compute_dtype="bfloat16")),
            log=lines.append)
    assert not any("warning" in x for x in lines)


def test_solver_flags_users_reach_for(tmp_path):
    from jctr.config import ConfigError
    from jctr.train.cli import apply_flags, build_parser

    cfg = load_config(tiny_config(tmp_path, "dlrm"))
    args = build_parser().parse_args([
        "--config", "x.json", "--snapshot", "50", "--snapshot-keep", "5", "--eval-metrics",
        "AUC,LogLoss", "--input-key-type", "I32", "--max-iter", "7"])
    s = apply_flags(cfg, args).solver
    assert (s.snapshot, s.snapshot_keep, s.max_iter, s.input_key_type) == (50, 5, 7, "I32")
    assert [m.name for m in s.eval_metrics] == ["AUC", "LogLoss"]
    bad = build_parser().parse_args(["--config", "x.json", "--eval-metrics", "AUC,Nope"])
    with pytest.raises(ConfigError, match="--eval-metrics"):
        apply_flags(cfg, bad)


def test_lr_flag_sets_the_optimizer_rate_and_errors_name_it(tmp_path):
    from jctr.config import ConfigError
    from jctr.train.cli import apply_flags, build_parser

    raw = tiny_config(tmp_path, "dlrm")
    # an embedding with its own optimizer keeps its own rate
    raw["layers"][1]["optimizer"] = {"type": "SGD", "sgd_hparam": {"learning_rate": 0.3}}
    cfg = load_config(raw)
    args = build_parser().parse_args(["--config", "x.json", "--lr", "0.0123", "--max-iter", "3"])
    new = apply_flags(cfg, args)
    assert new.optimizer.learning_rate == 0.0123 and new.solver.max_iter == 3
    assert new.optimizer.type == cfg.optimizer.type
    assert new.embeddings[0].optimizer.learning_rate == 0.3
    # the rest of the optimizer is untouched
    assert dataclasses.replace(new.optimizer, learning_rate=cfg.optimizer.learning_rate) \
        == cfg.optimizer
    bad = build_parser().parse_args(["--config", "x.json", "--lr", "-1"])
    with pytest.raises(ConfigError, match=r"^--lr: "):
        apply_flags(cfg, bad)
    # the same from Python
    t = Trainer.from_config(raw, generate_data=False, max_iter=3,
                            optimizer={"learning_rate": 0.0123})
    assert t.cfg.optimizer == new.optimizer and t.cfg.solver.max_iter == 3
    with pytest.raises(ConfigError, match=r"learning_rate"):
        Trainer.from_config(raw, generate_data=False, optimizer={"learning_rate": -1})


def test_epoch_runs_show_an_eta_from_the_data_size(tmp_path):
    cfg = tiny_config(tmp_path, "dlrm", display=4, eval_interval="epoch", eval_batches=1)
    cfg["solver"].pop("max_iter")
    cfg["solver"]["num_epochs"] = 2
    cfg["layers"][0]["synthetic"].update(num_samples=5000, eval_num_samples=512)
    lines: list[str] = []
    Trainer(load_config(cfg), log=lines.append).fit()
    iter_lines = [x for x in lines if x.startswith("[jctr] iter ")]
    # 5000 samples in batches of 512: 10 iterations per epoch (the last one padded)
    assert any(x.startswith("[jctr] epoch 2 done at iter 20") for x in lines), lines
    assert [x.split()[2] for x in iter_lines] == ["4", "8", "12", "16", "20"]
    assert all("ETA" in x for x in iter_lines[1:])
    assert "ETA 0s" in iter_lines[-1]


def test_a_resumed_run_is_drawn_as_trained():
    """A run logged iterations 1..6, was killed, and resumed from its checkpoint of iter 4:
    iterations 5 and 6 were trained again, so the report draws each iteration once."""
    from jctr.train.report import _series, as_trained

    records = [{"kind": "start", "iter": 0}]
    records += [{"kind": "train", "iter": i, "loss": 1.0 / i} for i in range(1, 7)]
    records += [{"kind": "eval", "iter": 6, "AUC": 0.7}, {"kind": "start", "iter": 4}]
    records += [{"kind": "train", "iter": i, "loss": 2.0 / i} for i in range(5, 9)]
    kept = as_trained(records)
    iters, losses = _series(kept, "train", "loss")
    assert iters == list(range(1, 9))
    assert losses[4:] == [2.0 / i for i in range(5, 9)]  # the resumed run's values
    assert not [r for r in kept if r["kind"] == "eval"]  # the eval at 6 was undone too
    assert [r["iter"] for r in kept if r["kind"] == "start"] == [0, 4]


def test_a_months_long_log_is_reported_in_time_linear_in_its_records():
    """A streaming run logs a ``start`` record every pass (a fit a pass) and its report is
    written at every pass's end: ``as_trained`` filtered every record so far at each start,
    so a 30-day log (720 passes, 261k records) took 40 s of a 48 s report every pass, and the
    cost grew with the square of the run's age. Only a start below the highest iteration
    logged (a resumed run) filters now, and a line's points are thinned to ``POINTS``. The
    records kept are the same as by the filter at every start, resumes included."""
    import random

    from jctr.train.report import POINTS, _series, as_trained

    def by_every_start(records):  # the definition: each start drops what it trains again
        out = []
        for r in records:
            if r.get("kind") == "start" and isinstance(r.get("iter"), int):
                out = [o for o in out if not (isinstance(o.get("iter"), (int, float))
                                              and o["iter"] > r["iter"])]
            out.append(r)
        return out

    rng = random.Random(4)
    records, it = [], 0
    for _ in range(300):  # passes; now and then a resume from an earlier iteration
        it = max(0, it - rng.choice([0, 0, 0, 3, 17])) if records else 0
        records.append({"kind": "start", "iter": it})
        for _ in range(rng.randint(0, 9)):
            it += 1
            records.append({"kind": rng.choice(["train", "train", "eval", "snapshot"]),
                            "iter": it, "loss": 1.0})
        records.append({"kind": "summary", "iters": 3})
    assert as_trained(records) == by_every_start(records)
    starts = [r["iter"] for r in records if r["kind"] == "start"]
    assert any(a > b for a, b in zip(starts, starts[1:]))  # resumes were drawn
    long = [{"kind": "train", "iter": i, "loss": 1.0} for i in range(1, 10 * POINTS + 3)]
    x, _ = _series(long, "train", "loss")
    assert len(x) <= POINTS + 1 and x[0] == 1 and x[-1] == 10 * POINTS + 2


def test_a_long_run_keeps_its_last_display_records_in_memory(monkeypatch):
    """A record a display, each a dict in ``Trainer.history``: a run of days at a display a
    second gathered hundreds of thousands (~1 KB each). Past twice ``KEPT_DISPLAYS`` the
    oldest display records leave memory (``metrics.jsonl`` keeps them), every other kind and
    the order stay."""
    from jctr.train.run_log import RunLog

    monkeypatch.setattr(RunLog, "KEPT_DISPLAYS", 5)
    log = RunLog(None, source=None, report=print)
    for i in range(1, 41):
        log.record("train", iter=i, loss=1.0)
        if i % 4 == 0:
            log.record("eval", iter=i, AUC=0.7)
    trains = [h["iter"] for h in log.history if h["kind"] == "train"]
    assert 5 <= len(trains) <= 10 and trains == list(range(41 - len(trains), 41))
    assert [h["iter"] for h in log.history if h["kind"] == "eval"] == list(range(4, 41, 4))
    assert [h["iter"] for h in log.history] == sorted(h["iter"] for h in log.history)
    log.forget()
    assert log.history == []
