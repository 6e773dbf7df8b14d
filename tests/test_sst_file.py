"""RocksDB table files written by jctr (:mod:`jctr.stores.sst_file`) and their CRC-32C
(:mod:`jctr.ops.checksum`), checked against RocksDB itself (rocksdict's build of RocksDB
9.8.4) reading and ingesting them.

The layout follows RocksDB's source at v9.8.4: ``table/format.cc`` (``Footer::EncodeTo``:
checksum type, meta-index and index handles padded to 41 bytes, format version, magic;
``ComputeBuiltinChecksumWithLastByte``: a block's masked CRC-32C covers its type byte),
``table/block_based/block_builder.cc`` (entries of shared / unshared / value lengths, restart
points, their count), ``table/meta_blocks.cc`` (``PropertyBlockBuilder::AddTableProperty``:
numbers as varints, sorted names) and ``db/external_sst_file_ingestion_job.cc``
(``GetIngestedFileInfo`` / ``SanityCheckTableProperties``: the writer's version 2 with a global
sequence number, sequence numbers 0, the column family unknown)."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from jctr.config.hps import PersistentDatabaseParams
from jctr.ops import checksum
from jctr.stores.base import bytewise_order, key_columns
from jctr.stores.rocksdb import RocksDBStore
from jctr.stores.sst_file import write_table_file


@pytest.mark.parametrize("portable", [False, True])
def test_crc32c_of_known_vectors(portable):
    """RFC 3720 (iSCSI) B.4's CRC-32C vectors and the "123456789" check value; the CPU's
    instruction and the portable loop agree on every length and alignment."""
    crc = lambda b: checksum.crc32c(b, portable=portable)  # noqa: E731
    assert crc(b"123456789") == 0xE3069283
    assert crc(bytes(32)) == 0x8A9136AA
    assert crc(b"\xff" * 32) == 0x62A8AB43
    assert crc(bytes(range(32))) == 0x46DD794E
    assert crc(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert crc(b"") == 0
    data = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
    for start in range(9):
        for stop in (start, start + 1, start + 7, start + 8, start + 9, 1000):
            assert checksum.crc32c(data[start:stop]) == \
                checksum.crc32c(data[start:stop], portable=True)
    assert checksum.masked(0) == 0xA282EAD8  # crc32c::Mask
    for crc in (1, 0x80000000, 0xFFFFFFFF, 0x5D7A_31C4, 0xE3069283):  # = the compiled mask
        assert checksum.masked(crc) == int(checksum.mask(np.uint32(crc)))


def _ingested(tmp_path, name, keys, columns, order=None, **kwargs):
    """A bulk RocksDB store whose table ``t`` is one table file jctr wrote."""
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / name)),
                         bulk=True)
    dim = sum(c.shape[1] for c in columns)
    store._family("t", create_dim=dim)
    path = str(tmp_path / f"{name}.sst")
    write_table_file(path, keys, columns, order, **kwargs)
    options = store._rd.IngestExternalFileOptions()
    options.set_move_files(True)
    store.db.get_column_family("t").ingest_external_file([path], options)
    return store


@pytest.mark.parametrize("width,block_size", [(1, 4096), (61, 4096), (3000, 4096), (7500, 4096),
                                              (16, 256)])
def test_rocksdb_reads_and_ingests_the_table_files_jctr_writes(tmp_path, width, block_size):
    """Keys over int64's whole range (negative, extremes) in RocksDB's byte order, values of
    one float to wider than a block, gathered from two column blocks through an order: every
    key reads back its row by point reads and by a scan, absent keys are absent, and keys
    written later (a write batch) and before (an older file) sort among them. 7,500 floats: rows
    so wide that a chunk's rows, gathered in file order first, take more than a chunk."""
    rng = np.random.default_rng(width)
    n = 20_000 if width < 1000 else 600
    keys = np.unique(np.concatenate([rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64),
                                     [-2**63, -1, 0, 1, 2**63 - 1]]))
    rng.shuffle(keys)
    values = rng.random((keys.size, width)).astype(np.float32)
    order = bytewise_order(key_columns(keys))
    columns = [values[:, :width // 2 + 1], values[:, width // 2 + 1:]]
    columns = [c.copy() for c in columns if c.shape[1]]
    store = _ingested(tmp_path, "db", key_columns(keys[order]), columns, order,
                      block_size=block_size, direct=width != 1)
    got, found = store.lookup("t", keys, width)
    assert found.all()
    np.testing.assert_array_equal(got, values)
    scanned = {k: v for ks, vs in store.items("t") for k, v in zip(ks.tolist(), vs)}
    assert sorted(scanned) == sorted(keys.tolist())
    np.testing.assert_array_equal(np.stack([scanned[k] for k in keys.tolist()]), values)
    absent = rng.integers(-2**63, 2**63 - 1, 500, dtype=np.int64)
    absent = absent[~np.isin(absent, keys)]
    assert not store.lookup("t", absent, width)[1].any()
    store.insert("t", keys[:10], values[:10] + 1)  # a write batch over ingested rows
    np.testing.assert_array_equal(store.lookup("t", keys[:12], width)[0][:10], values[:10] + 1)
    np.testing.assert_array_equal(store.lookup("t", keys[:12], width)[0][10:], values[10:12])
    store.close()


@pytest.mark.parametrize("n", [2, 63, 20_000])
def test_rocksdb_reads_the_bloom_filter_jctr_writes(tmp_path, n):
    """A file's full bloom filter (RocksDB's FastLocalBloom at 10 bits a key, as
    ``util/bloom_impl.h`` ``FastLocalBloomImpl::AddHash`` and ``table/block_based/
    filter_policy.cc`` ``FastLocalBloomBitsBuilder::Finish`` at v9.8.4 lay it out, keyed by
    ``util/xxph3.h``'s hash of the 8 key bytes) is what RocksDB reads: with statistics on,
    every key of the file is found (a filter that hashed one byte differently would turn
    nearly every present key away), and nearly every absent key is turned away by the filter
    without a data block read (``rocksdb.bloom.filter.useful``; ~1% false positives at 10
    bits a key). Without a filter RocksDB reads a data block of every level-0 file a key
    could be in."""
    import re

    import rocksdict

    rng = np.random.default_rng(n)
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64))
    values = rng.random((keys.size, 3)).astype(np.float32)
    order = bytewise_order(key_columns(keys))
    path = str(tmp_path / "f.sst")
    write_table_file(path, key_columns(keys[order]), [values], order)
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.enable_statistics()
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    opts.set_block_based_table_factory(table)
    db = rocksdict.Rdict(str(tmp_path / "db"), opts)
    db.ingest_external_file([path], rocksdict.IngestExternalFileOptions())
    got = db.get([k.tobytes() for k in key_columns(keys)])
    assert [np.frombuffer(g, np.float32).tolist() for g in got] == values.tolist()
    absent = rng.integers(-2**63, 2**63 - 1, 5000, dtype=np.int64)
    absent = absent[~np.isin(absent, keys)]
    assert all(g is None for g in db.get([k.tobytes() for k in key_columns(absent)]))

    def count(name):
        return int(re.search(rf"rocksdb\.bloom\.filter\.{name} COUNT : (\d+)",
                             opts.get_statistics()).group(1))

    # (a key outside the file's first and last key bytes never reaches its filter)
    order_of = lambda k: key_columns(k).view(">u8").ravel()  # noqa: E731
    first, last = order_of(keys).min(), order_of(keys).max()
    inside = int(((order_of(absent) > first) & (order_of(absent) < last)).sum())
    assert count("full.true.positive") == keys.size
    assert inside > 1000 and count("useful") >= 0.97 * inside
    db.close()


