"""``scripts/bench_stats.py`` runs small, both ways, and the mapped statistics keep their
columns out of the process's anonymous memory."""

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_the_statistics_bench_runs_both_ways_and_files_leave_anonymous_memory():
    out = subprocess.run([sys.executable, "scripts/bench_stats.py", "--vocab", "4000000",
                          "--days", "2", "--passes", "2", "--batches", "2", "--batch",
                          "262144", "--rounds", "1", "--keys", "uniform"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"all +memory +[\d.]+ s +files +[\d.]+ s +ratio [\d.]+", out.stdout)
    anon = {way: float(m.replace(",", "")) for way, m in
            re.findall(r"(memory|files): RssAnon ([\d,]+) MiB", out.stdout)}
    assert "(mapped: False)" in out.stdout and "(mapped: True)" in out.stdout
    # ~1.7M keys: ~60 MiB of columns and 16 MiB of index kept out of anonymous memory
    assert anon["files"] < anon["memory"] - 40, out.stdout
