"""The CSV converter: vocabularies fitted on the training file (minimum count, one OOV id per
field), applied to validation and test files; bucketized integers; any number of fields; the
real Criteo and Avazu samples from raw file to an early-stopped model with a test AUC."""

import json
import os

import numpy as np
import pytest

from jctr.data.norm import read_norm_file
from jctr.data.records import DataError
from jctr.data.tools.from_csv import convert, expand_names, main
from jctr.train.trainer import Trainer
from tests.conftest import ROOT

SAMPLES = os.path.join(ROOT, "tests", "data", "deepctr_samples")  # copies, with README


def write(path, text):
    path.write_text(text)
    return str(path)


def records(file_list: str, dense_dim: int = 0, slots: int = 1):
    folder = os.path.dirname(file_list)
    with open(file_list) as f:
        files = f.read().split()[1:]
    assert len(files) == 1
    return read_norm_file(os.path.join(folder, files[0]), label_dim=1, dense_dim=dense_dim,
                          slot_num=slots, key_type="I64", check="Sum")


def test_vocabularies_come_from_the_training_file_alone(tmp_path):
    train = write(tmp_path / "train.csv",
                  "y,site,n,price\n1,a,5,1.5\n0,a,0,\n1,b,20,3\n0,a,5,-2\n1,c,5,0\n0,b,1,7\n")
    valid = write(tmp_path / "valid.csv", "y,site,n,price\n1,b,20,1\n0,z,5,2\n")
    layer, rows = convert(train, str(tmp_path / "out"), label="y", dense=["price"],
                          bucketize=["n"], drop=[], valid=valid, min_count=2)
    assert rows == {"train": 6, "valid": 2}
    vocab = json.loads((tmp_path / "out" / "vocab.json").read_text())["vocabularies"]
    # site: a x3, b x2 (c once: below min_count); n buckets: 5 -> floor(ln(5)^2) = 2 (x3),
    # 20 -> floor(ln(20)^2) = 8, 0 and 1 stay themselves (each once: out of vocabulary)
    assert vocab == {"site": ["a", "b"], "n": ["2"]}
    assert layer["slot_size_array"] == [3, 2]  # V + 1 (the OOV id 0) per field
    assert layer["dense"]["dense_dim"] == 1 and layer["sparse"][0]["slot_num"] == 2
    tr = records(layer["source"], 1, 2)
    # keys: site id (a=1, b=2, c=OOV 0), then 3 + n id (bucket 2 -> 1, else 0)
    assert tr.keys.reshape(6, 2).tolist() == [[1, 4], [1, 3], [2, 3], [1, 4], [0, 4], [2, 3]]
    np.testing.assert_allclose(tr.dense[:, 0], np.log1p([1.5, 0, 3, 0, 0, 7]), rtol=1e-6)
    assert tr.label[:, 0].tolist() == [1, 0, 1, 0, 1, 0]
    va = records(layer["eval_source"], 1, 2)  # "z" was never seen in training: OOV
    assert va.keys.reshape(2, 2).tolist() == [[2, 3], [0, 4]]


def test_split_and_a_later_file_through_the_saved_vocabulary(tmp_path):
    lines = "\n".join(f"{i % 2},k{i % 3}" for i in range(10))
    train = write(tmp_path / "all.csv", "label,k\n" + lines + "\n")
    layer, rows = convert(train, str(tmp_path / "a"), label="label", dense=[], bucketize=[],
                          drop=[], split=[0.6, 0.2, 0.2])
    assert rows == {"train": 6, "valid": 2, "test": 2}
    assert layer["test_source"] == {"test": str(tmp_path / "a" / "test" / "_file_list.txt")}
    later = write(tmp_path / "later.csv", "label,k\n1,k2\n0,k9\n")
    code = main(["--train", later, "--vocab", str(tmp_path / "a" / "vocab.json"),
                 "--output", str(tmp_path / "b")])
    assert code == 0
    got = records(str(tmp_path / "b" / "train" / "_file_list.txt"))
    want = json.loads((tmp_path / "a" / "vocab.json").read_text())["vocabularies"]["k"]
    assert got.keys.tolist() == [want.index("k2") + 1, 0]


