"""Data a user gets wrong, in every format: each is one clear line naming the file, record and
field; nothing is overwritten; broken headers are found before training starts."""

import os

import numpy as np
import pytest

from jctr.data.norm import write_norm_file
from jctr.data.records import RecordBlock, write_file_list
from jctr.data.tools.synthetic import generate_block, write_format
from jctr.train.cli import main
from tests.faults.harness import run_main, small_config, tree_digest, write_config

SLOTS, DENSE = 8, 13


def _block(n=300, seed=0) -> RecordBlock:
    return generate_block(n, slot_nnz=[1] * SLOTS, vocab=[2000] * SLOTS, dense_dim=DENSE,
                          key_type="I64", seed=seed)


def _norm_set(folder, blocks, check="Sum") -> str:
    os.makedirs(folder, exist_ok=True)
    files = []
    for i, b in enumerate(blocks):
        path = os.path.join(folder, f"part{i}.data")
        write_norm_file(path, b, key_type="I64", check=check)
        files.append(path)
    lst = os.path.join(folder, "_file_list.txt")
    write_file_list(lst, files)
    return lst


def _config(tmp, train_blocks=None, eval_blocks=None, check="Sum", **solver):
    """Real (not generated) Norm data under tmp/real; the synthetic clause removed."""
    cfg = small_config(tmp, **solver)
    data = cfg["layers"][0]
    data.pop("synthetic")
    data["check"] = check
    data["source"] = _norm_set(tmp / "real" / "train", train_blocks or [_block(), _block(seed=1)],
                               check)
    data["eval_source"] = _norm_set(tmp / "real" / "eval", eval_blocks or [_block(seed=2)], check)
    return cfg


def _run(tmp, cfg, capsys, pattern, *, before_training=False, status=2):
    err = run_main(main, ["--config", write_config(tmp, cfg)], capsys, status=status,
                   pattern=pattern, roots=(tmp / "real",))
    if before_training:
        assert "[jctr] iter" not in err and "training" not in err.split("error:")[0][-200:]
    return err


def _with(block, **changes):
    fields = {f: getattr(block, f).copy() for f in ("label", "dense", "nnz", "keys")}
    for name, (index, value) in changes.items():
        fields[name][index] = value
    return RecordBlock(**fields)


VALUE_CASES = {
    "nan dense": (dict(dense=((57, 3), np.nan)), r"part1\.data: record 57: dense\[3\] is nan "
                                                 r"\(not finite\)"),
    "infinite dense": (dict(dense=((0, 0), np.inf)), r"part1\.data: record 0: dense\[0\] is inf"),
    "negative infinite dense": (dict(dense=((299, 12), -np.inf)),
                                r"record 299: dense\[12\] is -inf"),
    "nan label": (dict(label=((10, 0), np.nan)), r"record 10: label is nan \(not finite\)"),
    "label 2": (dict(label=((11, 0), 2.0)), r"record 11: label is 2\.0 \(labels must lie in "
                                            r"\[0, 1\]"),
    "label -1": (dict(label=((12, 0), -1.0)), r"record 12: label is -1\.0"),
}


@pytest.mark.parametrize("name", sorted(VALUE_CASES))
def test_bad_values_name_file_record_and_field(tmp_path, capsys, name):
    changes, pattern = VALUE_CASES[name]
    cfg = _config(tmp_path, [_block(), _with(_block(seed=1), **changes)], max_iter=10)
    _run(tmp_path, cfg, capsys, pattern)


def test_class_labels_for_cross_entropy(tmp_path, capsys):
    cfg = _config(tmp_path, [_with(_block(), label=((5, 0), 0.5))])
    cfg["layers"][-2]["fc_param"]["num_output"] = 2
    cfg["layers"][-1]["type"] = "CrossEntropyLoss"
    _run(tmp_path, cfg, capsys, r"part0\.data: record 5: label is 0\.5 \(CrossEntropyLoss "
                                r"takes the class 0 or 1\)")