@pytest.mark.parametrize("named", [False, True])
def test_a_damaged_block_is_found_by_its_checksum(tmp_path, named):
    """Every block carries a real CRC: one flipped byte in the middle of the file makes
    RocksDB refuse the rows it holds: point reads raise, and a pass over the table raises a
    StoreError (rocksdict's own iteration would just end there, half the rows read). A file
    that names its column family (``named``: as a bulk load's do) is read by jctr itself
    (jctr.stores.table_scan), which finds the block by its checksum too."""
    from jctr.stores.base import StoreError

    rng = np.random.default_rng(3)
    keys = np.sort(rng.choice(2**40, 50_000, replace=False)).astype(np.int64)
    values = rng.random((keys.size, 14)).astype(np.float32)
    order = bytewise_order(key_columns(keys))
    path = str(tmp_path / "a.sst")
    # rows that hold their keys (two float32 first), so both kinds of pass apply
    write_table_file(path, key_columns(keys[order]),
                     [keys.view(np.float32).reshape(-1, 2), values], order,
                     family="t" if named else "")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")),
                         bulk=True)
    store._family("t", create_dim=16)
    options = store._rd.IngestExternalFileOptions()
    store.db.get_column_family("t").ingest_external_file([path], options)
    with pytest.raises(Exception, match="checksum mismatch"):
        store.lookup("t", keys, 16)
    said = ("table t: the database cannot be read: .*\\.sst: data block .* does not match "
            "its checksum" if named else "table t: the database cannot be read past key "
            "bytes .*checksum mismatch")
    for keyed in (False, True):
        with pytest.raises(StoreError, match=said):
            for _ in store.items("t", keyed=keyed):
                pass
    store.close()


