"""A bulk store's whole-table passes read from its table files (jctr.stores.table_scan)
against RocksDB's own iterator, over long random sequences of bulk loads, write batches,
erases, flushes and compactions in several tables.

The reader follows RocksDB v9.8.4: ``table/format.cc`` (``Footer::DecodeFrom``: format
versions 1-5, checksum type, the two handles, version, magic), ``table/block_based/block.cc``
(entries: shared, unshared and value lengths, restart array; ``num_restarts``' high bit for a
data-block hash index), ``table/block_based/block_builder.cc``
(``AddWithLastKeyImpl``: an index entry's value is a size delta only after shared key bytes)
and ``index_builder.cc`` / ``IndexValue::EncodeTo`` (zigzag size deltas),
``db/dbformat.h`` (the internal key's trailer: sequence << 8 | type; kTypeValue 1,
kTypeDeletion 0, kTypeSingleDeletion 7) and ``db/version_set.cc``
(``VersionSet::GetLiveFilesMetaData``: per column family, level 0 then 1, 2, ..., each level's
files in the version's order, level 0 newest first)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from jctr.config.hps import PersistentDatabaseParams
from jctr.stores import table_scan
from jctr.stores.rocksdb import RocksDBStore


def _all(store, table, keyed=False):
    parts = list(store.items(table, chunk=1000, keyed=keyed))
    if not parts:
        return np.zeros(0, np.int64), np.zeros((0, store.dim(table) or 0), np.float32)
    keys = np.concatenate([k for k, _ in parts])
    values = np.concatenate([v for _, v in parts])
    order = np.argsort(keys, kind="stable")
    return keys[order], values[order]


def _through_rocksdb(store, table, keyed=False):
    real = store._table_files
    store._table_files = lambda t, flush=False: None
    try:
        return _all(store, table, keyed)
    finally:
        store._table_files = real


@pytest.mark.parametrize("seed,bulk", [(0, True), (1, True), (2, False)])
def test_a_pass_over_the_files_reads_what_rocksdb_reads(tmp_path, monkeypatch, seed, bulk):
    """Random bulk loads (jctr's table files), small write batches (RocksDB's flushes),
    erases (deletions in newer files), manual compactions, two tables of different widths and
    a key range cut into many small ranges, snapshots kept meanwhile (older versions of a
    key kept in a file): after every step, every table's pass over its
    files gives exactly the rows, keys and count RocksDB's iterator gives, and a dictionary
    model of the table; the files were read (not the fallback) at nearly every step. A
    serving database (``bulk`` False: its writes wait in a skip-list memtable) alike: each
    pass flushes the table's memtable first, then reads the files."""
    # many bulk loads, some batches
    monkeypatch.setattr(RocksDBStore, "INGEST_ROWS" if bulk else "INGEST_ROWS_LIVE", 300)
    scans = []
    real_scan = table_scan.scan
    monkeypatch.setattr(table_scan, "scan",
                        lambda files, vb, chunk=65536: scans.append(1) or real_scan(
                            files, vb, chunk, range_entries=257))
    rng = np.random.default_rng(seed)
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")),
                         bulk=bulk)
    dims = {"a": 5, "b": 18}
    model: dict[str, dict[int, np.ndarray]] = {t: {} for t in dims}
    used_files = 0
    held = None
    space = np.concatenate([np.arange(-400, 400), [-2**63, 2**63 - 1, 2**40, -2**40]])
    steps = 40
    for step in range(steps):
        table = "a" if rng.random() < 0.5 else "b"
        dim = dims[table]
        what = rng.random()
        if what < 0.6:
            n = int(rng.choice([3, 50, 299, 300, 900]))
            keys = rng.choice(space, n).astype(np.int64)  # keys given twice: the last wins
            values = rng.normal(size=(n, dim)).astype(np.float32)
            values[:, 0] = step
            store.insert(table, keys, values)
            for k, v in zip(keys.tolist(), values):
                model[table][k] = v
        elif what < 0.85:
            keys = rng.choice(space, int(rng.integers(1, 200))).astype(np.int64)
            store.erase(table, keys)
            for k in keys.tolist():
                model[table].pop(k, None)
        elif store.dim(table) is not None:
            store._families[table].compact_range(None, None)
        if step % 13 == 5 and store.dim(table) is not None:
            # a snapshot kept: flushes and compactions keep a key's older versions beside its
            # newest in one file (newest first) until it is gone
            held = store.db.snapshot()
        elif step % 13 == 9:
            held = None
        for t in dims:
            if store.dim(t) is None:
                continue
            scans.clear()
            got_keys, got = _all(store, t)
            used_files += bool(scans)
            want_keys, want = _through_rocksdb(store, t)
            np.testing.assert_array_equal(got_keys, want_keys)
            np.testing.assert_array_equal(got, want)
            keys = np.array(sorted(model[t]), np.int64)
            np.testing.assert_array_equal(got_keys, keys)
            if keys.size:
                np.testing.assert_array_equal(got, np.stack([model[t][k] for k in keys]))
            assert store.size(t) == keys.size
    assert used_files >= 0.9 * sum(1 for _ in range(steps))
    del held
    store.close()


