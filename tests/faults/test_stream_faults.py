"""Streaming training's folders and stores know whose they are (issue 35): a run folder is
locked while a run uses it, a row database belongs to one run, a run folder can move."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jctr.config import ConfigError
from jctr.runtime.folder_lock import FolderInUse
from tests.test_online import _days_with_deltas, _online, _stream


def _base_rows(save) -> tuple[np.ndarray, np.ndarray]:
    folder = next(save.glob("*/base/sparse/sparse_embedding1.model"))
    keys = np.fromfile(folder / "key", "<i8")
    vectors = np.fromfile(folder / "emb_vector", "<f4").reshape(keys.size, -1)
    order = np.argsort(keys)
    return keys[order], vectors[order]


def test_a_row_store_belongs_to_one_run(tmp_path):
    """A second run (another save_model_path) with the first run's sparse_store was trained
    from the first run's final rows without a word; now it is refused naming both, and
    ``--force`` empties the store and takes it over: the model equals a fresh run's."""
    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path, days=("20190720",))
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    store = str(tmp_path / "rows")

    def run(name, path, **kw):
        cfg = _online(tmp_path, model, tmp_path / name, end_day="20190720",
                      sparse_store={"path": path})
        return OnlineRun(cfg, log=lambda s: None, **kw)

    assert run("first", store).run() == 2
    with pytest.raises(ConfigError, match=r"sparse_store: .*rows holds the streaming run at "
                                          r".*first \([\d,]+ rows\); a store belongs to one "
                                          r"run.*--force"):
        run("second", store).run()
    assert not (tmp_path / "second" / "20190720").exists()  # nothing trained
    assert run("second", store, force=True).run() == 2
    assert run("fresh", str(tmp_path / "fresh_rows")).run() == 2
    keys, vectors = _base_rows(tmp_path / "second")
    want_keys, want_vectors = _base_rows(tmp_path / "fresh")
    np.testing.assert_array_equal(keys, want_keys)
    np.testing.assert_array_equal(vectors, want_vectors)
    from jctr.online.row_store import RowStore

    rows = RowStore(store, [], [])
    owner = rows.owner()  # the second run's now
    rows.close()
    assert owner["save_model_path"] == str(tmp_path / "second")


def test_a_run_folder_is_locked_while_a_run_uses_it(tmp_path):
    """Two runs of one config: the second used to rewrite the first's models and append to its
    passes.jsonl; now it is refused naming the owner, as the core trainer's snapshot folder.
    A lock left by a process that is gone is reported and taken over."""
    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path, days=("20190720",))
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    save = tmp_path / "save"
    save.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        (save / "LOCK").write_text(json.dumps({"pid": live.pid, "host": socket.gethostname(),
                                               "started": 0, "run": "other"}))
        with pytest.raises(FolderInUse, match=rf"save: in use by another run \(pid {live.pid} "
                                              r"on host .*\); wait for it to end, or give this "
                                              r"one another save_model_path"):
            OnlineRun(_online(tmp_path, model, save, end_day="20190720"),
                      log=lambda s: None).run()
        assert sorted(os.listdir(save)) == ["LOCK"]  # nothing written
    finally:
        live.kill()
        live.wait()
    lines = []
    assert OnlineRun(_online(tmp_path, model, save, end_day="20190720"),
                     log=lines.append).run() == 2
    assert any(f"(pid {live.pid} on host" in x and "is gone; taking over its lock" in x
               for x in lines)
    assert not (save / "LOCK").exists()  # given back at the end


def test_a_run_folder_can_move(tmp_path):
    """progress.json held absolute paths: a moved run folder resumed from (or failed on) the
    old place. Paths inside it are relative now; a record with an absolute path (older runs)
    still resumes."""
    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path)
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    old = tmp_path / "old"
    assert OnlineRun(_online(tmp_path, model, old, end_day="20190720"),
                     log=lambda s: None).run() == 2
    record = json.loads((old / "progress.json").read_text())
    assert not os.path.isabs(record["checkpoint"])
    new = tmp_path / "moved" / "run"
    new.parent.mkdir()
    shutil.move(str(old), str(new))
    lines = []
    again = OnlineRun(_online(tmp_path, model, new), log=lines.append)
    assert again.run() == 2  # the second day only
    assert any("resuming after day 20190720 pass 2" in x and str(new) in x for x in lines)
    assert not old.exists()
    # an absolute path (as older versions wrote) is taken as it is
    record = json.loads((new / "progress.json").read_text())
    record["checkpoint"] = str(new / record["checkpoint"])
    (new / "progress.json").write_text(json.dumps(record))
    assert OnlineRun(_online(tmp_path, model, new), log=lambda s: None).progress()[
        "checkpoint"] == record["checkpoint"]