def test_bad_value_in_the_evaluation_set(tmp_path, capsys):
    cfg = _config(tmp_path, eval_blocks=[_with(_block(seed=2), dense=((3, 1), np.nan))])
    _run(tmp_path, cfg, capsys, r"eval/part0\.data: record 3: dense\[1\] is nan")


def _truncate(path, keep):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:keep] if keep >= 0 else data[:keep])


HEADER_CASES = {
    "third training file cut inside its header": (
        lambda tmp: _truncate(tmp / "real/train/part2.data", 20),
        r"part2\.data: truncated: 20 bytes, shorter than the 69-byte header"),
    "evaluation file cut inside its header": (
        lambda tmp: _truncate(tmp / "real/eval/part0.data", 10),
        r"eval/part0\.data: truncated: 10 bytes"),
    "evaluation file of another width": (
        lambda tmp: write_norm_file(str(tmp / "real/eval/part0.data"),
                                    generate_block(40, slot_nnz=[1] * SLOTS, vocab=[9] * SLOTS,
                                                   dense_dim=12), key_type="I64", check="Sum"),
        r"eval/part0\.data: header: dense_dim is 12 but the config has 13"),
    "training file without check Sum": (
        lambda tmp: write_norm_file(str(tmp / "real/train/part1.data"), _block(), key_type="I64"),
        r"part1\.data: header: check mode Sum expects a 64-byte length prefix, got 0 \(is the "
        r"file written without check\?\)"),
    "file list names a missing file": (
        lambda tmp: os.remove(tmp / "real/train/part1.data"),
        r"train/_file_list\.txt: line 3: data file .*part1\.data.* does not exist"),
    "file list count is wrong": (
        lambda tmp: (tmp / "real/train/_file_list.txt").write_text("5\npart0.data\n"),
        r"_file_list\.txt: line 1 says 5 files but 1 are listed"),
    "file list is empty": (lambda tmp: (tmp / "real/train/_file_list.txt").write_text(""),
                           r"_file_list\.txt: empty file list"),
    "evaluation list missing": (lambda tmp: os.remove(tmp / "real/eval/_file_list.txt"),
                                r"eval/_file_list\.txt: does not exist"),
    "header claims more records": (
        lambda tmp: _patch_i64(tmp / "real/train/part0.data", 4 + 8, 301),
        r"part0\.data: header: checksum mismatch"),
}


def _patch_i64(path, offset, value):
    data = bytearray(open(path, "rb").read())
    data[offset:offset + 8] = np.array([value], "<i8").tobytes()
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("name", sorted(HEADER_CASES))
def test_broken_files_are_found_before_training(tmp_path, capsys, name):
    damage, pattern = HEADER_CASES[name]
    cfg = _config(tmp_path, [_block(), _block(seed=1), _block(seed=3)])
    damage(tmp_path)
    _run(tmp_path, cfg, capsys, pattern, before_training=True)


REC = 4 * (1 + DENSE) + SLOTS * 12  # one-hot I64 record without check


def _two_keys(block):
    nnz = block.nnz.copy()
    nnz[7, 2] = 2
    return RecordBlock(block.label, block.dense, nnz, np.arange(int(nnz.sum()), dtype=np.int64))


def _small_keys(block):
    return RecordBlock(block.label, block.dense, block.nnz, block.keys % 100_000)


def _set_nnz(path, record, slot, value):
    data = bytearray(open(path, "rb").read())
    at = 64 + record * REC + 4 * (1 + DENSE) + slot * 12
    data[at:at + 4] = np.array([value], "<i4").tobytes()
    open(path, "wb").write(bytes(data))


RECORD_CASES = {
    "negative nnz": (lambda p: _set_nnz(p, 7, 2, -1),
                     r"part0\.data: record 7: slot 2: nnz is -1"),
    "nnz far too large": (lambda p: _set_nnz(p, 7, 2, 1_000_000),
                          r"part0\.data: record 7: slot 2: nnz 1000000 runs past the end"),
    "file cut inside a record": (lambda p: _truncate(p, -7),
                                 r"part0\.data: .*truncated"),
    # I32 keys read as I64: the counts after the first key are key bytes (issue 35)
    "I32 keys read as I64": (
        lambda p: write_norm_file(str(p), _small_keys(_block()), key_type="I32"),
        r"part0\.data: record \d+: slot \d+: nnz .*keys are read as 64-bit "
        r"\(solver\.input_key_type I64\): a file written with I32 keys is misread"),
    "two keys in a one-hot slot": (
        lambda p: write_norm_file(str(p), _two_keys(_block()), key_type="I64"),
        r"part0\.data: record 7: slot 2 has 2 keys but sparse input \"data1\" is one-hot"),
}


@pytest.mark.parametrize("name", sorted(RECORD_CASES))
def test_broken_records_name_record_and_slot(tmp_path, capsys, name):
    damage, pattern = RECORD_CASES[name]
    cfg = _config(tmp_path, check="None", max_iter=3)
    damage(tmp_path / "real/train/part0.data")
    _run(tmp_path, cfg, capsys, pattern)


def test_check_sum_damage_in_a_record(tmp_path, capsys):
    cfg = _config(tmp_path, max_iter=3)
    path = tmp_path / "real/train/part0.data"
    data = bytearray(open(path, "rb").read())
    data[69 + 5 * (REC + 5) + 30] ^= 0x55
    open(path, "wb").write(bytes(data))
    _run(tmp_path, cfg, capsys, r"part0\.data: record 5: checksum mismatch \(check: Sum\)")


def test_empty_files_are_data_and_an_empty_source_is_an_error(tmp_path, capsys):
    empty = RecordBlock(np.zeros((0, 1), np.float32), np.zeros((0, DENSE), np.float32),
                        np.zeros((0, SLOTS), np.int32), np.zeros(0, np.int64))
    cfg = _config(tmp_path, [empty, _block(), empty], max_iter=3)
    run_main(main, ["--config", write_config(tmp_path, cfg)], capsys, status=0,
             roots=(tmp_path / "real",))
    cfg = _config(tmp_path / "b", [empty, empty], max_iter=3)
    _run(tmp_path / "b", cfg, capsys, r"part0\.data: the data source holds no records")


def _format_config(tmp, fmt, **kw):
    cfg = small_config(tmp, max_iter=3)
    data = cfg["layers"][0]
    data.pop("synthetic")
    data.update(format=fmt, check="None", slot_size_array=[2000] * SLOTS)
    name = {"Raw": "train.bin", "Parquet": "_file_list.txt"}[fmt]
    data["source"] = str(tmp / "real" / "train" / name)
    data["eval_source"] = str(tmp / "real" / "eval" / name)
    if fmt == "Raw":
        data.update(num_samples=600, eval_num_samples=200, float_label_dense=True)
    common = dict(slot_nnz=[1] * SLOTS, vocab=[2000] * SLOTS, dense_dim=DENSE)
    write_format(fmt, data["source"], 600, num_files=2, **common, **kw)
    write_format(fmt, data["eval_source"], 200, num_files=1, stream=1, **common)
    return cfg


def _rewrite_parquet(path, column, row, value):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    values = table.column(column).to_pylist()
    values[row] = value
    typ = table.schema.field(column).type
    table = table.set_column(table.schema.get_field_index(column), column,
                             pa.array(values, type=typ))
    pq.write_table(table, path)


