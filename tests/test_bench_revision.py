"""``scripts/bench_revision.py``: a revision exported beside this tree as its own package."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_a_revision_is_exported_as_jctr_rev_with_its_own_xla_targets(tmp_path):
    """The export of HEAD holds ``jctr_rev`` and ``rev_scripts`` with no name left that would
    import this tree's ``jctr`` or register an XLA target under this tree's names (both
    trees' native kernels are registered in one process), and its package imports as
    ``jctr_rev`` in a process that has ``jctr`` too."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True
                      ).returncode:
        pytest.skip("not a git checkout")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import bench_revision
    finally:
        sys.path.pop(0)
    folder = bench_revision.export("HEAD", str(tmp_path))
    assert os.path.isdir(os.path.join(folder, "jctr_rev", "ops"))
    for base, _, names in os.walk(folder):
        for name in (n for n in names if n.endswith(".py")):
            with open(os.path.join(base, name)) as f:
                text = f.read()
            assert not re.search(r"\bjctr\b", text), (base, name)
            assert not re.search(r"\bjctr_(cpu|host)_", text), (base, name)
            assert not re.search(r"\bscripts\.", text), (base, name)
    with open(os.path.join(folder, "jctr_rev", "ops", "cpu_ffi.py")) as f:
        assert '"jctrrev_cpu_find_assign"' in f.read()
    out = subprocess.run(
        [sys.executable, "-c", "import jctr.config.schema, jctr_rev.config.schema as s; "
         "print(s.__file__)"], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, folder])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(os.path.join(folder, "jctr_rev"))
