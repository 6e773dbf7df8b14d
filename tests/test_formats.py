"""Raw, Parquet, feature specification, Criteo conversion, shuffling and host splits."""

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from jctr.config import parse_config
from jctr.data.feature_spec import load_feature_spec
from jctr.data.loader import open_dataset
from jctr.data.parquet import write_parquet_dataset
from jctr.data.raw import write_raw_file
from jctr.data.records import DataError
from jctr.data.tools.criteo import _hex_values, convert
from jctr.data.tools.synthetic import write_format
from jctr.train.trainer import Trainer
from tests.conftest import ROOT, load_json

SLOTS, VOCAB = 8, 50
# 200 real Criteo rows (Apache-2.0, from DeepCTR; tests/data/deepctr_samples/README.md)
CRITEO_SAMPLE = os.path.join(ROOT, "tests", "data", "deepctr_samples", "criteo_sample.txt")


def _data_cfg(fmt, source, eval_source=None, **extra):
    raw = copy.deepcopy(load_json("dcn_synthetic.json"))
    d = raw["layers"][0]
    d.pop("synthetic")
    d.update(format=fmt, check="None", source=source, eval_source=eval_source or source,
             **extra)
    if fmt in ("Raw", "Parquet"):
        d.setdefault("slot_size_array", [VOCAB] * SLOTS)
    return raw


def _blocks(ds):
    return [ds.read_unit(i) for i in ds.host_units()]


def _kw():
    return dict(slot_nnz=[1] * SLOTS, vocab=[VOCAB] * SLOTS, dense_dim=13, seed=3)


# ---- Raw -------------------------------------------------------------------------------------


def test_raw_reads_what_was_written_with_offsets_and_log(tmp_path):
    rng = np.random.default_rng(0)
    label = rng.integers(0, 2, (100, 1))
    dense = rng.integers(-2, 1000, (100, 13))
    keys = rng.integers(0, VOCAB, (100, SLOTS))
    path = str(tmp_path / "d.bin")
    write_raw_file(path, label, dense, keys)
    cfg = parse_config(_data_cfg("Raw", path, num_samples=100, eval_num_samples=100))
    (block,) = _blocks(open_dataset(path, cfg.data, "I32"))
    np.testing.assert_array_equal(block.label[:, 0], label[:, 0])
    np.testing.assert_allclose(block.dense, np.log1p(np.maximum(dense, 0)), rtol=1e-6)
    np.testing.assert_array_equal(block.keys.reshape(100, SLOTS),
                                  keys + np.arange(SLOTS) * VOCAB)


def test_raw_errors(tmp_path):
    path = str(tmp_path / "d.bin")
    write_raw_file(path, np.zeros((10, 1)), np.zeros((10, 13)), np.zeros((10, SLOTS)))
    with pytest.raises(DataError, match="holds 10 records of 88 bytes .* num_samples"):
        open_dataset(path, parse_config(_data_cfg("Raw", path, num_samples=11,
                                                  eval_num_samples=1)).data, "I32")
    with open(path, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="not a multiple of the record size 88"):
        open_dataset(path, parse_config(_data_cfg("Raw", path, num_samples=10,
                                                  eval_num_samples=1)).data, "I32")
    keys = np.zeros((10, SLOTS))
    keys[7, 3] = VOCAB
    write_raw_file(path, np.zeros((10, 1)), np.zeros((10, 13)), keys)
    ds = open_dataset(path, parse_config(_data_cfg("Raw", path, num_samples=10,
                                                   eval_num_samples=1)).data, "I32")
    with pytest.raises(DataError, match=r"record 7: slot 3 key 50 is outside slot_size_array"):
        _blocks(ds)


# ---- Parquet ---------------------------------------------------------------------------------


def _parquet(tmp_path, n=60):
    rng = np.random.default_rng(1)
    parts = [(rng.integers(0, 2, (n, 1)).astype(np.float32),
              rng.normal(size=(n, 13)).astype(np.float32),
              rng.integers(0, VOCAB, (n, SLOTS))) for _ in range(2)]
    return write_parquet_dataset(str(tmp_path / "pq"), parts), parts


