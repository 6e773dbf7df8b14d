"""The Python snippets of the README and of the getting-started page run as written (in a
scratch folder beside the shipped configs)."""

import os
import re
import subprocess
import sys

from tests.conftest import ROOT


def _snippets(page: str, section: str) -> list[str]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], re.S)


def _run(blocks: list[str], tmp_path) -> list[str]:
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    script = tmp_path / "snippets.py"
    script.write_text("\n".join(blocks))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_readme_and_getting_started_python_snippets_run_as_written(tmp_path):
    readme = _snippets("README.md", "From Python")
    guide = _snippets(os.path.join("docs", "getting-started.md"), "From Python")
    assert len(readme) == 1 and len(guide) == 4
    # the README's snippet is the guide's first one, so one run covers both
    assert readme[0] == guide[0]
    lines = _run(guide, tmp_path)
    assert lines[0].startswith("{'AUC': ") and lines[-1] == "(4,)"
    auc, keys = lines[1].split()  # the hooks' snippet: pass AUC and keys read
    assert 0.5 < float(auc) <= 1.0 and int(keys) > 0