FORMAT_CASES = {
    "Raw file of a partial record": (
        "Raw", lambda t: open(t / "real/train/train.bin", "ab").write(b"\0" * 5),
        r"train\.bin: size \d+ bytes is not a multiple of the record size"),
    "Raw nan dense": (
        "Raw", lambda t: _raw_dense(t / "real/train/train.bin", 9, 4, np.nan),
        r"train\.bin.*record 9: dense\[4\] is nan"),
    "Parquet without _metadata.json": (
        "Parquet", lambda t: os.remove(t / "real/train/_metadata.json"),
        r"_metadata\.json: cannot read Parquet metadata"),
    "Parquet file with other row count": (
        "Parquet", lambda t: _drop_rows(t / "real/train/part_0001.parquet"),
        r"part_0001\.parquet: holds 200 rows but _metadata\.json's file_stats says 300"),
    "Parquet nan dense": (
        "Parquet", lambda t: _rewrite_parquet(t / "real/train/part_0001.parquet", "I3", 17,
                                              float("nan")),
        r"part_0001\.parquet: record 17: dense\[2\] is nan"),
    "Parquet null value": (
        "Parquet", lambda t: _rewrite_parquet(t / "real/train/part_0000.parquet", "C2", 4, None),
        r"part_0000\.parquet: row 4: column \"C2\" is null"),
    "Parquet label 3": (
        "Parquet", lambda t: _rewrite_parquet(t / "real/train/part_0000.parquet", "label", 8,
                                              3.0),
        r"part_0000\.parquet: record 8: label is 3\.0"),
    "Parquet evaluation file damaged": (
        "Parquet", lambda t: _truncate(t / "real/eval/part_0000.parquet", 100),
        r"eval/part_0000\.parquet: cannot read Parquet file"),
}


def _raw_dense(path, record, col, value):
    rec = 4 * (1 + DENSE + SLOTS)
    data = bytearray(open(path, "rb").read())
    at = record * rec + 4 * (1 + col)
    data[at:at + 4] = np.array([value], "<f4").tobytes()
    open(path, "wb").write(bytes(data))


def _drop_rows(path):
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(path).slice(0, 200), path)


@pytest.mark.parametrize("name", sorted(FORMAT_CASES))
def test_other_formats(tmp_path, capsys, name):
    fmt, damage, pattern = FORMAT_CASES[name]
    cfg = _format_config(tmp_path, fmt)
    damage(tmp_path)
    _run(tmp_path, cfg, capsys, pattern)


# ---- synthetic generation never overwrites ---------------------------------------------------


def test_typo_in_a_list_next_to_real_data_generates_nothing(tmp_path, capsys):
    cfg = _config(tmp_path)
    data = cfg["layers"][0]
    data["synthetic"] = small_config(tmp_path)["layers"][0]["synthetic"]
    data["source"] = str(tmp_path / "real/train/_file_lst.txt")  # typo
    before = tree_digest(tmp_path / "real")
    _run(tmp_path, cfg, capsys, r"train/_file_lst\.txt: the Data layer's source does not "
                                r"exist, and its folder holds 3 entries")
    assert tree_digest(tmp_path / "real") == before  # nothing new either


def test_missing_eval_list_in_the_training_folder(tmp_path, capsys):
    cfg = _config(tmp_path)
    data = cfg["layers"][0]
    data["synthetic"] = small_config(tmp_path)["layers"][0]["synthetic"]
    data["eval_source"] = str(tmp_path / "real/train/eval_list.txt")
    _run(tmp_path, cfg, capsys, r"eval_list\.txt: the Data layer's eval_source does not exist")


def test_train_and_eval_generated_into_one_folder(tmp_path, capsys):
    cfg = small_config(tmp_path)
    cfg["layers"][0]["eval_source"] = str(tmp_path / "data/train/eval_list.txt")
    run_main(main, ["--config", write_config(tmp_path, cfg)], capsys,
             pattern=r"data/train: the Data layer's source and eval_source are both to be "
                     r"generated into this folder")
    assert not (tmp_path / "data").exists()


def test_parquet_generation_into_a_non_empty_folder(tmp_path, capsys):
    cfg = _format_config(tmp_path, "Parquet")
    data = cfg["layers"][0]
    data["synthetic"] = {"num_samples": 100, "eval_num_samples": 50}
    data["eval_source"] = str(tmp_path / "real/train/eval_list.txt")
    _run(tmp_path, cfg, capsys, r"eval_list\.txt: the Data layer's eval_source does not exist, "
                                r"and its folder holds")


