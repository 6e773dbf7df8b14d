"""CRC-32C (Castagnoli) of host buffers, the checksum RocksDB's table files carry on every
block: the CPU's ``crc32`` instruction where it has one (x86 with SSE 4.2: ~8 bytes a cycle),
else a table-driven loop (slice by 8), both compiled (numba, ``nogil``).

Example::

    crc32c(np.frombuffer(b"123456789", np.uint8))   # 0xE3069283
    masked(0xE3069283)                               # as RocksDB stores it
"""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from jctr.ops.host_index import host_kernel

_POLY = 0x82F63B78  # the Castagnoli polynomial, bits reversed


def _tables() -> np.ndarray:
    """[8, 256] uint32: byte tables for the slice-by-8 loop."""
    t = np.zeros((8, 256), np.uint32)
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        t[0, b] = c
    for k in range(1, 8):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 0xFF]
    return t


TABLES = _tables()  # for the portable loop; passed to every kernel (unused with the instruction)


def _has_sse42() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        from llvmlite import binding

        return "+sse4.2" in binding.get_host_cpu_features().flatten()
    except Exception:  # noqa: BLE001 - no feature list: the portable loop
        return False


HARDWARE = _has_sse42()


@intrinsic
def _crc_u64(typingctx, crc, word):
    """One step of the CPU's crc32 instruction over 8 bytes (x86 SSE 4.2)."""
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i64, [i64, i64]), "llvm.x86.sse42.crc32.64.64")
        return builder.call(fn, list(args))
    return types.uint64(types.uint64, types.uint64), codegen


@intrinsic
def _crc_u8(typingctx, crc, byte):
    def codegen(context, builder, signature, args):
        i32, i8 = ir.IntType(32), ir.IntType(8)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i32, [i32, i8]), "llvm.x86.sse42.crc32.32.8")
        return builder.call(fn, [args[0], builder.trunc(args[1], i8)])
    return types.uint32(types.uint32, types.uint8), codegen


@numba.njit(inline="always")
def _update_hw(crc, buf, start, stop, tables):
    c = np.uint64(crc)
    i = start
    words = buf[start:start + ((stop - start) & ~7)].view(np.uint64)
    for w in words:
        c = _crc_u64(c, w)
    i += 8 * words.size
    c32 = np.uint32(c)
    while i < stop:
        c32 = _crc_u8(c32, buf[i])
        i += 1
    return c32


@numba.njit(inline="always")
def _update_table(crc, buf, start, stop, tables):
    c = np.uint32(crc)
    i = start
    while i + 8 <= stop:
        lo = c ^ (np.uint32(buf[i]) | (np.uint32(buf[i + 1]) << 8)
                  | (np.uint32(buf[i + 2]) << 16) | (np.uint32(buf[i + 3]) << 24))
        c = (tables[7, lo & 0xFF] ^ tables[6, (lo >> 8) & 0xFF]
             ^ tables[5, (lo >> 16) & 0xFF] ^ tables[4, lo >> 24]
             ^ tables[3, buf[i + 4]] ^ tables[2, buf[i + 5]]
             ^ tables[1, buf[i + 6]] ^ tables[0, buf[i + 7]])
        i += 8
    while i < stop:
        c = tables[0, (c ^ buf[i]) & 0xFF] ^ (c >> 8)
        i += 1
    return c


_update = _update_hw if HARDWARE else _update_table  # compiled for the one used


@numba.njit(inline="always")
def crc32c_range(buf, start, stop, tables):
    """CRC-32C of ``buf[start:stop]`` (uint8, C-contiguous; ``start`` 8-byte aligned for the
    fast path's word view); ``tables``: :data:`TABLES` (unused with the instruction)."""
    return np.uint32(0xFFFFFFFF) ^ _update(np.uint32(0xFFFFFFFF), buf, start, stop, tables)


@numba.njit(inline="always")
def mask(crc):
    """RocksDB's stored form of a CRC (``crc32c::Mask``: a CRC of data holding CRCs is
    then not a CRC of them)."""
    c = np.uint32(crc)
    return np.uint32(((c >> np.uint32(15)) | (c << np.uint32(17))) + np.uint32(0xA282EAD8))


@host_kernel
def _crc32c(buf, tables):
    return crc32c_range(buf, 0, buf.size, tables)


@host_kernel
def _crc32c_portable(buf, tables):
    return np.uint32(0xFFFFFFFF) ^ _update_table(np.uint32(0xFFFFFFFF), buf, 0, buf.size, tables)


def crc32c(data, *, portable: bool = False) -> int:
    """CRC-32C of a bytes-like object or uint8 array (``portable``: the table-driven loop
    even where the CPU's instruction is used)."""
    buf = np.ascontiguousarray(np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray)
                               else data.view(np.uint8).ravel())
    return int((_crc32c_portable if portable else _crc32c)(buf, TABLES))


def masked(crc: int) -> int:
    """:func:`mask` for Python callers (in Python: calling the compiled one from Python
    compiled it anew in every process, ~150 ms at a server's first bulk load)."""
    c = int(crc) & 0xFFFFFFFF
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF
