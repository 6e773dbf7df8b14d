"""The batch-by-batch path for fixed-size records (Raw, one-hot Norm) gives exactly the batches
of the general parser, and falls back to it (or raises its errors) when a file is not fixed."""

import dataclasses

import numpy as np
import pytest

import jctr.data.loader as loader
from jctr.config import parse_config
from jctr.data.fixed import FixedChunk, FixedRecords
from jctr.data.loader import NormDataset, ReaderPosition, build_batch
from jctr.data.norm import read_norm_file, write_norm_file
from jctr.data.raw import write_raw_file
from jctr.data.records import DataError, RecordBlock, write_file_list
from jctr.data.tools.synthetic import generate_block
from tests.conftest import load_json

SLOTS = 4


def _data(max_nnz=1, inputs=1, check="None"):
    """The Data layer of a small config: ``inputs`` one-hot sparse inputs sharing SLOTS slots."""
    data = parse_config(load_json("dcn_synthetic.json")).data
    sp = data.sparse[0]
    per = SLOTS // inputs
    sparse = tuple(dataclasses.replace(sp, top=f"in{i}", slot_num=per, max_nnz=max_nnz,
                                       max_feature_num_per_sample=per * max_nnz)
                   for i in range(inputs))
    return dataclasses.replace(data, sparse=sparse, dense_dim=3, label_dim=1, check=check)


def _write(tmp_path, blocks, key_type="I64", check="None"):
    files = []
    for i, b in enumerate(blocks):
        p = str(tmp_path / f"f{i}.data")
        write_norm_file(p, b, key_type=key_type, check=check)
        files.append(p)
    lst = str(tmp_path / "list.txt")
    write_file_list(lst, files)
    return lst


def _one_hot(n, seed=0, key_type="I64"):
    return generate_block(n, slot_nnz=[1] * SLOTS, vocab=[1000] * SLOTS, dense_dim=3,
                          key_type=key_type, seed=seed)


def _general_batches(ds, batch, **kw):
    """The same batches with the fixed path switched off."""
    orig = loader.open_norm_records
    loader.open_norm_records = lambda *a, **k: None
    try:
        return list(ds.batches_with_position(batch, **kw))
    finally:
        loader.open_norm_records = orig


def _assert_same(got, want):
    assert len(got) == len(want)
    for (a, pa), (b, pb) in zip(got, want):
        assert pa == pb
        for x, y in zip(a, b):
            for u, v in zip(x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple)
                            else (y,)):
                assert u.dtype == v.dtype
                np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("key_type", ["I32", "I64"])
@pytest.mark.parametrize("check", ["None", "Sum"])
@pytest.mark.parametrize("inputs", [1, 2])
def test_fixed_norm_batches_equal_the_general_parser(tmp_path, key_type, check, inputs):
    # three files of different lengths: batches straddle files, the last one is padded
    lst = _write(tmp_path, [_one_hot(n, s, key_type) for s, n in enumerate((70, 33, 50))],
                 key_type, check)
    data = _data(inputs=inputs, check=check)
    for seed in (None, 5):
        ds = NormDataset(lst, data, key_type, seed=seed)
        assert isinstance(ds._unit(0), FixedRecords) and isinstance(ds._unit(0).slice(0, 3),
                                                                    FixedChunk)
        got = list(ds.batches_with_position(16, epochs=2))
        _assert_same(got, _general_batches(NormDataset(lst, data, key_type, seed=seed), 16,
                                           epochs=2))
        # resuming from any position continues with the same batches
        start = got[5][1]
        _assert_same(list(NormDataset(lst, data, key_type, seed=seed)
                          .batches_with_position(16, epochs=2, start=start)), got[6:])
    full = got[0][0]
    assert not full.segments[0].flags.writeable  # the shared arange of full batches


def _odd_file(tmp_path, check="None"):
    """A one-hot file of the right size for one-hot, except record 70 has 2 keys in slot 1 and
    none in slot 2."""
    block = _one_hot(100)
    nnz = block.nnz.copy()
    nnz[70, 1], nnz[70, 2] = 2, 0
    return _write(tmp_path, [RecordBlock(block.label, block.dense, nnz, block.keys)],
                  check=check)