def test_errors_name_the_file_and_what_was_expected(tmp_path, capsys):
    train = write(tmp_path / "t.csv", "click,a\n1,x\n,y\n")
    with pytest.raises(DataError, match=r't.csv: no column "label"; the columns are click, a'):
        convert(train, str(tmp_path / "o1"), label="label", dense=[], bucketize=[], drop=[])
    with pytest.raises(DataError, match=r't.csv: row 2: column "click" \(the label\) is missing'):
        convert(train, str(tmp_path / "o2"), label="click", dense=[], bucketize=[], drop=[])
    with pytest.raises(DataError, match=r"no categorical column left \(label click, dense 1"):
        convert(train, str(tmp_path / "o3"), label="click", dense=["a"], bucketize=[], drop=[])
    three = write(tmp_path / "3.csv", "click,a,b\n1,x,u\n0,2,v\n")
    with pytest.raises(DataError, match=r'3.csv: column "a": expected numbers'):
        convert(three, str(tmp_path / "o5"), label="click", dense=["a"], bucketize=[], drop=[])
    assert main(["--train", train, "--output", str(tmp_path / "o4"), "--split", "0.8"]) == 2
    assert "--split: expected 2 or 3 positive fractions" in capsys.readouterr().err
    assert expand_names("I1..I3,C1") == ["I1", "I2", "I3", "C1"]


@pytest.mark.parametrize("name", ["criteo_sample", "avazu_sample"])
def test_real_samples_from_raw_file_to_a_test_auc(tmp_path, name):
    """What scripts/prepare_samples.py does, then the shipped config's training."""
    from scripts.prepare_samples import prepare

    path = prepare(name, SAMPLES, str(tmp_path))
    with open(path) as f:
        generated = json.load(f)
    with open(os.path.join(ROOT, "configs", f"{name}.json")) as f:
        shipped = json.load(f)
    # the shipped config is what the script writes (paths aside)
    assert json.dumps(generated["layers"][1:]) == json.dumps(shipped["layers"][1:])
    assert generated["solver"]["early_stopping"] == shipped["solver"]["early_stopping"]
    t = Trainer.from_config(path, num_epochs=6)
    t.fit()
    history = t.history
    tests = [h for h in history if h["kind"] == "test"]
    assert len(tests) == 1 and 0.0 <= tests[0]["AUC"] <= 1.0 and tests[0]["LogLoss"] > 0
    assert [h for h in history if h["kind"] == "eval"]


