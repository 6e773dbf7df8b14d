"""Native CPU kernels (``jctr.ops.cpu_ffi``): the FFI plumbing and the CPU dispatch. Their
results against the jnp references are checked in test_kernels.py (hash lookup and insert)."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jctr.ops import cpu_ffi, find_slots
from jctr.ops.hashing import EMPTY_KEY
from jctr.ops.hashing import find_slots as reference_find_slots


def _table(n_keys=40, num_slots=128, key_range=10**12):
    keys = np.random.default_rng(0).choice(key_range, n_keys, replace=False).astype(np.int64)
    table, _ = reference_find_slots(jnp.full((num_slots,), EMPTY_KEY), jnp.asarray(keys),
                                    jnp.ones(n_keys, bool), insert=True)
    return table, keys


@pytest.mark.parametrize("n,parts", [(0, 2), (1, 2), (1, 1), (7, 2), (7, 3), (50, 4)])
def test_lookup_slots_any_batch_split(n, parts):
    table, stored = _table(key_range=2**31)  # fits int32: the kernel must take int32 keys too
    rng = np.random.default_rng(n)
    queries = np.where(rng.random(n) < 0.5, rng.choice(stored, n), rng.integers(-5, 5, n))
    valid = rng.random(n) < 0.8
    key_dtype = jnp.int32 if n % 2 else jnp.int64
    got = cpu_ffi.lookup_slots(table, jnp.asarray(queries, key_dtype), jnp.asarray(valid),
                               parts)
    _, want = reference_find_slots(table, jnp.asarray(queries, jnp.int64), jnp.asarray(valid),
                                   insert=False)
    assert got.shape == (n,) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_cpu_steps_call_the_native_lookup():
    table, stored = _table()
    keys, valid = jnp.asarray(stored), jnp.ones(stored.shape, bool)
    for insert in (False, True):
        text = jax.jit(lambda t, k, v, i=insert: find_slots(t, k, v, insert=i)).lower(
            table, keys, valid).as_text()
        assert "jctr_cpu_hash_lookup" in text


def test_without_numba_the_xla_formulation_runs(monkeypatch):
    table, stored = _table()
    keys = jnp.asarray(np.concatenate([stored, stored + 1]))
    valid = jnp.ones(keys.shape, bool)
    monkeypatch.setattr(cpu_ffi, "AVAILABLE", False)
    fn = jax.jit(lambda t, k, v: find_slots(t, k, v, insert=True))
    assert "jctr_cpu_hash_lookup" not in fn.lower(table, keys, valid).as_text()
    got_table, got = fn(table, keys, valid)
    want_table, want = reference_find_slots(table, keys, valid, insert=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_table), np.asarray(want_table))


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major", ctypes.c_int), ("minor", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion),
                ("traits", ctypes.c_uint32)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                ("next", ctypes.c_void_p), ("metadata", ctypes.POINTER(_Metadata))]


class _Api(ctypes.Structure):  # the leading fields of XLA_FFI_Api
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api_version", _ApiVersion)]


class _CallFrame(ctypes.Structure):  # the leading fields of XLA_FFI_CallFrame
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api", ctypes.POINTER(_Api)), ("ctx", ctypes.c_void_p),
                ("stage", ctypes.c_int), ("rest", ctypes.c_int64 * 16)]


def test_handler_answers_the_metadata_query():
    """XLA may call a handler with only a metadata extension to learn its API version: the
    handler reports the caller's version, touches no buffer and returns success (NULL)."""
    api = _Api(ctypes.sizeof(_Api), None, _ApiVersion(ctypes.sizeof(_ApiVersion), None, 0, 9))
    metadata = _Metadata(ctypes.sizeof(_Metadata), _ApiVersion(), 123)
    extension = _MetadataExtension(ctypes.sizeof(_MetadataExtension), 1, None,
                                   ctypes.pointer(metadata))
    frame = _CallFrame(ctypes.sizeof(_CallFrame), ctypes.addressof(extension),
                       ctypes.pointer(api), None, 0)  # no args: reading one would crash
    handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
        cpu_ffi._hash_lookup_handler.address)
    assert handler(ctypes.addressof(frame)) is None
    assert (metadata.api_version.major, metadata.api_version.minor) == (0, 9)
    assert metadata.traits == 0