def test_file_that_is_not_fixed_falls_back_mid_file(tmp_path):
    lst = _odd_file(tmp_path)
    data = _data(max_nnz=2)
    ds = NormDataset(lst, data, "I64")
    assert isinstance(ds._unit(0), FixedRecords)  # the first record looks one-hot
    got = list(ds.batches_with_position(16, epochs=1))
    _assert_same(got, _general_batches(NormDataset(lst, data, "I64"), 16, epochs=1))
    # resuming past the odd record validates the records before it first
    got2 = list(NormDataset(lst, data, "I64").batches_with_position(
        16, epochs=1, start=ReaderPosition(0, 0, 80)))
    _assert_same(got2, _general_batches(NormDataset(lst, data, "I64"), 16, epochs=1,
                                        start=ReaderPosition(0, 0, 80)))
    # a one-hot input gets the general parser's error for record 70
    with pytest.raises(DataError, match=r"record 70: slot 1 has 2 keys .* one-hot"):
        list(NormDataset(lst, _data(max_nnz=1), "I64").batches(16, epochs=1))


def test_checksum_error_in_a_later_batch_names_the_record(tmp_path):
    lst = _write(tmp_path, [_one_hot(100)], check="Sum")
    path = str(tmp_path / "f0.data")
    raw = bytearray(open(path, "rb").read())
    rec = 4 + 4 * 4 + SLOTS * 12 + 1
    raw[69 + 83 * rec + 9] ^= 0x11  # a dense byte of record 83
    open(path, "wb").write(bytes(raw))
    ds = NormDataset(lst, _data(check="Sum"), "I64")
    with pytest.raises(DataError, match=r"record 83: checksum mismatch"):
        list(ds.batches(16, epochs=1))
    with pytest.raises(DataError, match=r"record 83: checksum mismatch"):
        read_norm_file(path, label_dim=1, dense_dim=3, slot_num=SLOTS, key_type="I64",
                       check="Sum")


def test_raw_batches_keys_offsets_and_range_errors(tmp_path):
    rng = np.random.default_rng(0)
    n, vocab = 300, [7, 50, 1, 3]
    label = rng.integers(0, 2, (n, 1))
    dense = rng.integers(-2, 1000, (n, 3))
    keys = np.stack([rng.integers(0, v, n) for v in vocab], axis=1)
    path = str(tmp_path / "d.bin")
    write_raw_file(path, label, dense, keys)
    data = dataclasses.replace(_data(), format="Raw", slot_size_array=tuple(vocab),
                               num_samples=n, eval_num_samples=n, float_label_dense=False)
    ds = loader.open_dataset(path, data, "I32")
    batches = list(ds.batches(64, epochs=1))
    want = build_batch(RecordBlock(label.astype(np.float32),
                                   np.log1p(np.maximum(dense, 0)).astype(np.float32),
                                   np.ones((n, SLOTS), np.int32),
                                   (keys + np.cumsum([0] + vocab[:-1])).ravel()), 320,
                       data.sparse)
    for i, b in enumerate(batches):
        rows = slice(64 * i, min(n, 64 * (i + 1)))
        k = rows.stop - rows.start
        np.testing.assert_array_equal(b.label[:k], want.label[rows])
        np.testing.assert_allclose(b.dense[:k], want.dense[rows], rtol=1e-6)
        np.testing.assert_array_equal(b.keys[0][:k * SLOTS],
                                      want.keys[0][rows.start * SLOTS:rows.stop * SLOTS])
        assert b.mask.sum() == k and (b.segments[0][k * SLOTS:] == 64 * SLOTS).all()
    keys[250, 2] = 1  # slot 2 holds only key 0
    write_raw_file(path, label, dense, keys)
    with pytest.raises(DataError, match=r"d.bin: record 250: slot 2 key 1 is outside "
                                        r"slot_size_array\[2\] = 1"):
        list(loader.open_dataset(path, data, "I32").batches(64, epochs=1))
    keys[250, 2], keys[10, 0] = 0, -3
    write_raw_file(path, label, dense, keys)
    with pytest.raises(DataError, match=r"record 10: slot 0 key -3 is outside"):
        list(loader.open_dataset(path, data, "I32").batches(64, epochs=1))