def test_keys_out_of_order_are_refused_and_no_file_is_left(tmp_path):
    keys = key_columns(np.array([3, 1, 2], np.int64))  # little-endian bytes: 3 > 1 bytewise
    values = np.zeros((3, 4), np.float32)
    path = tmp_path / "bad.sst"
    with pytest.raises(ValueError, match="key 1 is not above"):
        write_table_file(str(path), keys, [values])
    assert not path.exists()
    twice = key_columns(np.array([1, 1], np.int64))
    with pytest.raises(ValueError, match="key 1 is not above"):
        write_table_file(str(path), twice, [values[:2]])
    with pytest.raises(ValueError, match="no rows"):
        write_table_file(str(path), twice[:0], [values[:0]])
    assert not path.exists()


def test_a_bulk_load_uses_jctrs_file_and_falls_back_to_rocksdicts_writer(tmp_path,
                                                                          monkeypatch):
    """A bulk store's large insert goes through jctr's table file (no warning, nothing left
    beside the database); a RocksDB that refuses such a file (here: a damaged footer) gets
    rocksdict's writer, with a warning, and the rows are the same either way."""
    import jctr.stores.rocksdb as rocksdb

    monkeypatch.setattr(RocksDBStore, "INGEST_ROWS", 1)
    monkeypatch.setattr(RocksDBStore, "_own_files", True)
    rng = np.random.default_rng(4)
    keys = rng.choice(10**9, 5000, replace=False).astype(np.int64)
    values = rng.random((keys.size, 8)).astype(np.float32)
    answers = []
    for name in ("own", "fallback"):
        path = str(tmp_path / name)
        store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=path), bulk=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if name == "fallback":
                def damaged(path, *args, **kwargs):
                    write_table_file(path, *args, **kwargs)
                    with open(path, "r+b") as f:  # the magic number
                        f.seek(-3, os.SEEK_END)
                        f.write(b"\0\0\0")
                monkeypatch.setattr(rocksdb, "write_table_file", damaged)
            store.insert("t", keys, values)
        assert (name == "fallback") == any("rocksdict's writer" in str(w.message)
                                           for w in seen)
        assert RocksDBStore._own_files == (name == "own")
        assert not [f for f in os.listdir(path) if f.startswith("jctr-ingest")]
        answers.append(store.lookup("t", keys, 8))
        store.close()
    for got, found in answers:
        assert found.all()
        np.testing.assert_array_equal(got, values)


def test_a_write_during_a_pass_over_a_table_is_not_taken_for_a_damaged_one(tmp_path):
    """Rows written while a pass runs (after its last key, as another writer would) are
    not taken for a damaged table: the pass reads the table as it was when it began, and
    raises nothing."""
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")),
                         bulk=True)
    keys = np.arange(150_000, dtype=np.int64)
    store.insert("t", keys, np.zeros((keys.size, 2), np.float32))
    chunks = store.items("t", chunk=65536)
    first = next(chunks)
    store.insert("t", np.array([-1, 2**62], np.int64), np.ones((2, 2), np.float32))
    seen = first[0].size + sum(k.size for k, _ in chunks)
    assert seen == keys.size
    assert store.lookup("t", np.array([-1, 2**62]), 2)[1].all()
    store.close()