def test_parquet_round_trip_columns_in_any_order(tmp_path):
    lst, parts = _parquet(tmp_path)
    # reorder the columns of the first file; _metadata.json names them, order does not matter
    f0 = os.path.join(os.path.dirname(lst), "part_0000.parquet")
    t = pq.read_table(f0)
    pq.write_table(t.select(list(reversed(t.column_names))), f0)
    cfg = parse_config(_data_cfg("Parquet", lst))
    blocks = _blocks(open_dataset(lst, cfg.data, "I64"))
    for b, (label, dense, keys) in zip(blocks, parts):
        np.testing.assert_array_equal(b.label, label)
        np.testing.assert_array_equal(b.dense, dense)
        np.testing.assert_array_equal(b.keys.reshape(-1, SLOTS), keys + np.arange(SLOTS) * VOCAB)


@pytest.mark.parametrize("damage,message", [
    ("drop", r"missing column \"C3\""),
    ("null", r"row 5: column \"I2\" is null"),
    ("dtype", r"column \"C1\" has type string; expected int64"),
    ("rows", r"holds 60 rows but _metadata.json's file_stats says 61"),
    ("range", r"record 2: slot 0 key 999 is outside slot_size_array\[0\] = 50"),
])
def test_parquet_errors(tmp_path, damage, message):
    lst, _ = _parquet(tmp_path)
    folder = os.path.dirname(lst)
    f0 = os.path.join(folder, "part_0000.parquet")
    t = pq.read_table(f0)
    if damage == "drop":
        t = t.drop(["C3"])
    elif damage == "null":
        col = t.column("I2").to_pylist()
        col[5] = None
        t = t.set_column(t.column_names.index("I2"), "I2", pa.array(col, pa.float32()))
    elif damage == "dtype":
        t = t.set_column(t.column_names.index("C1"), "C1", t.column("C1").cast(pa.string()))
    elif damage == "range":
        col = t.column("C1").to_numpy().copy()
        col[2] = 999
        t = t.set_column(t.column_names.index("C1"), "C1", pa.array(col))
    elif damage == "rows":
        meta = json.load(open(os.path.join(folder, "_metadata.json")))
        meta["file_stats"][0]["num_rows"] = 61
        json.dump(meta, open(os.path.join(folder, "_metadata.json"), "w"))
    pq.write_table(t, f0)
    ds = open_dataset(lst, parse_config(_data_cfg("Parquet", lst)).data, "I64")
    with pytest.raises(DataError, match=message):
        _blocks(ds)


def test_parquet_metadata_disagreeing_with_config(tmp_path):
    lst, _ = _parquet(tmp_path)
    raw = _data_cfg("Parquet", lst)
    raw["layers"][0]["dense"]["dense_dim"] = 12
    for layer in raw["layers"]:  # keep the config itself consistent
        if layer.get("type") == "Slice":
            layer["ranges"] = [[0, 8 * 8 + 12]] * 2
    with pytest.raises(DataError, match=r"\"conts\" lists 13 columns but the config has 12"):
        open_dataset(lst, parse_config(raw).data, "I64")


# ---- feature specification -------------------------------------------------------------------


SPEC = """
feature_spec:
  lab: {dtype: torch.float32}
  n1: {dtype: torch.float32}
  n2: {dtype: torch.float32}
  c1: {dtype: torch.int32, cardinality: auto}
  c2: {dtype: torch.int32, cardinality: 7}
source_spec:
  train:
    - type: csv
      features: [n1, c1]
      files: [train_a_0.csv, train_a_1.csv]
    - type: csv
      features: [lab, n2, c2]
      files: [train_b.csv]
  test:
    - type: csv
      features: [lab, n1, n2, c1, c2]
      files: [test.csv]
channel_spec:
  label: [lab]
  numerical: [n1, n2]
  categorical: [c1, c2]
"""


