"""Large files written past the page cache (jctr.runtime.direct_io): the bytes and sizes are
exactly what was written whatever the size's alignment, a file system or a platform that
refuses O_DIRECT gets ordinary writes, and a save's digests are recorded from memory."""

from __future__ import annotations

import errno
import os
import zlib

import numpy as np
import pytest

from jctr.checkpoint import integrity
from jctr.runtime import direct_io
from jctr.runtime.direct_io import DirectWriter, write_file

needs_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, (8 << 20) + 12345, 3 * (8 << 20)])
def test_a_file_holds_exactly_its_bytes_whatever_its_size(tmp_path, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    path = str(tmp_path / "f")
    with DirectWriter(path, checksum=True) as f:  # any size, to test the padded last block
        f.write(data)
    assert os.path.getsize(path) == size
    assert np.array_equal(np.fromfile(path, np.uint8), data)
    assert f.crc == zlib.crc32(data)
    assert write_file(str(tmp_path / "g"), data) == (size, zlib.crc32(data))
    assert np.array_equal(np.fromfile(tmp_path / "g", np.uint8), data)


@needs_direct
def test_large_writes_go_past_the_page_cache_in_pieces(tmp_path):
    """Several writes, unaligned to the block and the staging buffer, end up in order."""
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5, 9_000_001, 4096, 777)]
    path = str(tmp_path / "f")
    with DirectWriter(path, direct=True) as f:
        for p in parts:
            f.write(p)
        assert f.tell() == sum(p.size for p in parts)
        direct = f.direct
    assert np.array_equal(np.fromfile(path, np.uint8), np.concatenate(parts))
    # on a file system that takes O_DIRECT (ext4, xfs, recent tmpfs) it stayed direct
    if direct:
        assert os.path.getsize(path) == sum(p.size for p in parts)


def test_npz_streams_into_a_direct_writer(tmp_path):
    arrays = {"keys": np.arange(3_000_001, dtype=np.int64), "show": np.linspace(0, 1, 7)}
    path = str(tmp_path / "stats.npz")
    with DirectWriter(path) as f:
        np.savez(f, **arrays)
    with np.load(path) as z:
        assert sorted(z.files) == ["keys", "show"]
        for k, v in arrays.items():
            assert np.array_equal(z[k], v)


@needs_direct
def test_a_file_system_refusing_o_direct_at_open_gets_ordinary_writes(tmp_path, monkeypatch):
    real = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    data = np.arange(5_000_003, dtype=np.uint8)
    path = str(tmp_path / "f")
    with DirectWriter(path, direct=True) as f:
        assert not f.direct
        f.write(data)
    assert np.array_equal(np.fromfile(path, np.uint8), data)


@needs_direct
def test_a_file_system_refusing_a_direct_write_gets_the_rest_buffered(tmp_path, monkeypatch):
    real = os.write
    refused = []

    def refuse_first(fd, data):
        if not refused:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data)

    data = np.random.default_rng(2).integers(0, 256, (8 << 20) * 2 + 99, dtype=np.uint8)
    path = str(tmp_path / "f")
    with DirectWriter(path, direct=True) as f:
        monkeypatch.setattr(os, "write", refuse_first)
        f.write(data)
        assert refused and not f.direct
    assert np.array_equal(np.fromfile(path, np.uint8), data)


def test_the_switch_turns_direct_writes_off(tmp_path, monkeypatch):
    monkeypatch.setenv("JCTR_DIRECT_IO", "0")
    assert not direct_io.enabled()
    with DirectWriter(str(tmp_path / "f")) as f:
        assert not f.direct
        f.write(b"abc")
    assert (tmp_path / "f").read_bytes() == b"abc"


def test_digests_are_recorded_from_the_writer_and_checked_from_the_file(tmp_path):
    """file_digests takes the writer's CRC of a file as it was written (no reading back);
    a file changed since is read again, and check_files always reads."""
    path = tmp_path / "d" / "emb_vector"
    path.parent.mkdir()
    data = np.arange(1000, dtype=np.float32)
    size, crc = write_file(str(path), data)
    integrity.note_written(str(path), size, crc + 1)  # a deliberately wrong note
    assert integrity.file_digests(str(tmp_path)) == {"d/emb_vector": [size, crc + 1]}
    with pytest.raises(ValueError, match="checksum"):
        integrity.check_files(str(tmp_path), {"d/emb_vector": [size, crc + 1]}, ValueError,
                              "bundle")
    os.utime(path, ns=(1, 1))  # changed since it was noted: read again
    assert integrity.file_digests(str(tmp_path)) == {"d/emb_vector": [size, crc]}
    integrity.check_files(str(tmp_path), {"d/emb_vector": [size, crc]}, ValueError, "bundle")


