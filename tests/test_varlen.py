"""Variable-length Norm records (multi-hot) decoded by the compiled kernels give exactly the
batches of the general parser, and its errors."""

import dataclasses
from contextlib import contextmanager

import numpy as np
import pytest

import jctr.data.loader as loader
import jctr.data.varlen as varlen
from jctr.config import parse_config
from jctr.data.loader import NormDataset, ReaderPosition
from jctr.data.norm import read_norm_file, write_norm_file
from jctr.data.records import DataError, RecordBlock, write_file_list
from jctr.data.varlen import VarChunk, VarRecords, open_varlen_records
from tests.conftest import load_json
from tests.test_fixed import _write

SLOTS = 4
MAX_NNZ = (3, 2, 1, 1)  # slots 2 and 3 hold 0 or 1 keys: one-hot inputs may take them


def _block(n, seed=0, key_type="I64"):
    rng = np.random.default_rng(seed)
    nnz = rng.integers(0, np.array(MAX_NNZ) + 1, size=(n, SLOTS)).astype(np.int32)
    high = 2**32 if key_type == "I32" else 2**62
    keys = rng.integers(0, high, size=int(nnz.sum()), dtype=np.int64)
    return RecordBlock(rng.random((n, 1), np.float32), rng.normal(size=(n, 3)).astype(np.float32),
                       nnz, keys)


def _data(inputs=1, check="None", max_features=None):
    """One multi-hot input over the four slots, or a multi-hot one (slots 0-1) and a one-hot
    one (slots 2-3)."""
    data = parse_config(load_json("dcn_synthetic.json")).data
    sp = data.sparse[0]
    if inputs == 1:
        sparse = (dataclasses.replace(sp, top="a", slot_num=SLOTS, max_nnz=3,
                                      max_feature_num_per_sample=max_features or 7),)
    else:
        sparse = (dataclasses.replace(sp, top="a", slot_num=2, max_nnz=3,
                                      max_feature_num_per_sample=max_features or 5),
                  dataclasses.replace(sp, top="b", slot_num=2, max_nnz=1,
                                      max_feature_num_per_sample=2))
    return dataclasses.replace(data, sparse=sparse, dense_dim=3, label_dim=1, check=check)


@contextmanager
def general_parser_only():
    """The loader with both batch paths switched off: every file through read_norm_file."""
    fixed, var = loader.open_norm_records, loader.open_varlen_records
    loader.open_norm_records = lambda *a, **k: None
    loader.open_varlen_records = read_norm_file
    try:
        yield
    finally:
        loader.open_norm_records, loader.open_varlen_records = fixed, var


def _batches(lst, data, key_type, general=False, **kw):
    seed = kw.pop("seed", None)
    if general:
        with general_parser_only():
            return list(NormDataset(lst, data, key_type, seed=seed).batches_with_position(**kw))
    return list(NormDataset(lst, data, key_type, seed=seed).batches_with_position(**kw))


def _assert_same(got, want):
    assert len(got) == len(want)
    for (a, pa), (b, pb) in zip(got, want):
        assert pa == pb
        for x, y in zip(a, b):
            for u, v in zip(x if isinstance(x, tuple) else (x,),
                            y if isinstance(y, tuple) else (y,)):
                assert u.dtype == v.dtype and u.shape == v.shape
                np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("key_type", ["I32", "I64"])
@pytest.mark.parametrize("check", ["None", "Sum"])
@pytest.mark.parametrize("inputs", [1, 2])
@pytest.mark.parametrize("window", [varlen.WINDOW_BYTES, 40, 333])
def test_varlen_batches_equal_the_general_parser(tmp_path, monkeypatch, key_type, check, inputs,
                                                 window):
    # small windows: records straddle window ends, and 40 bytes is less than most records
    monkeypatch.setattr(varlen, "WINDOW_BYTES", window)
    lst = _write(tmp_path, [_block(n, s, key_type) for s, n in enumerate((70, 33, 50))],
                 key_type, check)
    data = _data(inputs, check, max_features=12 if inputs == 1 else 6)
    ds = NormDataset(lst, data, key_type)
    assert isinstance(ds._unit(0), VarRecords) and isinstance(ds._unit(0).slice(0, 3), VarChunk)
    for seed in (None, 5):
        kw = dict(batch_size=16, epochs=2, seed=seed)
        got = _batches(lst, data, key_type, **kw)
        _assert_same(got, _batches(lst, data, key_type, general=True, **kw))
        # resuming from any position continues with the same batches
        _assert_same(_batches(lst, data, key_type, start=got[5][1], **kw), got[6:])
    # the padded last batch: masked rows are zeros with the padding segment
    last = got[-1][0]
    n = last.num_valid
    assert 0 < n < 16 and not last.mask[n:].any() and not last.dense[n:].any()
    assert (last.segments[0].reshape(16, -1)[n:] == 16 * data.sparse[0].slot_num).all()


@pytest.mark.parametrize("key_type", ["I32", "I64"])
@pytest.mark.parametrize("check", ["None", "Sum"])
def test_indexed_file_reads_back_as_the_general_parser_block(tmp_path, key_type, check):
    block = _block(90, 3, key_type)
    path = str(tmp_path / "f.data")
    write_norm_file(path, block, key_type=key_type, check=check)
    kw = dict(label_dim=1, dense_dim=3, slot_num=SLOTS, key_type=key_type, check=check)
    records = open_varlen_records(path, **kw)
    assert isinstance(records, VarRecords) and len(records) == 90
    got = records.slice(10, 80).to_block()
    want = read_norm_file(path, **kw).slice(10, 80)
    for f in ("label", "dense", "nnz", "keys"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f))
    # the loader's read_unit and cache_all hand out the same records
    lst = _write(tmp_path, [block], key_type, check)
    ds = NormDataset(lst, _data(1, check, 12), key_type)
    np.testing.assert_array_equal(ds.read_unit(0).keys, block.keys if key_type == "I64"
                                  else read_norm_file(path, **kw).keys)
    ds.cache_all()
    assert isinstance(ds._cache[0], VarRecords)