def _two_slot_cfg(source, fmt="FeatureSpec"):
    raw = copy.deepcopy(load_json("dlrm_synthetic.json"))
    d = raw["layers"][0]
    d.pop("synthetic")
    d.update(format=fmt, check="None", source=source, eval_source=source)
    d["dense"]["dense_dim"] = 2
    d["sparse"][0].update(slot_num=2, max_feature_num_per_sample=2)
    return raw


def test_gen_csv_transcode_and_train(tmp_path):
    src = tmp_path / "csv"
    src.mkdir()
    (src / "feature_spec.yaml").write_text(SPEC)
    run = lambda *a: subprocess.run([sys.executable, "-m", *a], cwd=ROOT, capture_output=True,
                                    text=True, timeout=120)
    out = run("jctr.data.tools.gen_csv", "--feature_spec_in", str(src / "feature_spec.yaml"),
              "--size", "3000")
    assert out.returncode == 0, out.stderr
    assert (src / "train_a_1.csv").exists() and (src / "test.csv").exists()
    out = run("jctr.data.tools.transcode", "--input", str(src), "--output", str(tmp_path / "bin"))
    assert out.returncode == 0, out.stderr
    spec = yaml.safe_load((tmp_path / "bin" / "feature_spec.yaml").read_text())
    assert spec["feature_spec"]["cat_0"]["cardinality"] == 100  # inferred from 'auto'
    assert spec["feature_spec"]["cat_1"]["cardinality"] == 7
    assert all(c["type"] == "split_binary" for c in spec["source_spec"]["train"])
    # the CSV and the transcoded dataset hold the same rows
    csv_cfg = parse_config(_two_slot_cfg(str(src / "feature_spec.yaml")))
    bin_path = str(tmp_path / "bin" / "feature_spec.yaml")
    bin_cfg = parse_config(_two_slot_cfg(bin_path))
    (a,) = _blocks(open_dataset(csv_cfg.data.source, csv_cfg.data, "I64"))
    (b,) = _blocks(open_dataset(bin_cfg.data.source, bin_cfg.data, "I64"))
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_allclose(a.dense, b.dense, rtol=1e-3, atol=1e-3)  # float16 storage
    np.testing.assert_array_equal(a.label, b.label)
    t = Trainer.from_config({**_two_slot_cfg(bin_path),
                             "solver": {"max_iter": 5, "batchsize": 256, "display": 1000,
                                        "eval_interval": 1000, "input_key_type": "I64"}})
    t.fit()


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace("categorical: [c1, c2]", "categorical: [c1, c9]"),
     r"channel_spec.categorical: unknown feature \"c9\""),
    (lambda s: s.replace("type: csv\n      features: [n1, c1]",
                         "type: tfrecord\n      features: [n1, c1]"),
     r"source_spec.train\[0\].type: chunk type 'tfrecord' cannot be read"),
    (lambda s: s.replace("features: [lab, n2, c2]", "features: [lab, n2, c7]"),
     r"source_spec.train\[1\].features: unknown feature \"c7\""),
    (lambda s: s.replace("numerical: [n1, n2]", "numerical: [n2, n1]"),
     r"numerical features must appear once each, in channel_spec order"),
])
def test_feature_spec_errors(tmp_path, edit, message):
    (tmp_path / "feature_spec.yaml").write_text(edit(SPEC))
    with pytest.raises(DataError, match=message):
        load_feature_spec(str(tmp_path / "feature_spec.yaml"), check_files=False)


def test_csv_rows_with_wrong_field_count(tmp_path):
    (tmp_path / "feature_spec.yaml").write_text(SPEC)
    from jctr.data.tools.gen_csv import generate_csv

    generate_csv(str(tmp_path / "feature_spec.yaml"), size=50)
    with open(tmp_path / "train_b.csv", "a") as f:
        f.write("1,0.5\n")
    cfg = parse_config(_two_slot_cfg(str(tmp_path / "feature_spec.yaml")))
    with pytest.raises(DataError, match=r"train_b.csv: row 50: expected 3 fields \(lab, n2, c2\)"):
        _blocks(open_dataset(cfg.data.source, cfg.data, "I64"))


