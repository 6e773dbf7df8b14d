"""A Python function called from a jitted CPU computation with the computation's own buffers:
an XLA FFI handler (a ``ctypes`` callback) that hands the function read-only numpy views of
its operands and copies what it returns into the call's results.

Why not ``jax.experimental.io_callback`` on CPU: it puts every operand on CPU device 0
(``jax.device_put``) before calling the function, and on several CPU devices of one process
(``--xla_force_host_platform_device_count``) a large operand's copy waits for work the other
devices' threads never run while they wait in a collective: a step that calls back inside
``shard_map`` and then all-reduces hangs (docs/performance.md, "Spilling on several
devices"). Here the function reads the buffers where they are, on the device's own thread.

The function runs with the interpreter's lock, on the XLA thread of the device that calls it
(several devices' calls may run one after another, never at once); the views are valid only
during the call. An exception becomes the computation's error (an XLA ``INTERNAL`` status
naming it), as it does for ``io_callback``.

CPU only: :func:`jctr.ops.dispatch.host_callback` picks ``io_callback`` elsewhere.

Example::

    def total(x):  # numpy in, numpy out
        return (np.asarray(x.sum(), np.float32),)
    out, = cpu_host_call(total, [jax.ShapeDtypeStruct((), jnp.float32)], x)
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# the call frame's layout as the native kernels read it (xla/ffi/api/c_api.h)
from jctr.ops.cpu_ffi import (
    _API_VERSION,
    _BUFFER_DATA,
    _EXTENSION_TYPE,
    _FRAME_API,
    _FRAME_ARGS,
    _FRAME_EXTENSION,
    _FRAME_RETS,
    _LIST_POINTERS,
    _METADATA_POINTER,
    _METADATA_TRAITS,
    _METADATA_TYPE,
    _METADATA_VERSION,
    ffi_capsule,
)

_API_ERROR_CREATE = 48  # XLA_FFI_Api: ..., api_version, internal_api, XLA_FFI_Error_Create
_ERROR_INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


_ERROR_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorCreateArgs))

_CALLS: dict[int, tuple[Callable, list, list]] = {}  # id -> (function, operands, results)
_IDS = itertools.count(1)
_IDS_LOCK = threading.Lock()


def _word(address: int) -> int:
    return ctypes.c_int64.from_address(address).value


def _view(address: int, aval) -> np.ndarray:
    dtype = np.dtype(aval.dtype)
    size = int(np.prod(aval.shape, dtype=np.int64)) * dtype.itemsize
    if size == 0:
        return np.zeros(aval.shape, dtype)
    return np.frombuffer((ctypes.c_char * size).from_address(address), dtype).reshape(aval.shape)


def _buffer(frame: int, which: int, index: int) -> int:
    return _word(_word(_word(frame + which + _LIST_POINTERS) + 8 * index) + _BUFFER_DATA)


def _answer_metadata(frame: int) -> bool:
    """True (after filling it in) when XLA asks for the handler's metadata."""
    extension = _word(frame + _FRAME_EXTENSION)
    if not extension or ctypes.c_int32.from_address(extension + _EXTENSION_TYPE).value \
            != _METADATA_TYPE:
        return False
    metadata = _word(extension + _METADATA_POINTER)
    version = _word(frame + _FRAME_API) + _API_VERSION
    for i in (0, 4):
        ctypes.c_int32.from_address(metadata + _METADATA_VERSION + i).value = \
            ctypes.c_int32.from_address(version + i).value
    ctypes.c_uint32.from_address(metadata + _METADATA_TRAITS).value = 0
    return True


def _error(frame: int, message: str) -> int:
    """An ``XLA_FFI_Error*`` made by XLA's own ``XLA_FFI_Error_Create``."""
    create = _ERROR_CREATE(_word(_word(frame + _FRAME_API) + _API_ERROR_CREATE))
    text = message.encode("utf-8", "replace")
    args = _ErrorCreateArgs(ctypes.sizeof(ctypes.c_size_t) * 3 + ctypes.sizeof(ctypes.c_int),
                            None, text, _ERROR_INTERNAL)
    return create(ctypes.byref(args))


def _handle(frame: int) -> int | None:
    try:
        if _answer_metadata(frame):
            return None
        ident = int(_view(_buffer(frame, _FRAME_ARGS, 0), jax.ShapeDtypeStruct((), np.int64)))
        fn, operands, results = _CALLS[ident]
        views = []
        for i, aval in enumerate(operands):
            view = _view(_buffer(frame, _FRAME_ARGS, i + 1), aval)
            view.flags.writeable = False
            views.append(view)
        out = fn(*views)
        if len(out) != len(results):
            raise RuntimeError(f"host call {getattr(fn, '__name__', fn)} returned {len(out)} "
                               f"values, expected {len(results)}")
        for i, (aval, value) in enumerate(zip(results, out)):
            value = np.asarray(value)
            if value.shape != tuple(aval.shape) or value.dtype != np.dtype(aval.dtype):
                raise RuntimeError(f"host call {getattr(fn, '__name__', fn)}: result {i} is "
                                   f"{value.dtype}{list(value.shape)}, expected "
                                   f"{np.dtype(aval.dtype)}{list(aval.shape)}")
            np.copyto(_view(_buffer(frame, _FRAME_RETS, i), aval), value)
        return None
    except BaseException as error:  # noqa: BLE001 -- every failure becomes XLA's error
        return _error(frame, f"jctr host call failed: {type(error).__name__}: {error}")


_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(_handle)


@functools.cache
def _register() -> None:
    jax.ffi.register_ffi_target("jctr_host_call",
                                ffi_capsule(ctypes.cast(_HANDLER, ctypes.c_void_p).value),
                                platform="cpu")


def cpu_host_call(fn: Callable[..., Sequence[np.ndarray]], results: Sequence[jax.ShapeDtypeStruct],
                  *operands: jax.Array) -> list[jax.Array]:
    """``fn(*numpy views of operands)`` -> its values as arrays of ``results``' shapes and
    dtypes, called once for each execution (a side effect XLA keeps and never duplicates).
    CPU only; see the module docstring."""
    _register()
    with _IDS_LOCK:
        ident = next(_IDS)
    _CALLS[ident] = (fn, [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
                          for x in operands], list(results))
    out = jax.ffi.ffi_call("jctr_host_call", list(results), has_side_effect=True)(
        jnp.int64(ident), *operands)
    return list(out)