def test_records_beyond_the_input_limits_get_the_general_error(tmp_path):
    block = _block(60, 1)
    nnz = block.nnz.copy()
    lst = _write(tmp_path, [block])
    # max_feature_num_per_sample just below the record with the most keys
    total = nnz.sum(axis=1)
    r = int(np.argmax(total))
    with pytest.raises(DataError, match=rf"record {r}: {total[r]} keys in sparse input \"a\" "
                                        rf"exceed max_feature_num_per_sample {total[r] - 1}"):
        list(NormDataset(lst, _data(1, max_features=int(total[r]) - 1), "I64")
             .batches(16, epochs=1))
    # a slot of the one-hot input with 2 keys
    extra = 2 - int(nnz[41, 3])
    nnz[41, 3] = 2
    off = np.concatenate([[0], np.cumsum(block.nnz.sum(axis=1))])
    keys = np.insert(block.keys, [int(off[42])] * extra, 7)  # the extra keys end record 41
    lst = _write(tmp_path, [RecordBlock(block.label, block.dense, nnz, keys)])
    with pytest.raises(DataError, match=r"record 41: slot 3 has 2 keys .* one-hot"):
        list(NormDataset(lst, _data(2, max_features=6), "I64").batches(16, epochs=1))


@pytest.mark.parametrize("check,damage", [(c, d) for c in ("None", "Sum")
                                           for d in ("truncate", "nnz", "extra")]
                         + [("Sum", "checksum")])
@pytest.mark.parametrize("window", [varlen.WINDOW_BYTES, 50])
def test_broken_files_raise_the_general_parsers_error(tmp_path, monkeypatch, check, damage,
                                                      window):
    monkeypatch.setattr(varlen, "WINDOW_BYTES", window)
    path = str(tmp_path / "f.data")
    write_norm_file(path, _block(40, 2), check=check)
    raw = bytearray(open(path, "rb").read())
    hdr = 64 + (5 if check == "Sum" else 0)
    if damage == "truncate":
        raw = raw[:-7]
    elif damage == "nnz":  # record 0's first nnz word
        at = hdr + (4 if check == "Sum" else 0) + 16
        raw[at:at + 4] = np.int32(-3).tobytes()
    elif damage == "extra":
        raw += b"\0" * 16
    else:
        raw[hdr + 30] ^= 0x5A  # a dense byte of record 0
    open(path, "wb").write(bytes(raw))
    kw = dict(label_dim=1, dense_dim=3, slot_num=SLOTS, key_type="I64", check=check)
    with pytest.raises(DataError) as want:
        read_norm_file(path, **kw)
    lst = str(tmp_path / "list.txt")
    write_file_list(lst, [path])
    data = _data(1, check, 12)
    for start in (None, ReaderPosition(0, 0, 20)):  # records are validated in file order
        with pytest.raises(DataError) as got:
            list(NormDataset(lst, data, "I64").batches(16, epochs=1, start=start))
        assert str(got.value) == str(want.value) and path in str(got.value)
    for use in ("load", "take"):  # a whole-file validation
        records = open_varlen_records(path, **kw)
        with pytest.raises(DataError) as got:
            records.load() if use == "load" else records.take(np.arange(40))
        assert str(got.value) == str(want.value)


@pytest.mark.parametrize("window", [varlen.WINDOW_BYTES, 64])
def test_resume_in_the_middle_of_a_file(tmp_path, monkeypatch, window):
    monkeypatch.setattr(varlen, "WINDOW_BYTES", window)
    lst = _write(tmp_path, [_block(100, 6)])
    data = _data(2, max_features=6)
    start = ReaderPosition(0, 0, 37)
    _assert_same(_batches(lst, data, "I64", batch_size=16, epochs=1, start=start),
                 _batches(lst, data, "I64", general=True, batch_size=16, epochs=1, start=start))


def test_recycled_buffers_are_never_handed_out_while_in_use(tmp_path):
    import gc

    from jctr.data import buffers

    # earlier tests' buffers may be freed by the collector mid-test and be handed out first:
    # start from an empty pool so the addresses below are this test's own
    gc.collect()
    with buffers._lock:
        buffers._pool.clear()
    a = buffers.take(3 << 20)
    first = a.ctypes.data
    view = a[100:200].view(np.int32)  # a batch field carved from it keeps it in use
    del a
    b = buffers.take(3 << 20)
    assert b.ctypes.data != first
    del view
    c = buffers.take(3 << 20)  # free again: recycled, not a fresh allocation
    assert c.ctypes.data == first
    del b, c
    # batches handed out earlier keep their contents while later ones are decoded
    lst = _write(tmp_path, [_block(90, 8)])
    data = _data(1, max_features=12)
    kept = list(NormDataset(lst, data, "I64").batches(16, epochs=1))
    with general_parser_only():
        want = list(NormDataset(lst, data, "I64").batches(16, epochs=1))
    for x, y in zip(kept, want):
        np.testing.assert_array_equal(x.keys[0], y.keys[0])
        np.testing.assert_array_equal(x.segments[0], y.segments[0])