def test_missing_feature_spec_file(tmp_path):
    (tmp_path / "feature_spec.yaml").write_text(SPEC)
    with pytest.raises(DataError, match=r"train_a_0.csv\" does not exist"):
        load_feature_spec(str(tmp_path / "feature_spec.yaml"))


# ---- synthetic data in every format, shuffling, host split -----------------------------------


@pytest.mark.parametrize("fmt", ["Raw", "Parquet", "FeatureSpec"])
def test_synthetic_formats_hold_the_same_samples(tmp_path, fmt):
    name = {"Raw": "d.bin", "Parquet": "_file_list.txt", "FeatureSpec": "spec.yaml"}[fmt]
    path = str(tmp_path / fmt / name)
    write_format(fmt, path, 500, eval_n=100, num_files=3, **_kw())
    extra = {"num_samples": 500, "eval_num_samples": 500, "float_label_dense": True} \
        if fmt == "Raw" else {}
    cfg = parse_config(_data_cfg(fmt, path, **extra))
    got = _blocks(open_dataset(path, cfg.data, "I64"))
    from jctr.data.records import RecordBlock
    from jctr.data.tools.synthetic import generate_block

    keys = np.concatenate([b.keys for b in got])
    if fmt == "Parquet":  # three files, three generator streams
        ref = RecordBlock.concat([generate_block(n, key_type="I32", stream=i, **_kw())
                                  for i, n in enumerate((167, 167, 166))])
    else:
        ref = generate_block(500, key_type="I32", **_kw())
    np.testing.assert_array_equal(keys, ref.keys)


