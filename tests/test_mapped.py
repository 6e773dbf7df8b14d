"""``jctr.runtime.mapped``: arrays in unnamed mapped files (streaming statistics, a row
file's index past a share of memory)."""

import errno
import mmap
import os

import numpy as np
import pytest

from jctr.runtime.mapped import MappedArrays


def test_mapped_arrays_grow_in_place_and_leave_no_file(tmp_path):
    files = MappedArrays(str(tmp_path))
    a = files.array("a", np.int64, 1000)
    a[:] = np.arange(1000)
    b = files.array("a", np.int64, 100_000)  # the same file, longer: rows kept, new ones 0
    np.testing.assert_array_equal(b[:1000], np.arange(1000))
    assert not b[1000:].any()
    b[5] = -1
    assert a[5] == -1  # the older view reads the same pages
    assert not os.listdir(tmp_path)
    files.close()
    assert b[5] == -1  # a view outlives the files' close


def test_a_folder_that_cannot_map_files_is_named(tmp_path, monkeypatch):
    def no_mmap(*args, **kwargs):
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(mmap, "mmap", no_mmap)
    with pytest.raises(OSError, match=rf"{tmp_path}: cannot map a file there for keys "
                                      r"\(No such device\)"):
        MappedArrays(str(tmp_path)).array("keys", np.int64, 10)
