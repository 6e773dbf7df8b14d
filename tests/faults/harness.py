"""The fault-injection harness: run a jctr command as a careless user would, then check that it
ended the way a user needs -- the exit status, exactly one ``error:`` line matching what was
expected, no traceback -- and that no file that existed before was changed or removed."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, load_json

PY = sys.executable


def tree_digest(*roots: os.PathLike) -> dict[str, str]:
    """sha256 of every file under ``roots`` (a file root counts as itself)."""
    out = {}
    for root in map(Path, roots):
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_unchanged(before: dict[str, str], *roots: os.PathLike) -> None:
    """Every file of ``before`` still exists with the same contents (new files may appear)."""
    after = tree_digest(*roots)
    lost = sorted(set(before) - set(after))
    changed = sorted(p for p in before if p in after and after[p] != before[p])
    assert not lost and not changed, f"lost {lost[:5]}, changed {changed[:5]}"


def error_line(err: str, pattern: str) -> str:
    """The one ``error:`` line of ``err``; it must match ``pattern`` and nothing may be a
    traceback."""
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def run_main(main, argv: list[str], capsys, *, status: int = 2, pattern: str | None = None,
             roots: tuple = ()) -> str:
    """Call a command's ``main(argv)`` in this process; check its status, its one error line
    (when ``pattern`` is given) and that nothing under ``roots`` changed."""
    before = tree_digest(*roots)
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == status, err[-3000:]
    if pattern is not None:
        error_line(err, pattern)
    assert_unchanged(before, *roots)
    return err


def run_cli(args: list[str], *, status: int = 2, pattern: str | None = None, roots: tuple = (),
            timeout: float = 300, env: dict | None = None,
            module: str = "jctr.train") -> subprocess.CompletedProcess:
    """Run ``python -m <module> args`` in a subprocess, with the same checks as
    :func:`run_main`."""
    before = tree_digest(*roots)
    out = subprocess.run([PY, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})})
    assert out.returncode == status, out.stderr[-3000:]
    if pattern is not None:
        error_line(out.stderr, pattern)
    assert_unchanged(before, *roots)
    return out


def small_config(tmp: Path, **solver) -> dict:
    """The shipped small DLRM with a small dataset under ``tmp`` and quick solver settings."""
    cfg = copy.deepcopy(load_json("dlrm_synthetic.json"))
    data = cfg["layers"][0]
    data["source"] = str(tmp / "data" / "train" / "_file_list.txt")
    data["eval_source"] = str(tmp / "data" / "eval" / "_file_list.txt")
    data["synthetic"].update(num_samples=2048, eval_num_samples=512, num_files=2)
    cfg["solver"].update(max_iter=4, display=2, eval_interval=1000, eval_batches=2,
                         batchsize=256, batchsize_eval=256,
                         snapshot_prefix=str(tmp / "runs") + "/")
    cfg["solver"].update(solver)
    return cfg


def write_config(tmp: Path, cfg: dict, name: str = "cfg.json") -> str:
    path = tmp / name
    path.write_text(json.dumps(cfg))
    return str(path)
