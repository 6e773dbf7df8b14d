"""The CSV converter: vocabularies fitted on the training file (minimum count, one OOV id per
field), applied to validation and test files; bucketized integers; any number of fields; the
real Criteo and Avazu samples from raw file to an early-stopped model with a test AUC."""

import json
import os

import numpy as np
import pytest

from jctr.data.from_csv import convert, expand_names, main
from jctr.data.norm import read_norm_file
from jctr.data.records import DataError
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
    history = t.fit()
    tests = [h for h in history if h["kind"] == "test"]
    assert len(tests) == 1 and 0.0 <= tests[0]["AUC"] <= 1.0 and tests[0]["LogLoss"] > 0
    assert [h for h in history if h["kind"] == "eval"]
