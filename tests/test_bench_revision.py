"""``scripts/bench_revision.py``: a revision exported beside this tree as its own package."""

import os
import re
import shutil
import subprocess
import sys

from tests.conftest import ROOT


def test_a_revision_is_exported_as_jctr_rev_with_its_own_xla_targets(tmp_path):
    """The export of HEAD holds ``jctr_rev`` and ``rev_scripts`` with no name left that would
    import this tree's ``jctr`` or register an XLA target under this tree's names (both
    trees' native kernels are registered in one process), and its package imports as
    ``jctr_rev`` in a process that has ``jctr`` too."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import bench_revision
    finally:
        sys.path.pop(0)
    # a repository of its own holding this tree's exported files, one commit: the test does
    # not depend on how this tree was checked out
    repo = tmp_path / "repo"
    for path in bench_revision.EXPORTED:
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        if os.path.isdir(os.path.join(ROOT, path)):
            shutil.copytree(os.path.join(ROOT, path), repo / path,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(os.path.join(ROOT, path), repo / path)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "tree"]):
        subprocess.run(git + cmd, check=True, capture_output=True)
    folder = bench_revision.export("HEAD", str(tmp_path), root=str(repo))
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