def test_generation_cli_keeps_an_existing_set(tmp_path, capsys):
    from jctr.data.tools.synthetic import main as synth

    cfg = write_config(tmp_path, small_config(tmp_path))
    assert synth(["--config", cfg]) == 0
    before = tree_digest(tmp_path / "data")
    assert synth(["--config", cfg]) == 0
    assert tree_digest(tmp_path / "data") == before


def test_interrupted_generation_leaves_nothing(tmp_path, capsys, monkeypatch):
    import jctr.data.tools.synthetic as synthetic

    calls = []
    real = synthetic.write_norm_file

    def failing(path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", path)
        return real(path, *a, **kw)

    monkeypatch.setattr(synthetic, "write_norm_file", failing)
    (tmp_path / "data").mkdir()
    run_main(main, ["--config", write_config(tmp_path, small_config(tmp_path))], capsys,
             pattern=r"part_0001\.data: No space left on device")
    assert os.listdir(tmp_path / "data") == []  # the train folder it made is gone again


# ---- converters write only into new or empty folders ----------------------------------------


def test_converters_refuse_a_folder_that_holds_files(tmp_path, capsys):
    from jctr.data.tools.criteo import main as criteo
    from jctr.data.tools.synthetic import main as synth
    from jctr.data.tools.transcode import main as transcode

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    sample = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                          "tests")  # any existing input: refused before it is read
    for main_, argv in ((criteo, ["--input", sample, "--output", str(out)]),
                        (transcode, ["--input", sample, "--output", str(out)]),
                        (synth, ["--out", str(out), "--samples", "10"])):
        run_main(main_, argv, capsys, pattern=r"mine: holds 1 entries \(notes\.txt\); jctr "
                                               r"writes only into a new or empty folder",
                 roots=(tmp_path,))
    assert os.listdir(out) == ["notes.txt"]


def test_gen_csv_does_not_overwrite_csv_files(tmp_path, capsys):
    from jctr.data.tools.gen_csv import main as gen_csv
    from tests.test_formats import SPEC

    (tmp_path / "feature_spec.yaml").write_text(SPEC)
    spec = ["--feature_spec_in", str(tmp_path / "feature_spec.yaml"), "--size", "20"]
    run_main(gen_csv, spec, capsys, status=0)
    run_main(gen_csv, spec, capsys, pattern=r"\.csv: exists \(\d+ of the \d+ files to write "
                                             r"do\); --force overwrites them", roots=(tmp_path,))
    run_main(gen_csv, [*spec, "--force"], capsys, status=0)


def test_csv_conversion_refuses_what_would_train_a_wrong_model(tmp_path, capsys):
    """A header-only CSV made a 0-record dataset that trained; labels 2 or 0.5 were written as
    they were; a byte-order mark hid the first column's name (issue 35). Each is refused with
    the file, row and column, and nothing is written."""
    from jctr.data.tools.from_csv import main as from_csv

    out = tmp_path / "out"
    header = tmp_path / "header.csv"
    header.write_text("y,site,n\n")
    run_main(from_csv, ["--train", str(header), "--label", "y", "--output", str(out)], capsys,
             pattern=r"header\.csv: no data rows after the header line", roots=(tmp_path,))
    for value in ("2", "0.5"):
        bad = tmp_path / f"label_{value}.csv"
        bad.write_text(f"y,site\n1,a\n0,b\n{value},c\n")
        run_main(from_csv, ["--train", str(bad), "--label", "y", "--output", str(out)], capsys,
                 pattern=rf"label_{value}\.csv: row 3: column \"y\" \(the label\) is "
                         rf"{value}; expected 0 or 1", roots=(tmp_path,))
    assert not out.exists()
    bom = tmp_path / "bom.csv"
    bom.write_bytes("\ufeffy,site\n1,a\n0,b\n".encode())
    assert from_csv(["--train", str(bom), "--label", "y", "--output", str(out)]) == 0
