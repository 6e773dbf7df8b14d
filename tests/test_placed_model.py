"""A model placed, trained, snapshotted and written as model files without a Trainer: the
pieces the trainer composes (``jctr.sharding.placed_model``, ``jctr.checkpoint.snapshots``,
``jctr.checkpoint.model_files``) work on their own."""

import zlib

import numpy as np
import pytest

from jctr.checkpoint import Checkpointer, CheckpointError
from jctr.checkpoint.model_files import load_model_files, save_model_files
from jctr.checkpoint.snapshots import restore_snapshot, save_snapshot
from jctr.config import load_config
from jctr.data.loader import open_dataset
from jctr.data.tools.synthetic import generate_for_config
from jctr.models.ctr import build_model, make_eval_step
from jctr.sharding.placed_model import PlacedModel
from jctr.train.dense_optimizer import dense_optimizer
from jctr.train.step import make_train_step
from tests.conftest import tiny_config


def _placed(cfg, dense_tx=None):
    step_config, init_state = build_model(cfg)
    placed = PlacedModel(cfg, step_config.specs)
    state = placed.create(lambda: init_state(dense_tx))
    return step_config, placed, state


def _predict(cfg, step_config, placed, state, batch):
    step = placed.jit(make_eval_step(step_config, placed.engine_full))
    _, pred = step(state, placed.to_devices(batch, process_local=False))
    return np.asarray(pred)


@pytest.fixture
def setup(tmp_path):
    raw = tiny_config(tmp_path, "deepfm", gpu=[0, 1, 2, 3], batchsize=256, batchsize_eval=256)
    cfg = load_config(raw)
    generate_for_config(cfg)
    batch = next(iter(open_dataset(cfg.data.eval_source, cfg.data, cfg.solver.input_key_type,
                                   eval=True).batches(256, epochs=1)))
    return raw, cfg, batch


def _train(cfg, step_config, placed, state, dense_tx, steps=3):
    step = placed.jit(make_train_step(step_config, dense_tx, placed.engine_full),
                      donate_state=True, returns_state=True)
    data = open_dataset(cfg.data.source, cfg.data, cfg.solver.input_key_type)
    for _, batch in zip(range(steps), data.batches(cfg.solver.batchsize)):
        state, _ = step(state, placed.to_devices(batch, process_local=True))
    return state


def test_a_snapshot_of_tables_without_keys_restores(tmp_path, setup):
    raw, cfg, batch = setup
    step_config, placed, state = _placed(cfg)
    ckpt = Checkpointer(str(tmp_path / "ck"), async_save=False)
    ckpt.acquire(report=lambda s: None)
    save_snapshot(ckpt, cfg, step_config, state, placed.placements, readers=[{}])
    ckpt.wait()
    ckpt.release()
    restored, _, meta = restore_snapshot(Checkpointer(str(tmp_path / "ck")), cfg, step_config,
                                         placed.create(build_model(cfg)[1]), placed.placements)
    assert meta["tables"]["sparse_embedding1"]["rows"] == 0
    np.testing.assert_array_equal(_predict(cfg, step_config, placed, restored, batch),
                                  _predict(cfg, step_config, placed, state, batch))


def test_placements_predict_alike_and_snapshots_move_between_them(tmp_path, setup):
    raw, cfg4, batch = setup
    tx = dense_optimizer(cfg4.optimizer)
    step_config, placed4, state4 = _placed(cfg4, tx)
    assert placed4.num_devices == 4 and placed4.engine is not None
    state4 = _train(cfg4, step_config, placed4, state4, tx)
    assert int(state4.step) == 3
    files = save_model_files(str(tmp_path / "files") + "/", step_config, state4,
                             placed4.placements)
    pred4 = _predict(cfg4, step_config, placed4, state4, batch)

    cfg1 = load_config({**raw, "solver": {**raw["solver"], "gpu": [0]}})
    step_config1, placed1, state1 = _placed(cfg1)
    assert placed1.mesh is None
    state1 = load_model_files(step_config1, state1, files[0], tuple(files[2:]),
                              placed1.placements, placed1.put_replicated)
    np.testing.assert_allclose(_predict(cfg1, step_config1, placed1, state1, batch), pred4,
                               rtol=1e-5, atol=1e-7)

    ckpt = Checkpointer(str(tmp_path / "ck"), async_save=False)
    ckpt.acquire(report=lambda s: None)
    save_snapshot(ckpt, cfg4, step_config, state4, placed4.placements,
                  readers=[{"epoch": 0, "file_index": 1, "record": 7}], devices=4)
    ckpt.wait()
    ckpt.release()
    restored, reader, meta = restore_snapshot(Checkpointer(str(tmp_path / "ck")), cfg1,
                                              step_config1, placed1.create(build_model(cfg1)[1]),
                                              placed1.placements, report=lambda s: None)
    assert reader == {"epoch": 0, "file_index": 1, "record": 7} and meta["devices"] == 4
    np.testing.assert_allclose(_predict(cfg1, step_config1, placed1, restored, batch), pred4,
                               rtol=1e-5, atol=1e-7)

    other = {**raw, "layers": [dict(layer) for layer in raw["layers"]]}
    other["layers"][1] = {**other["layers"][1], "sparse_embedding_hparam": {
        **other["layers"][1]["sparse_embedding_hparam"], "combiner": 0}}  # sum, not mean
    with pytest.raises(CheckpointError, match="another model.*combiner"):
        cfg_other = load_config(other)
        sc_other, placed_other, state_other = _placed(cfg_other)
        restore_snapshot(Checkpointer(str(tmp_path / "ck")), cfg_other, sc_other, state_other,
                         placed_other.placements, report=lambda s: None)