@pytest.mark.parametrize("fmt", ["Raw", "Parquet", "Norm"])
def test_a_cache_keeps_what_memory_has_room_for_and_reads_the_rest(tmp_path, monkeypatch, fmt):
    """``Dataset.cache_all`` keeps each unit while the machine has room for it (a file read
    whole: the bytes it will take; a decoded unit, Parquet's: what is left after decoding it)
    and reads the units past the first that has none from their files: the batches are the
    same, shuffled too."""
    import jctr.data.dataset as ds
    from jctr.data import raw
    from jctr.data.tools.synthetic import write_dataset

    monkeypatch.setattr(raw, "UNIT_RECORDS", 200)  # Raw's units: record ranges of its file
    if fmt == "Norm":  # one record a slot: read as fixed records
        path = write_dataset(str(tmp_path / fmt), 600, num_files=3, key_type="I64", **_kw())
    else:
        path = str(tmp_path / fmt / ("d.bin" if fmt == "Raw" else "_file_list.txt"))
        write_format(fmt, path, 600, num_files=3, **_kw())
    extra = {"num_samples": 600, "eval_num_samples": 600, "float_label_dense": True} \
        if fmt == "Raw" else {}
    cfg = parse_config(_data_cfg(fmt, path, **extra))
    unit_bytes = 600 // 3 * (4 + 13 * 4 + SLOTS * (4 + 8))  # a Norm record at most
    room = [10 * unit_bytes]  # decoded units and read ones spend it alike here

    def room_left(reserve=0):
        return room[0] - reserve

    def spend(unit):
        room[0] -= unit.load_bytes() if hasattr(unit, "load_bytes") else unit_bytes
        return unit

    monkeypatch.setattr(ds, "room_left", room_left)
    for seed in (None, 5):
        whole = open_dataset(path, cfg.data, "I64", seed=seed)
        assert whole.cache_all() == whole.num_units()
        units = whole.num_units()
        room[0] = (1 if fmt == "Raw" else 2) * unit_bytes + unit_bytes // 2
        tight = open_dataset(path, cfg.data, "I64", seed=seed)
        monkeypatch.setattr(tight, "_read_unit", lambda i, f=tight._read_unit: spend(f(i)))
        kept = tight.cache_all(reserve=unit_bytes // 4)
        assert 0 < kept < units and len(tight._cache) == kept
        for a, b in zip(whole.batches(64, epochs=2), tight.batches(64, epochs=2),
                        strict=True):
            np.testing.assert_array_equal(a.keys[0], b.keys[0])
            np.testing.assert_array_equal(a.dense, b.dense)
        room[0] = 10 * unit_bytes


def test_shuffle_is_seeded_and_hosts_do_not_overlap(tmp_path):
    path = str(tmp_path / "pq" / "_file_list.txt")
    write_format("Parquet", path, 800, num_files=4, **_kw())
    cfg = parse_config(_data_cfg("Parquet", path))

    def keys(**kw):
        ds = open_dataset(path, cfg.data, "I64", **kw)
        return np.concatenate([b.keys[0][b.segments[0] < 100 * SLOTS]
                               for b in ds.batches(100, epochs=1)])

    plain = keys()
    a, b = keys(seed=1), keys(seed=1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, plain)
    np.testing.assert_array_equal(np.sort(a), np.sort(plain))
    h0, h1 = keys(process_index=0, process_count=2), keys(process_index=1, process_count=2)
    np.testing.assert_array_equal(np.sort(np.concatenate([h0, h1])), np.sort(plain))
    assert h0.size == h1.size == plain.size // 2


# ---- Criteo ----------------------------------------------------------------------------------


def test_hex_parsing():
    arr = pa.array(["05db9164", "", None, "a", "FFFFFFFF"])
    out = _hex_values(arr, "x", "C1")
    assert list(out) == [0x05DB9164, 1 << 32, 1 << 32, 10, 0xFFFFFFFF]
    with pytest.raises(DataError, match="row 0: C1: not a hexadecimal value"):
        _hex_values(pa.array(["zz"]), "x", "C1")


@pytest.mark.parametrize("fmt,mode", [("norm", "hash"), ("raw", "vocab"),
                                      ("parquet", "buckets"), ("split_binary", "vocab")])
def test_criteo_sample_converts_and_trains(tmp_path, fmt, mode):
    layer = convert([CRITEO_SAMPLE], str(tmp_path), fmt, mode, min_freq=2, buckets=1000,
                    num_files=2)
    raw = copy.deepcopy(load_json("dlrm_synthetic.json"))
    d = raw["layers"][0]
    d.pop("synthetic")
    d.update(layer)
    d["dense"]["dense_dim"] = 13
    d["sparse"][0].update(slot_num=26, max_feature_num_per_sample=26)
    raw["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = 50_000
    raw["solver"].update(max_iter=4, batchsize=32, batchsize_eval=16, display=1000,
                         eval_interval=1000, eval_batches=2)
    t = Trainer.from_config(raw)
    t.fit()
    assert int(t.state.step) == 4
    assert t.data.train.num_records() == 180
    if mode == "vocab":
        sizes = layer["slot_size_array"]
        assert sizes[0] > 1 and max(sizes) < 180  # min_freq 2 drops singletons


def test_criteo_tsv_and_csv_agree(tmp_path):
    rows = ["1\t5\t\t3" + "\t1" * 10 + "\t05db9164" + "\t" * 25,
            "0\t\t2\t-1" + "\t0" * 10 + "\ta" + "\t68fd1e64" * 25]
    tsv = tmp_path / "d.tsv"
    tsv.write_text("\n".join(rows) + "\n")
    csv = tmp_path / "d.csv"
    header = "label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + \
        ",".join(f"C{i}" for i in range(1, 27))
    csv.write_text(header + "\n" + "\n".join(r.replace("\t", ",") for r in rows) + "\n")
    from jctr.data.tools.criteo import read_criteo

    a, b = read_criteo(str(tsv)), read_criteo(str(csv))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert list(a[1][1][:3]) == [0, 2, 0]  # missing and negative integers become 0
    with pytest.raises(DataError, match="nope.tsv: cannot read"):
        read_criteo(str(tmp_path / "nope.tsv"))
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\t3\n")
    with pytest.raises(DataError, match="expected 40 fields"):
        read_criteo(str(bad))
