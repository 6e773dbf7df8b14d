"""The ``row_file`` sparse_store (jctr/stores/row_file.py): rows of fixed width in mapped
files with an in-memory index, against a dictionary model of the same writes."""

import os

import numpy as np
import pytest

from jctr.stores.base import StoreError
from jctr.stores.row_file import RowFileStore
from tests.conftest import mappings_under


def _check(store: RowFileStore, table: str, model: dict[int, np.ndarray], width: int) -> None:
    keys = np.array(sorted(model), np.int64)
    assert store.size(table) == keys.size
    rows, found = store.lookup(table, np.concatenate([keys, [-5, 10**15]]), width)
    assert found[:keys.size].all() and not found[keys.size:].any()
    if keys.size:
        np.testing.assert_array_equal(rows[:keys.size], np.stack([model[k] for k in keys]))
    assert not rows[keys.size:].any()
    seen = {}
    for k, r in store.items(table, chunk=700):
        seen.update(zip(k.tolist(), r))
    assert sorted(seen) == keys.tolist()
    for k in keys[:50]:
        np.testing.assert_array_equal(seen[int(k)], model[int(k)])


@pytest.mark.parametrize("mapped_index", [False, True])
def test_row_file_equals_a_dictionary_over_inserts_erases_and_reopens(tmp_path, monkeypatch,
                                                                      mapped_index):
    """A long random sequence of inserts (new and known keys, a key given twice keeps its
    last row, column blocks side by side), erases (freed rows are taken again: the files
    stop growing once the keys stop growing) and reopens (the index rebuilt from the key
    column) holds what a dictionary holds, key for key; also with the index in a mapped
    file (``INDEX_IN_MEMORY_SHARE`` 0: an index past a share of the memory left), which
    leaves no file in the table's folder."""
    from jctr.stores import row_file

    if mapped_index:
        monkeypatch.setattr(row_file._Table, "INDEX_IN_MEMORY_SHARE", 0.0)
    rng = np.random.default_rng(0)
    width, table = 5, "online.t"
    store = RowFileStore(str(tmp_path / "rows"))
    model: dict[int, np.ndarray] = {}
    for step in range(40):
        n = int(rng.integers(1, 3000))
        keys = rng.integers(-(10**6), 10**6, n)
        rows = rng.normal(size=(n, width)).astype(np.float32)
        if step % 3:
            store.insert(table, keys, rows)
        else:
            store.ingest_columns(table, keys, [rows[:, :2], rows[:, 2:]])
        for k, r in zip(keys.tolist(), rows):
            model[k] = r
        if step % 4 == 3:
            known = np.array(list(model), np.int64)
            gone = rng.choice(known, known.size // 3, replace=False)
            store.erase(table, np.concatenate([gone, gone[:5], [10**12]]))
            for k in gone.tolist():
                del model[k]
        if step % 10 == 9:
            store.close()
            store = RowFileStore(str(tmp_path / "rows"))
        _check(store, table, model, width)
    size = os.path.getsize(tmp_path / "rows" / "tables" / table / "rows.f32")
    for _ in range(5):  # as many keys erased as written: freed rows are taken again
        known = np.array(list(model), np.int64)
        gone = known[:2000]
        store.erase(table, gone)
        for k in gone.tolist():
            del model[k]
        keys = rng.integers(10**7, 10**8, 2000)
        rows = rng.normal(size=(2000, width)).astype(np.float32)
        store.insert(table, keys, rows)
        model.update(zip(keys.tolist(), rows))
    _check(store, table, model, width)
    assert os.path.getsize(tmp_path / "rows" / "tables" / table / "rows.f32") == size
    t = store._tables[table]
    assert (t._mapped is not None) == mapped_index
    maps = [line for line in mappings_under(tmp_path / "rows" / "tables")
            if "rows.f32" not in line and "keys.i64" not in line]
    assert bool(maps) == mapped_index and all("(deleted)" in line for line in maps), maps
    assert sorted(os.listdir(tmp_path / "rows" / "tables" / table)) == [
        "keys.i64", "rows.f32", "table.json"]
    store.close()


def test_row_file_refuses_what_it_cannot_hold(tmp_path):
    """Rows of another width, and a folder that holds other files (a RocksDB sparse_store
    opened as row_file), are refused with the path; nothing is written there."""
    store = RowFileStore(str(tmp_path / "rows"))
    store.insert("t", np.arange(3), np.ones((3, 4), np.float32))
    with pytest.raises(StoreError, match="vectors of size 4"):
        store.insert("t", np.arange(3), np.ones((3, 5), np.float32))
    with pytest.raises(StoreError, match="size 4, asked for size 2"):
        store.lookup("t", np.arange(3), 2)
    assert store.lookup("absent", np.arange(2), 4)[1].tolist() == [False, False]
    store.set_meta("online.owner", {"run": "a"})
    assert store.get_meta("online.owner") == {"run": "a"} and store.get_meta("x") is None
    store.set_meta("online.owner", None)
    assert store.get_meta("online.owner") is None
    store.drop_table("t")
    assert store.size("t") == 0 and store.lookup("t", np.arange(3), 4)[1].sum() == 0
    store.close()
    other = tmp_path / "rocks"
    other.mkdir()
    (other / "CURRENT").write_text("MANIFEST-000001\n")
    with pytest.raises(StoreError, match=f"{other}: holds files that are not"):
        RowFileStore(str(other))
    assert sorted(os.listdir(other)) == ["CURRENT"]


def test_row_file_refuses_to_grow_onto_a_full_disk(tmp_path, monkeypatch):
    """A table grows its files with their blocks allocated: a full disk is an error naming
    the file when the table grows (a write into a mapped page the disk has no room for
    would kill the process), and the rows stored before stay as they were."""
    import errno

    store = RowFileStore(str(tmp_path / "rows"))
    keys = np.arange(1000, dtype=np.int64)
    rows = np.arange(3000, dtype=np.float32).reshape(1000, 3)
    store.insert("t", keys, rows)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(StoreError, match=r"keys\.i64: no room to grow it .*No space left"):
        store.insert("t", np.arange(1000, 5000), np.ones((4000, 3), np.float32))
    got, found = store.lookup("t", keys, 3)
    assert found.all() and store.size("t") == 1000
    np.testing.assert_array_equal(got, rows)
    monkeypatch.undo()
    store.close()
    again = RowFileStore(str(tmp_path / "rows"))
    np.testing.assert_array_equal(again.lookup("t", keys, 3)[0], rows)
    again.insert("t", np.arange(1000, 5000), np.ones((4000, 3), np.float32))
    assert again.size("t") == 5000


def test_a_scratch_row_file_neither_flushes_nor_records_each_write(tmp_path, monkeypatch):
    """``durable=False`` (an eviction's spill, whose rows every checkpoint holds): writes
    land in the mapped files and read back, growing the files as needed, with no flush and no
    ``table.json`` rewrite per write (a durable store does both)."""
    import json

    from jctr.stores import row_file

    flushes = []
    monkeypatch.setattr(row_file._Table, "flush", lambda self: flushes.append(1))
    rng = np.random.default_rng(3)
    model = {}
    store = RowFileStore(str(tmp_path / "scratch"), durable=False)
    for _ in range(6):  # past the first mapping's 1,024 rows: the files grow
        keys = rng.integers(1, 10**12, 700)
        rows = rng.random((700, 5), dtype=np.float32)
        store.insert("spill.t", keys, rows)
        model.update(zip(keys.tolist(), rows))
    _check(store, "spill.t", model, 5)
    info = tmp_path / "scratch" / "tables" / "spill.t" / "table.json"
    assert json.loads(info.read_text())["count"] == 0
    writes_flushed = len(flushes)
    durable = RowFileStore(str(tmp_path / "durable"))
    durable.insert("t", np.arange(1, 11), np.ones((10, 5), np.float32))
    assert len(flushes) == writes_flushed + 1
    info = tmp_path / "durable" / "tables" / "t" / "table.json"
    assert json.loads(info.read_text())["count"] == 10