def test_batch_sizes_must_split_over_the_devices(tmp_path):
    from jctr.config import ConfigError

    cfg = load_config(tiny_config(tmp_path, "dlrm", gpu=[0, 1, 2], batchsize=256))
    with pytest.raises(ConfigError, match="solver.batchsize.*does not split evenly over 3"):
        PlacedModel(cfg, build_model(cfg)[0].specs)


def test_tables_are_written_by_jctr_and_orbax_tables_of_version_2_still_restore(
        tmp_path, setup, monkeypatch):
    """A snapshot's tables are headerless files under rows/ (written past the page cache, their
    CRC-32 in the integrity record from memory: docs/performance.md, "Day-end cost, fourth
    round"), not an Orbax item; snapshots of version 2, whose tables were an Orbax item
    without zstd (or, earlier, with Orbax's default compression), restore alike. A damaged
    rows file is named on restore."""
    import json

    import orbax.checkpoint as ocp

    from jctr.checkpoint import manager

    raw, cfg, batch = setup
    dense_tx = dense_optimizer(cfg.optimizer)
    step_config, placed, state = _placed(cfg, dense_tx)
    state = _train(cfg, step_config, placed, state, dense_tx)
    want = _predict(cfg, step_config, placed, state, batch)

    def codecs(folder):  # each array's codec, from the metadata inside Orbax's database
        import tensorstore as ts

        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{folder}"}).result()
        return [json.loads(kv.read(key).result().value).get("compressor")
                for key in kv.list().result() if key.endswith(b"/.zarray")]

    def compressed_handlers():  # what earlier versions registered: Orbax's defaults
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("dense", ocp.args.StandardSave, ocp.StandardCheckpointHandler())
        registry.add("tables", ocp.args.PyTreeSave, ocp.PyTreeCheckpointHandler())
        registry.add("meta", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
        return registry

    for name in ("rows", "plain", "zstd"):
        if name != "rows":
            monkeypatch.setattr(manager, "ROWS_BY_JCTR", False)
        if name == "zstd":
            monkeypatch.setattr(manager, "_save_handlers", compressed_handlers)
        ckpt = Checkpointer(str(tmp_path / name), async_save=name != "plain")
        ckpt.acquire(report=lambda s: None)
        step = save_snapshot(ckpt, cfg, step_config, state, placed.placements, readers=[{}])
        ckpt.wait()
        ckpt.release()
        where = tmp_path / name / str(step)
        if name == "rows":
            assert not (where / "tables").exists()
            index = json.loads((where / "rows" / "index.json").read_text())["tables"]
            assert set(index) == {s.name for s in step_config.specs}
            record = json.loads((where / manager.INTEGRITY).read_text())
            for files in index.values():
                for ent in files.values():
                    data = (where / "rows" / ent["file"]).read_bytes()
                    assert len(data) == np.prod(ent["shape"]) * np.dtype(ent["dtype"]).itemsize
                    assert record[f"rows/{ent['file']}"] == [len(data), zlib.crc32(data)]
        else:
            tables = codecs(where / "tables")
            assert tables and all((c is not None) == (name == "zstd") for c in tables), tables
        restored, _, _ = restore_snapshot(Checkpointer(str(tmp_path / name)), cfg, step_config,
                                          placed.create(build_model(cfg)[1]), placed.placements)
        np.testing.assert_array_equal(_predict(cfg, step_config, placed, restored, batch), want)
    rel = next(iter(index.values()))["values"]["file"]
    damaged = tmp_path / "rows" / str(step) / "rows" / rel
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"rows/{rel}: damaged checkpoint file"):
        restore_snapshot(Checkpointer(str(tmp_path / "rows")), cfg, step_config,
                         placed.create(build_model(cfg)[1]), placed.placements)
