"""The Norm format: round trips, batching, and clear errors for bad files."""

import os

import numpy as np
import pytest

from jctr.config import parse_config
from jctr.data.loader import NormDataset, build_batch
from jctr.data.norm import read_norm_file, write_norm_file
from jctr.data.records import DataError, RecordBlock, read_file_list, write_file_list
from jctr.data.tools.synthetic import generate_block
from tests.conftest import load_json


def _block(n=300, nnz=(1, 1, 3, 2), key_type="I64", seed=0):
    return generate_block(n, slot_nnz=list(nnz), vocab=[500] * len(nnz), dense_dim=3,
                          key_type=key_type, seed=seed)


def _read(path, block, key_type="I64", check="None"):
    return read_norm_file(path, label_dim=block.label.shape[1], dense_dim=block.dense.shape[1],
                          slot_num=block.nnz.shape[1], key_type=key_type, check=check)


@pytest.mark.parametrize("check", ["None", "Sum"])
@pytest.mark.parametrize("key_type", ["I32", "I64"])
@pytest.mark.parametrize("nnz", [(1, 1, 1), (1, 1, 3, 2), (4, 0, 2)])
def test_round_trip(tmp_path, check, key_type, nnz):
    if 0 in nnz:  # empty slots are legal
        block = generate_block(50, slot_nnz=[4, 1, 2], vocab=[500] * 3, dense_dim=3,
                               key_type=key_type)
        block.nnz[::3, 1] = 0
        block = RecordBlock(block.label, block.dense, block.nnz,
                            np.arange(int(block.nnz.sum()), dtype=np.int64))
    else:
        block = _block(nnz=nnz, key_type=key_type)
    path = str(tmp_path / "d.data")
    write_norm_file(path, block, key_type=key_type, check=check)
    got = _read(path, block, key_type, check)
    for f in ("label", "dense", "nnz", "keys"):
        np.testing.assert_array_equal(getattr(got, f), getattr(block, f))


def test_header_layout_is_hugectr(tmp_path):
    block = _block(5, nnz=(1, 1), key_type="I32")
    path = str(tmp_path / "d.data")
    write_norm_file(path, block, key_type="I32", check="None")
    raw = np.fromfile(path, np.uint8)
    header = raw[:64].view("<i8")
    assert list(header[:5]) == [0, 5, 1, 3, 2]
    # first record: label, 3 dense floats, then (nnz=1, key) twice, all 4-byte words
    words = raw[64:64 + 4 * 8].view("<i4")
    assert raw[64:68].view("<f4")[0] == block.label[0, 0]
    assert words[4] == 1 and words[5] == block.keys[0]
    assert (raw.size - 64) == 5 * 4 * (1 + 3 + 2 * 2)


def test_batches_pack_keys_and_segments():
    block = RecordBlock(label=np.zeros((2, 1), np.float32), dense=np.zeros((2, 0), np.float32),
                        nnz=np.array([[1, 2, 1], [0, 1, 3]], np.int32),
                        keys=np.array([10, 20, 21, 30, 40, 50, 51, 52], np.int64))
    raw = load_json("deepfm_synthetic.json")
    sp = parse_config(raw).data.sparse[0].__class__
    hot = sp(top="a", type="DistributedSlot", max_feature_num_per_sample=1, slot_num=1,
             max_nnz=1)
    multi = sp(top="b", type="DistributedSlot", max_feature_num_per_sample=5, slot_num=2,
               max_nnz=3)
    b = build_batch(block, 3, (hot, multi))
    assert list(b.keys[0]) == [10, 0, 0] and list(b.segments[0]) == [0, 3, 3]
    assert list(b.keys[1][:5]) == [20, 21, 30, 0, 0]
    assert list(b.segments[1][:5]) == [0, 0, 1, 6, 6]
    assert list(b.keys[1][5:9]) == [40, 50, 51, 52] and list(b.segments[1][5:9]) == [2, 3, 3, 3]
    assert list(b.mask) == [True, True, False]


def test_file_list_round_trip_and_errors(tmp_path):
    block = _block(10)
    files = []
    for i in range(3):
        p = str(tmp_path / f"f{i}.data")
        write_norm_file(p, block)
        files.append(p)
    lst = str(tmp_path / "list.txt")
    write_file_list(lst, files)
    assert read_file_list(lst) == files
    (tmp_path / "bad.txt").write_text("4\n" + "\n".join(files) + "\n")
    with pytest.raises(DataError, match=r"bad.txt: line 1 says 4 files but 3 are listed"):
        read_file_list(str(tmp_path / "bad.txt"))
    (tmp_path / "missing.txt").write_text("1\nnope.data\n")
    with pytest.raises(DataError, match=r"missing.txt: line 2: data file 'nope.data' does not"):
        read_file_list(str(tmp_path / "missing.txt"))


