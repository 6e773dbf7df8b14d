"""The README's Python snippets run as written (in a scratch folder beside the shipped configs)."""

import os
import re
import subprocess
import sys

from tests.conftest import ROOT


def _snippets(section: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], re.S)


def test_from_python_snippets_run_as_written(tmp_path):
    blocks = _snippets("From Python")
    assert len(blocks) == 3
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("{'AUC': ") and lines[-1] == "(4,)"