def test_one_call_writes_a_config_per_model_that_runs_from_any_folder(tmp_path, monkeypatch):
    """Issue 37 point 3: ``--model deepfm dlrm`` writes both configs, each with its own
    checkpoint and log folders, paths taken from the config's folder (they train from
    another working directory), the data shuffled each epoch and DLRM's top MLP with the
    recipe's dropout."""
    from jctr.config.parser import load_config

    rng = np.random.default_rng(1)
    lines = [f"{rng.integers(2)},{'abcz'[rng.integers(4)]},{rng.integers(9)},"
             f"{rng.uniform(0, 9):.2f}" for i in range(200)]
    train = write(tmp_path / "train.csv", "y,site,n,price\n" + "\n".join(lines) + "\n")
    assert main(["--train", train, "--label", "y", "--dense", "price", "--output",
                 str(tmp_path / "out"), "--model", "deepfm", "dlrm"]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfgs = {m: load_config(str(tmp_path / "out" / f"{m}.json")) for m in ("deepfm", "dlrm")}
    for model, cfg in cfgs.items():
        assert cfg.solver.snapshot_prefix == str(tmp_path / "out" / model) + "/"
        assert cfg.solver.log_dir == str(tmp_path / "out" / model / "logs")
        assert cfg.data.source == str(tmp_path / "out" / "train" / "_file_list.txt")
        assert cfg.data.shuffle
    assert [x.params.rate for x in cfgs["dlrm"].layers if x.type == "Dropout"] == [0.2] * 3
    raw = json.loads((tmp_path / "out" / "dlrm.json").read_text())
    assert raw["layers"][0]["source"] == os.path.join("train", "_file_list.txt")
    t = Trainer.from_config(str(tmp_path / "out" / "dlrm.json"), num_epochs=1)
    t.fit()
    assert (tmp_path / "out" / "dlrm" / "logs" / "metrics.jsonl").exists()
    assert not (elsewhere / "dlrm").exists()


def test_raw_rows_become_requests_as_the_training_data_was_encoded(tmp_path, capsys):
    from types import SimpleNamespace

    from jctr.config.parser import load_config
    from jctr.serving.cli import main as serve_main
    from jctr.serving.requests import RowEncoder
    from jctr.serving.server import parse_infer_request, request_features

    rng = np.random.default_rng(0)
    lines = [f"{rng.integers(2)},{'abcz'[rng.integers(4)]},{rng.integers(40)},"
             f"{rng.uniform(-1, 9):.2f},{i}" for i in range(40)]
    train = write(tmp_path / "train.csv", "y,site,n,price,id\n" + "\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert main(["--train", train, "--label", "y", "--dense", "price", "--bucketize", "n",
                 "--drop", "id", "--min-count", "2", "--output", str(out),
                 "--model", "wdl"]) == 0
    err = capsys.readouterr().err
    assert f"[jctr] converted {train} into {out}: 1 dense and 2 categorical fields" in err
    assert f"  train: 36 rows from {train}; out-of-vocabulary values" in err
    assert "  valid: 4 rows from " in err and "(its last 10%: no --valid or --split given)" in err
    # the training file's rows, encoded for a request: the keys and dense values trained on
    enc = RowEncoder.from_vocab(out / "vocab.json")
    dense, keys = enc.features(train)
    tr = records(str(out / "train" / "_file_list.txt"), 1, 2)
    np.testing.assert_array_equal(keys[:36].reshape(-1), tr.keys)
    np.testing.assert_array_equal(dense[:36], tr.dense)
    va = records(str(out / "valid" / "_file_list.txt"), 1, 2)
    np.testing.assert_array_equal(keys[36:].reshape(-1), va.keys)
    # rows as dicts (text as in the file; the label and other columns may be there or not)
    row = dict(zip(["y", "site", "n", "price", "id"], lines[3].split(",")))
    d1, k1 = enc.features([row, {k: v for k, v in row.items() if k not in ("y", "id")}])
    np.testing.assert_array_equal(k1, keys[[3, 3]])
    np.testing.assert_array_equal(d1, dense[[3, 3]])
    # the request body is what the server takes for this model
    body = enc.request([row])
    cfg = load_config(str(out / "wdl.json"), require_solver=False)
    model = SimpleNamespace(cfg=cfg, name="wdl", params=SimpleNamespace(i64_input_key=True))
    _, tensors = parse_infer_request(json.dumps(body).encode(), None)
    got_dense, [(got_keys, offsets)] = request_features(model, tensors)
    np.testing.assert_array_equal(got_dense, dense[[3]])
    np.testing.assert_array_equal(got_keys, keys[3])
    assert offsets.tolist() == [0, 1, 2]
    # the command-line helper prints the same body
    assert serve_main(["request", "--vocab", str(out / "vocab.json"), "--rows", train]) == 0
    assert json.loads(capsys.readouterr().out) == enc.request(train)
    # a later file through --vocab: no held-out set, and the summary says so
    assert main(["--train", train, "--label", "y", "--dense", "price", "--bucketize", "n",
                 "--drop", "id", "--vocab", str(out / "vocab.json"),
                 "--output", str(tmp_path / "later")]) == 0
    assert "no validation set: evaluation and early stopping read the training file" in \
        capsys.readouterr().err
    # a bad vocabulary file is a clear error
    empty = write(tmp_path / "empty.json", "")
    with pytest.raises(DataError, match="empty.json: empty file; expected the vocab.json"):
        RowEncoder.from_vocab(empty)
    with pytest.raises(DataError, match="nope.json: cannot read the vocabulary file"):
        RowEncoder.from_vocab(tmp_path / "nope.json")
    assert serve_main(["request", "--vocab", empty, "--rows", train]) == 2
    assert "empty file" in capsys.readouterr().err
    assert main(["--train", train, "--label", "y", "--vocab", empty,
                 "--output", str(tmp_path / "o9")]) == 2
    err = capsys.readouterr().err
    assert "empty.json: empty file; expected the vocab.json" in err and "internal" not in err
