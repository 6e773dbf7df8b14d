"""Property test: a valid data file mutated at random reads as correct data or fails with a
DataError naming the file -- never another exception, never a hang."""

import os
import signal

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jctr.config.schema import SparseInputConfig
from jctr.data.dataset import build_batch
from jctr.data.norm import read_norm_file, write_norm_file
from jctr.data.records import DataError
from jctr.data.tools.synthetic import generate_block

SLOTS = 4
SPARSE = (SparseInputConfig("a", "DistributedSlot", 12, SLOTS, 3),)


def _valid(tmp, check, key_type):
    block = generate_block(40, slot_nnz=[3, 1, 2, 3], vocab=[100] * SLOTS, dense_dim=2,
                           key_type=key_type, seed=5)
    path = os.path.join(tmp, f"f_{check}_{key_type}.data")
    write_norm_file(path, block, key_type=key_type, check=check)
    with open(path, "rb") as f:
        return path, f.read(), block


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout()


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.integers(0, 255)),
    st.tuples(st.just("int32"), st.integers(0, 2_500), st.integers(-(2**31), 2**31 - 1)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(check=st.sampled_from(["None", "Sum"]), key_type=st.sampled_from(["I32", "I64"]),
       muts=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_norm_files_fail_cleanly(tmp_path, check, key_type, muts):
    path, data, block = _valid(str(tmp_path), check, key_type)
    buf = _mutate(data, muts)
    with open(path, "wb") as f:
        f.write(bytes(buf))
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        got = read_norm_file(path, label_dim=1, dense_dim=2, slot_num=SLOTS,
                             key_type=key_type, check=check)
        # whatever parsed must be well-formed, and batching it either works or names the record
        assert got.nnz.shape == (len(got), SLOTS) and (got.nnz >= 0).all()
        assert got.keys.size == int(got.nnz.sum())
        if bytes(buf) == data:
            np.testing.assert_array_equal(got.keys, block.keys)
        try:
            build_batch(got.slice(0, min(len(got), 64)), 64, SPARSE, path)
        except DataError as e:
            assert path in str(e)
    except DataError as e:
        assert path in str(e)
    except _Timeout:
        raise AssertionError(f"reading hung on mutations {muts}") from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _mutate(data: bytes, muts) -> bytes:
    buf = bytearray(data)
    for kind, pos, val in muts:
        pos = pos % max(len(buf), 1)
        if kind == "flip" and buf:
            buf[pos] ^= val
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "insert":
            buf[pos:pos] = bytes([val])
        elif kind == "int32" and len(buf) >= 4:
            p = (pos * 4) % (len(buf) - 3)
            buf[p:p + 4] = int(val).to_bytes(4, "little", signed=True)
    return bytes(buf)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(["Raw", "Parquet"]), muts=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_raw_and_parquet_files_fail_cleanly(tmp_path, fmt, muts):
    import copy

    from jctr.config import parse_config
    from jctr.data.loader import open_dataset
    from jctr.data.tools.synthetic import write_format
    from tests.conftest import load_json

    folder = tmp_path / fmt
    path = str(folder / ("d.bin" if fmt == "Raw" else "_file_list.txt"))
    kw = dict(slot_nnz=[1] * 8, vocab=[30] * 8, dense_dim=13, seed=2)
    if not os.path.exists(path):
        write_format(fmt, path, 60, num_files=1, **kw)
    victim = path if fmt == "Raw" else str(folder / "part_0000.parquet")
    with open(victim, "rb") as f:
        original = f.read()
    with open(victim, "wb") as f:
        f.write(_mutate(original, muts))
    raw = copy.deepcopy(load_json("dcn_synthetic.json"))
    d = raw["layers"][0]
    d.pop("synthetic")
    d.update(format=fmt, check="None", source=path, eval_source=path,
             slot_size_array=[30] * 8)
    if fmt == "Raw":
        d.update(num_samples=60, eval_num_samples=60, float_label_dense=True)
    try:
        ds = open_dataset(path, parse_config(raw).data, "I64")
        blocks = []
        for i in ds.host_units():
            block = ds.read_unit(i)
            assert block.keys.size == int(block.nnz.sum())
            blocks.append(block)
        # the batch path (Raw: chunks validated and decoded one batch at a time) agrees
        keys = np.concatenate([b.keys for b in blocks])
        got = [b for b in open_dataset(path, parse_config(raw).data, "I64").batches(16, epochs=1)]
        np.testing.assert_array_equal(
            np.concatenate([b.keys[0][:b.num_valid * 8] for b in got]), keys)
    except DataError as e:
        assert victim in str(e) or path in str(e)
    finally:
        with open(victim, "wb") as f:
            f.write(original)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(check=st.sampled_from(["None", "Sum"]), key_type=st.sampled_from(["I32", "I64"]),
       muts=st.lists(mutation, min_size=1, max_size=3), resume=st.integers(0, 39),
       hot=st.sampled_from([1, 3]), window=st.sampled_from([1 << 20, 37, 200]))
def test_mutated_norm_batches_match_the_general_parser(tmp_path, check, key_type, muts, resume,
                                                       hot, window):
    """The batch paths (fixed records for one-hot Norm, the compiled kernels for multi-hot) on
    a mutated file: the same batches as the general parser, or a DataError naming the file --
    also when resuming mid-file."""
    import dataclasses

    import jctr.data.varlen as varlen
    from jctr.config import parse_config
    from jctr.data.loader import NormDataset, ReaderPosition
    from jctr.data.records import write_file_list
    from tests.conftest import load_json
    from tests.test_varlen import general_parser_only

    default_window = varlen.WINDOW_BYTES

    block = generate_block(40, slot_nnz=[hot, 1, hot, 1], vocab=[100] * SLOTS, dense_dim=2,
                           key_type=key_type, seed=7)
    path = str(tmp_path / f"h_{check}_{key_type}.data")
    write_norm_file(path, block, key_type=key_type, check=check)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(_mutate(data, muts))
    lst = str(tmp_path / f"h_{check}_{key_type}.txt")
    write_file_list(lst, [path])
    cfg = parse_config(load_json("dcn_synthetic.json")).data
    sp = dataclasses.replace(cfg.sparse[0], slot_num=SLOTS, max_nnz=max(hot, 2),
                             max_feature_num_per_sample=2 * SLOTS)
    cfg = dataclasses.replace(cfg, sparse=(sp,), dense_dim=2, label_dim=1, check=check)
    start = ReaderPosition(0, 0, resume)

    def run():
        try:
            varlen.WINDOW_BYTES = window  # multi-hot files pass through windows of this size
            return [b for b, _ in NormDataset(lst, cfg, key_type).batches_with_position(
                16, epochs=1, start=start)]
        except DataError as e:
            assert path in str(e)
            return "error"
        finally:
            varlen.WINDOW_BYTES = default_window

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        got = run()
        with general_parser_only():
            want = run()
    except _Timeout:
        raise AssertionError(f"reading hung on mutations {muts}") from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if want == "error" or got == "error":
        # the batch paths may only fail where the general one fails
        assert got == want, (got if got == "error" else "batches", want)
        return
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for x, y in zip(jax_leaves(a), jax_leaves(b)):
            np.testing.assert_array_equal(x, y)


def jax_leaves(batch):
    out = []
    for f in batch:
        out.extend(f if isinstance(f, tuple) else (f,))
    return out