def test_the_newest_file_wins_and_a_deletion_hides_older_rows(tmp_path):
    """A key written in five successive files (three flushed write batches, two bulk
    loads) and deleted in a sixth, then written again: each pass gives its newest row only
    and never a deleted one; rows of an older format are read through RocksDB (a file not
    naming its family, from a writer before: read the old way, the same rows)."""
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")),
                         bulk=True)
    keys = np.arange(10, dtype=np.int64)
    for i in range(5):
        rows = np.full((10, 3), i, np.float32)
        if i % 2:
            store.ingest_columns("t", keys, [rows])
        else:
            store.insert("t", keys, rows)
        files = store._table_files("t")
        assert files is not None and files  # (RocksDB merges level-0 files meanwhile)
        got_keys, got = _all(store, "t")
        np.testing.assert_array_equal(got_keys, keys)
        assert (got == i).all()
    store.erase("t", keys[:4])
    got_keys, got = _all(store, "t")
    np.testing.assert_array_equal(got_keys, keys[4:])
    store.insert("t", keys[:2], np.full((2, 3), 9, np.float32))
    got_keys, got = _all(store, "t")
    np.testing.assert_array_equal(got_keys, np.concatenate([keys[:2], keys[4:]]))
    assert (got[:2] == 9).all() and (got[2:] == 4).all()
    # a bulk load whose file names no family (written before files named theirs); the
    # table's files compacted into one first, so that RocksDB's own compaction (at four
    # level-0 files) does not merge the unnamed file into a named one meanwhile
    store._families["t"].compact_range(None, None)
    from jctr.stores import rocksdb as rocksdb_module
    from jctr.stores.sst_file import write_table_file

    def unnamed(path, *args, **kwargs):
        kwargs.pop("family", None)
        write_table_file(path, *args, **kwargs)
    real = rocksdb_module.write_table_file
    rocksdb_module.write_table_file = unnamed
    try:
        store.ingest_columns("t", keys[5:7], [np.full((2, 3), 11, np.float32)])
    finally:
        rocksdb_module.write_table_file = real
    assert store._table_files("t") is None
    got_keys, got = _all(store, "t")
    np.testing.assert_array_equal(got_keys, np.concatenate([keys[:2], keys[4:]]))
    assert (got[3:5] == 11).all()
    store.close()


def test_a_file_compacted_away_while_listed_is_listed_again(tmp_path, monkeypatch):
    """The files of a pass are one version of the database: a file that is gone when it
    is mapped (compacted away meanwhile) makes the list be taken again."""
    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path=str(tmp_path / "db")),
                         bulk=True)
    keys = np.arange(100, dtype=np.int64)
    store.ingest_columns("t", keys, [np.ones((100, 2), np.float32)])
    real = table_scan.open_file
    calls = []

    def gone_once(path, family=None):
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(path)
        return real(path, family)
    monkeypatch.setattr(table_scan, "open_file", gone_once)
    files = store._table_files("t")
    assert files is not None and sum(f.entries for f in files) == 100
    assert len(calls) > len(store.db.live_files())
    store.close()


def test_the_reader_refuses_what_it_does_not_follow(tmp_path):
    """A file of another format version or checksum type, or not a table file at all, is
    Unreadable (the caller reads through RocksDB), never misread."""
    from jctr.stores.base import key_columns
    from jctr.stores.sst_file import write_table_file

    path = str(tmp_path / "f.sst")
    write_table_file(path, key_columns(np.arange(5, dtype=np.int64)),
                     [np.zeros((5, 2), np.float32)], family="t")
    assert table_scan.open_file(path).family == "t"
    data = bytearray(open(path, "rb").read())
    for where, value in ((-12, 6), (-53, 4)):  # format version 6; XXH3 checksums
        bad = bytearray(data)
        bad[where] = value
        open(path, "wb").write(bytes(bad))
        with pytest.raises(table_scan.Unreadable):
            table_scan.open_file(path)
    open(path, "wb").write(b"x" * 100)
    with pytest.raises(table_scan.Unreadable):
        table_scan.open_file(path)
    os.remove(path)
    with pytest.raises(FileNotFoundError):
        table_scan.open_file(path)


def test_a_pass_lets_go_of_the_pages_it_has_read(tmp_path):
    """A pass over a table larger than memory held every page of its files it had read in
    the process's resident memory until the pass ended (a server's pass over 20M rows: 1.4 ->
    3.1 GB resident). Each key range's blocks are let go of once its rows are handed out:
    while the files stay mapped, after the pass, a small part of them is resident (the
    pages stay in the page cache: a second pass reads the same rows). Resident pages of the
    file's mapping as Linux's /proc/self/smaps counts them (jctr runs on Linux)."""
    from jctr.stores.base import bytewise_order, key_columns
    from jctr.stores.sst_file import write_table_file

    path = str(tmp_path / "big.sst")
    keys = np.arange(120_000, dtype=np.int64)
    keys = keys[bytewise_order(key_columns(keys))]  # a table file's order
    rows = np.random.default_rng(3).random((keys.size, 64), dtype=np.float32)  # ~31 MB
    write_table_file(path, key_columns(keys), [rows], family="t")
    keys, rows = keys[np.argsort(keys)], rows[np.argsort(keys)]
    f = table_scan.open_file(path, "t")

    def resident_kb() -> int:
        with open("/proc/self/smaps", encoding="utf-8") as smaps:
            lines = smaps.read().splitlines()
        total, inside = 0, False
        for line in lines:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's first line
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
        return total

    size_kb = os.path.getsize(path) // 1024
    for _ in range(2):
        got_keys, got = [], []
        for k, r in table_scan.scan([f], 4 * 64, 8192, range_entries=8192):
            got_keys.append(k)
            got.append(r.view(np.float32).copy())
        order = np.argsort(np.concatenate(got_keys))
        np.testing.assert_array_equal(np.concatenate(got_keys)[order], keys)
        np.testing.assert_array_equal(np.concatenate(got)[order], rows)
        assert resident_kb() < size_kb // 4, (resident_kb(), size_kb)