def test_truncated_file(tmp_path):
    block = _block(50)
    path = str(tmp_path / "d.data")
    write_norm_file(path, block)
    data = open(path, "rb").read()
    for cut in (30, len(data) - 4, len(data) - 40):
        with open(path, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(DataError, match=r"d.data: .*(truncated|records)"):
            _read(path, block)


def test_header_disagreeing_with_config(tmp_path):
    block = _block(20)
    path = str(tmp_path / "d.data")
    write_norm_file(path, block)
    with pytest.raises(DataError, match="slot_num is 4 but the config has 5"):
        read_norm_file(path, label_dim=1, dense_dim=3, slot_num=5, key_type="I64")
    with pytest.raises(DataError, match="dense_dim is 3 but the config has 13"):
        read_norm_file(path, label_dim=1, dense_dim=13, slot_num=4, key_type="I64")
    with pytest.raises(DataError, match="check mode Sum expects a 64-byte length prefix"):
        _read(path, block, check="Sum")
    write_norm_file(path, block, check="Sum")
    with pytest.raises(DataError, match="written with check Sum; set the Data layer's check"):
        _read(path, block, check="None")


def test_checksum_mismatch_names_the_record(tmp_path):
    block = _block(40)
    path = str(tmp_path / "d.data")
    write_norm_file(path, block, check="Sum")
    raw = bytearray(open(path, "rb").read())
    # flip a byte inside record 0's dense features (header chunk is 69 bytes, length is 4)
    raw[69 + 4 + 6] ^= 0x5A
    open(path, "wb").write(bytes(raw))
    with pytest.raises(DataError, match=r"record 0: checksum mismatch"):
        _read(path, block, check="Sum")


def test_one_hot_input_rejects_multi_key_slots(tmp_path):
    block = _block(30, nnz=(1, 3))
    cfg = parse_config(load_json("dlrm_synthetic.json"))
    sp = cfg.data.sparse[0].__class__(top="x", type="DistributedSlot",
                                       max_feature_num_per_sample=2, slot_num=2, max_nnz=1)
    with pytest.raises(DataError, match=r"record \d+: slot 1 has \d keys but sparse input \"x\""):
        build_batch(block, 32, (sp,), "f.data")


def test_dataset_epochs_and_positions(tmp_path):
    raw = load_json("dlrm_synthetic.json")
    cfg = parse_config(raw)
    data = cfg.data
    layout = [1] * data.total_slots
    files = []
    for i, n in enumerate((7, 5)):
        block = generate_block(n, slot_nnz=layout, vocab=[100] * len(layout),
                               dense_dim=data.dense_dim, seed=i)
        p = str(tmp_path / f"p{i}.data")
        write_norm_file(p, block, key_type="I64", check=data.check)
        files.append(p)
    lst = str(tmp_path / "l.txt")
    write_file_list(lst, files)
    ds = NormDataset(lst, data, "I64")
    batches = list(ds.batches(4, epochs=2))
    assert [b.num_valid for b in batches] == [4, 4, 4, 4, 4, 4]  # 12 records x 2 epochs
    one = list(ds.batches(5, epochs=1))
    assert [b.num_valid for b in one] == [5, 5, 2]
    assert os.path.basename(ds.files[0]) == "p0.data"


def test_corrupt_nnz_in_first_record_does_not_exhaust_memory(tmp_path):
    # found by the property test: slot 0's nnz zeroed makes slot 1's "nnz" the low word of a
    # 64-bit key (~2^30); the one-hot fast path once built a key-column list that long
    block = generate_block(40, slot_nnz=[1] * 4, vocab=[100] * 4, dense_dim=2, key_type="I64",
                           seed=7)
    path = str(tmp_path / "d.data")
    write_norm_file(path, block, key_type="I64")
    raw = bytearray(open(path, "rb").read())
    raw[64 + 12:64 + 16] = (0).to_bytes(4, "little")  # record 0, slot 0: nnz 0
    raw[64 + 16:64 + 20] = (1 << 30).to_bytes(4, "little")  # ... then a huge "nnz"
    open(path, "wb").write(bytes(raw))
    with pytest.raises(DataError, match=r"d.data: record 0"):
        read_norm_file(path, label_dim=1, dense_dim=2, slot_num=4, key_type="I64")