def test_damaged_base_and_delta_models_are_refused_by_name(tmp_path, capsys):
    """Base and delta models carried no checksum: flipped bytes in a delta's emb_vector loaded
    and served. Their manifests now record every file's size and CRC-32; ``serve load`` and
    ``InferenceModel.load`` refuse a damaged file by name, and nothing is written."""
    from jctr.config.hps import parse_ps_config
    from jctr.serving.bundle import InferenceModel
    from jctr.serving.cli import main as serve_main
    from tests.faults.harness import run_main

    _days_with_deltas(tmp_path)
    save = tmp_path / "save"
    day = save / "20190721"
    manifest = json.loads((day / "delta-1" / "manifest.json").read_text())
    assert "sparse/sparse_embedding1.model/emb_vector" in manifest["files"]
    doc = {"supportlonglong": True, "volatile_db": {"type": "hash_map"},
           "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
           "models": [{"model": "m", "max_batch_size": 256, "bundle": str(day / "base"),
                       "deltas": [str(day / "delta-1")]}]}
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    parse_ps_config(doc, str(tmp_path / "ps.json"))
    vector = day / "delta-1" / "sparse" / "sparse_embedding1.model" / "emb_vector"
    good = vector.read_bytes()
    data = bytearray(good)
    data[100:104] = bytes(4 - i for i in range(4))  # a few flipped bytes, same size
    vector.write_bytes(bytes(data))
    run_main(serve_main, ["load", "--config", str(tmp_path / "ps.json")], capsys,
             pattern=rf"{vector}: damaged bundle file \(checksum mismatch\)",
             roots=(save,))
    vector.write_bytes(good)  # the file put right: the load completes
    assert serve_main(["load", "--config", str(tmp_path / "ps.json")]) == 0
    dense = save / "20190722" / "base" / "dense.model"
    dense.write_bytes(dense.read_bytes()[:-4])
    with pytest.raises(Exception, match=rf"{dense}: damaged bundle file \(size \d+, expected"):
        InferenceModel.load(str(save / "20190722" / "base"))


def failing_converter(path, kind, day, n):  # table_parameters.converter of the test below
    raise RuntimeError(f"upload of {kind} failed: bucket not found")


def test_a_failing_converter_names_itself(tmp_path, capsys):
    """A user's converter that raised was "internal error ... please report it"; now the error
    names table_parameters.converter, the model and the converter's own message (issue 35)."""
    import yaml

    from jctr.online.cli import main as online_main
    from tests.faults.harness import error_line

    model = _stream(tmp_path, days=("20190720",))
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    doc = {"model": str(model), "train_data_dir": str(tmp_path / "stream"),
           "split_interval": 720, "split_per_pass": 1, "start_day": "20190720",
           "end_day": "20190720", "save_model_path": str(tmp_path / "save"),
           "data_donefile": "DONE", "save_delta_frequency": 1,
           "table_parameters": {"converter": "tests.faults.test_stream_faults:"
                                             "failing_converter"}}
    config = tmp_path / "online.yaml"
    config.write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    assert online_main(["--config", str(config)]) == 2
    error_line(capsys.readouterr().err,
               r"online\.yaml: table_parameters\.converter: tests\.faults\.test_stream_faults:"
               r"failing_converter failed on the delta model .*delta-1: RuntimeError: upload "
               r"of delta failed: bucket not found")


def test_errors_name_the_settings_and_paths_the_user_wrote(tmp_path):
    """A sparse_store folder that is no database was reported as persistent_db.path (a key
    the streaming config does not have), and a damaged pass file as
    runs/X/_passes/../../../stream/...; now sparse_store.path, and the file's plain path."""
    from jctr.data.records import DataError
    from jctr.online.runner import OnlineRun
    from jctr.stores.base import StoreError

    model = _stream(tmp_path, days=("20190720",))
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    (tmp_path / "notadb").mkdir()
    (tmp_path / "notadb" / "notes.txt").write_text("mine")
    cfg = _online(tmp_path, model, tmp_path / "a", end_day="20190720",
                  sparse_store={"path": str(tmp_path / "notadb")})
    with pytest.raises(StoreError, match=r"^sparse_store\.path .*notadb: holds files that are "
                                         r"not a RocksDB database"):
        OnlineRun(cfg, log=lambda s: None).run()
    damaged = tmp_path / "stream" / "20190720" / "1200" / "part-0.data"
    damaged.write_bytes(damaged.read_bytes()[:100])
    with pytest.raises(DataError) as e:
        OnlineRun(_online(tmp_path, model, tmp_path / "b", end_day="20190720"),
                  log=lambda s: None).run()
    assert str(damaged) in str(e.value) and ".." not in str(e.value)


def test_a_pass_trained_again_leaves_one_record_that_counts(tmp_path, monkeypatch):
    """A crash between a pass's record and its checkpoint left two records of the pass in
    passes.jsonl, nothing saying which counts (issue 35): the first is marked superseded."""
    from jctr.online.runner import OnlineRun

    model = _stream(tmp_path, days=("20190720",))
    for folder in (tmp_path / "stream").glob("*/*"):
        (folder / "DONE").touch()
    real = OnlineRun._checkpoint
    stopped = []

    def fail_once(self, folder, day, n, *, day_end, **kw):
        if n == 2 and not day_end and not stopped:
            stopped.append(1)
            raise KeyboardInterrupt
        return real(self, folder, day, n, day_end=day_end, **kw)

    monkeypatch.setattr(OnlineRun, "_checkpoint", fail_once)
    cfg = _online(tmp_path, model, tmp_path / "save", end_day="20190720")
    with pytest.raises(KeyboardInterrupt):
        OnlineRun(cfg, log=lambda s: None).run()
    lines = []
    assert OnlineRun(cfg, log=lines.append).run() == 1
    records = [json.loads(x) for x in (tmp_path / "save" / "passes.jsonl").read_text()
               .splitlines()]
    assert [(r["pass"], r.get("superseded", False)) for r in records] == [
        (1, False), (2, True), (2, False)]
    assert any("1 record(s) of passes after the checkpoint marked superseded" in x
               for x in lines)
