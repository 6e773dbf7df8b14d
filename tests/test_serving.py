"""Serving: inference bundles written from checkpoints (``python -m jctr.export``) and
``InferenceModel`` predictions against the trainer's."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jctr.checkpoint.model_files import ModelFileError
from jctr.serving import InferenceModel
from jctr.serving.bundle import export_bundle
from jctr.train.trainer import Trainer
from tests.conftest import ROOT, tiny_config


def _cfg(tmp_path, model="dlrm", **solver):
    base = dict(max_iter=30, display=100, eval_interval=10_000, eval_batches=4,
                snapshot_prefix=str(tmp_path / "run_"))
    base.update(solver)
    return tiny_config(tmp_path, model, **base)


def test_export_load_predict_equals_eval(tmp_path):
    cfg = _cfg(tmp_path, "wdl", snapshot=30)
    t = Trainer.from_config(cfg)
    t.fit()
    out = subprocess.run([sys.executable, "-m", "jctr.export", "--checkpoint",
                          str(tmp_path / "run_checkpoints"), "--output", str(tmp_path / "b")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["step"] == 30 and set(manifest["embeddings"]) == {"sparse_embedding1",
                                                                      "sparse_embedding2"}
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config == t.cfg.raw  # the config it was trained with
    assert manifest["inputs"]["dense"]["dense_dim"] == t.cfg.data.dense_dim
    import jctr

    assert jctr.InferenceModel is InferenceModel
    model = InferenceModel.load(str(tmp_path / "b"))
    for batch in list(t.data.eval.batches(512, epochs=1))[:3]:
        np.testing.assert_allclose(model.predict(batch), t.predict(batch), rtol=1e-5,
                                   atol=1e-7)


def test_bundle_of_another_format_version_is_refused(tmp_path):
    t = Trainer.from_config(_cfg(tmp_path, max_iter=2))
    bundle = export_bundle(t.cfg, t.state, str(tmp_path / "b"), t.placements)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    manifest["version"] = 1  # a bundle of the network.json era
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelFileError, match="version 1; this jctr reads version 2: export"):
        InferenceModel.load(bundle)
    manifest["version"] = 2
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "b" / "config.json").write_text('{"layers": []}')
    with pytest.raises(ModelFileError, match=r"config.json: damaged bundle file \(size 14"):
        InferenceModel.load(bundle)  # the manifest's checksums catch the change first
    del manifest["files"]  # as a bundle put together by hand: the config itself is checked
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelFileError, match="config.json: the bundle's config does not parse"):
        InferenceModel.load(bundle)
