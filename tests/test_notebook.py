"""notebooks/quickstart.ipynb runs top to bottom in a kernel of this environment (nbclient), in
an empty folder: it needs jctr installed, nothing else from the repository."""

import os

from tests.conftest import ROOT


def test_quickstart_notebook_runs(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the curves, inline
    assert any("click probabilities:" in o.get("text", "") for o in outputs)
    assert (tmp_path / "quickstart_bundle" / "manifest.json").is_file()
    assert (tmp_path / "quickstart_run" / "logs" / "report.html").is_file()