def test_a_full_disk_leaves_no_partial_model_file(tmp_path, monkeypatch):
    """A model file whose write fails (the disk is full) leaves neither the file nor its
    temporary behind (model_files._atomic_write), and the error is the disk's."""
    from jctr.checkpoint import model_files

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        model_files._atomic_write(str(tmp_path / "emb_vector"), np.ones(5_000_000, np.float32))
    assert list(tmp_path.iterdir()) == []


def test_a_model_file_of_a_mapped_rows_file_is_a_link_else_a_copy(tmp_path, monkeypatch):
    """write_sparse_model links ``key`` / ``emb_vector`` to the files its arrays map whole
    (a checkpoint's rows, read_rows(mmap=True)); a part of a file, another dtype, a plain
    array, or a file system without links get the bytes written."""
    from jctr.checkpoint import model_files

    keys = np.arange(1000, dtype="<i8") * 7
    vectors = np.random.default_rng(0).random((1000, 4)).astype("<f4")
    keys.tofile(tmp_path / "k")
    vectors.tofile(tmp_path / "v")
    mk = np.memmap(tmp_path / "k", "<i8", "r", shape=(1000,))
    mv = np.memmap(tmp_path / "v", "<f4", "r", shape=(1000, 4))

    def check(folder, linked, vectors_linked=None):
        got_k = np.fromfile(folder / "key", "<i8")
        got_v = np.fromfile(folder / "emb_vector", "<f4").reshape(-1, 4)
        n = got_k.size
        np.testing.assert_array_equal(got_k, keys[:n])
        np.testing.assert_array_equal(got_v, vectors[:n])
        for name, src, want in (("key", "k", linked), ("emb_vector", "v",
                                 linked if vectors_linked is None else vectors_linked)):
            same = (folder / name).stat().st_ino == (tmp_path / src).stat().st_ino
            assert same == want, (folder, name)

    model_files.write_sparse_model(str(tmp_path / "linked"), mk, mv)
    check(tmp_path / "linked", True)
    model_files.write_sparse_model(str(tmp_path / "part"), mk[:500], mv[:500])
    check(tmp_path / "part", False)
    model_files.write_sparse_model(str(tmp_path / "plain"), keys, vectors)
    check(tmp_path / "plain", False)
    model_files.write_sparse_model(str(tmp_path / "cast"), mk, mv.astype("<f8"))
    check(tmp_path / "cast", True, False)  # the keys link; float64 vectors are converted
    monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(OSError(18, "EXDEV")))
    model_files.write_sparse_model(str(tmp_path / "nolink"), mk, mv)
    check(tmp_path / "nolink", False)
    assert not [p for p in tmp_path.rglob("*.tmp*")]


def test_buffers_are_kept_for_the_next_writer_and_never_shared(tmp_path):
    """A direct writer's staging buffer and a table file's chunks are kept for the next one
    (a new buffer's pages fault in again; jctr.runtime.buffers): given back, a buffer is
    taken again by the next caller asking for as much or less, never by two at once; past
    KEEP buffers the smallest goes. Writers that overlap (two files written at once, a
    second thread) each write exactly their bytes."""
    import threading

    from jctr.runtime import buffers

    # buffers earlier tests of this process gave back (a 32 MB one took the place of the
    # 3 MB one asked for below): out of the pool, so that it starts empty
    while buffers._free:
        buffers.take(1).close()
    a = buffers.take(3 << 20)
    b = buffers.take(3 << 20)
    assert a is not b and len(a) >= 3 << 20 and len(a) % 4096 == 0
    buffers.give(a)
    assert buffers.take(1 << 20) is a  # the kept one, not a new one
    buffers.give(a)
    buffers.give(b)
    big = buffers.take(64 << 20)  # larger than any kept: a new one
    assert big is not a and big is not b
    buffers.give(big)
    kept = [buffers.take(1) for _ in range(buffers.KEEP + 2)]
    for m in kept:
        buffers.give(m)
    assert len(buffers._free) == buffers.KEEP
    with buffers.reused(4096) as arr:
        assert arr.dtype == np.uint8 and arr.size == 4096 and arr.ctypes.data % 4096 == 0
    rng = np.random.default_rng(5)
    datas = [rng.integers(0, 256, (9 << 20) + i, dtype=np.uint8) for i in range(4)]
    with DirectWriter(str(tmp_path / "0")) as f0, DirectWriter(str(tmp_path / "1")) as f1:
        for part in range(0, datas[1].size, 1 << 20):  # interleaved, as two writers would
            f0.write(datas[0][part:part + (1 << 20)])
            f1.write(datas[1][part:part + (1 << 20)])

    def write(i):
        with DirectWriter(str(tmp_path / str(i))) as f:
            f.write(datas[i])
    threads = [threading.Thread(target=write, args=(i,)) for i in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, data in enumerate(datas):
        assert np.array_equal(np.fromfile(str(tmp_path / str(i)), np.uint8), data)
