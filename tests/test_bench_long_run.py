"""``scripts/bench_long_run.py`` runs small and says what a pass and a restart pay now."""

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_the_long_run_bench_measures_both_parts_and_the_new_ways_are_smaller():
    out = subprocess.run([sys.executable, "scripts/bench_long_run.py", "--keys", "40000",
                          "--daily", "4000", "--rows", "50000", "--rounds", "1",
                          "--skip-kafka"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    stats = re.search(r"\[statistics\] 40,000 keys, 4,000 pushed today: .* ([\d.]+)x the "
                      r"bytes", out.stdout)
    start = re.search(r"\[serve start\] a model of 50,000 rows .* the recorded digests taken",
                      out.stdout)
    erase = re.search(r"\[hash map erase\] 32,768 keys of 50,000 rows", out.stdout)
    switch = re.search(r"\[new base\] 50,000 rows, a tenth new: loaded afresh [\d.]+ s; taken "
                       r"while serving [\d.]+ s", out.stdout)
    assert stats and float(stats.group(1)) > 3 and start and erase and switch, out.stdout
