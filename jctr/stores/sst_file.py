"""RocksDB table files (block-based, ``format_version`` 5) written straight from numpy rows, for
a bulk load (``ingest_external_file``): what ``SstFileWriter`` writes, without a Python call
and a bytes object a row (rocksdict's writer: ~0.45 us a row with its bytes, holding the
interpreter; here the blocks are laid out by compiled code that lets it go).

The file holds fixed-size keys (8 bytes) and values of one width: data blocks of about
``block_size`` bytes (entries with shared key prefixes, a restart point every 16 entries),
the keys' full bloom filter (RocksDB's FastLocalBloom, 10 bits a key: what the databases'
own files carry, so a point read skips a file without its key), one index block (each data
block's last key and place), the properties block (what ingestion checks: the writer's
version 2 with a global sequence number of 0, the bytewise comparator, an unknown column
family) and the meta-index block, every block followed by its type byte (no compression) and
masked CRC-32C, then the footer. The layout is RocksDB's own
(``table/format.cc``, ``table/block_based/block_builder.cc``, ``table/meta_blocks.cc``,
``table/block_based/filter_policy.cc``, ``util/bloom_impl.h``, ``util/xxph3.h``,
``db/external_sst_file_ingestion_job.cc`` at v9.8.4); ``tests/test_sst_file.py`` checks it
against RocksDB reading and ingesting it.

Example::

    write_table_file(path, key_bytes, [vectors])   # [n, 8] uint8 in ascending order
    db.get_column_family(name).ingest_external_file([path], options)
"""

from __future__ import annotations

import contextlib
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from jctr.ops.checksum import TABLES, crc32c, crc32c_range, mask, masked
from jctr.ops.host_index import copy_bytes, host_kernel, prefetch
from jctr.runtime import buffers
from jctr.runtime.direct_io import DirectWriter

FORMAT_VERSION = 5
MAGIC = 0x88E241B785F4CFF7  # kBlockBasedTableMagicNumber
CRC32C = 1  # ChecksumType kCRC32c
NO_COMPRESSION = 0
RESTART_INTERVAL = 16
UNKNOWN_FAMILY = 0x7FFFFFFF  # TablePropertiesCollectorFactory::Context::kUnknownColumnFamily
CHUNK_BYTES = 32 << 20  # written to the file a chunk at a time (stays in the CPU's caches)


@numba.njit(inline="always")
def _varint(buf, pos, v):
    while v >= 128:
        buf[pos] = np.uint8((v & 127) | 128)
        v >>= 7
        pos += 1
    buf[pos] = np.uint8(v)
    return pos + 1


@numba.njit(inline="always")
def _u32(buf, pos, v):
    for b in range(4):
        buf[pos + b] = np.uint8((v >> (8 * b)) & 255)
    return pos + 4


@numba.njit(inline="always")
def _seal(buf, start, pos, tables):
    """The block ``buf[start:pos]`` closed by its trailer: type byte, masked CRC-32C of the
    block and that byte."""
    buf[pos] = np.uint8(0)  # kNoCompression
    _u32(buf, pos + 1, mask(crc32c_range(buf, start, pos + 1, tables)))
    return pos + 5


_NO_BYTES = np.empty(0, np.uint8)  # no staging (buffers.reused(0) would lend a kept buffer)
_NO_ROWS = np.empty(0, np.int64)  # no order: rows in sequence
_AHEAD = 8  # rows between the fetch of a source row's lines and its copy


@host_kernel
def _data_blocks(keys, columns, order, row0, first, buf, base, block_size, tables, handles,
                 last_rows):
    """Rows ``first, first + 1, ...`` as data blocks into ``buf`` (whose first byte is the
    file's byte ``base``) until it has no room for another whole block; row ``i``'s value is
    ``columns[0][r]``, ``columns[1][r]``, ... side by side, ``r`` = ``order[i]`` (the rows
    fetched ahead) or, with an empty ``order``, ``i - row0``. Each block's (offset, size)
    into ``handles`` and its last row into ``last_rows``. Returns (rows done, bytes used,
    blocks, -1) or (.., .., .., i) where row ``i``'s key is not above the one before it."""
    ordered = order.size > 0
    n = keys.shape[0]
    vlen = 0
    for c in columns:
        vlen += c.shape[1]
    entry_max = 3 + 5 + 16 + vlen + 4
    restarts = np.empty(RESTART_INTERVAL + block_size // 16 + 2, np.int64)
    pos = 0
    nb = 0
    i = first
    while i < n and buf.size - pos >= block_size + entry_max + 5 + 8 * restarts.size:
        start = pos
        nr = 0
        count = 0
        while i < n:
            if ordered and i + _AHEAD < n:
                ahead = order[i + _AHEAD]
                for c in columns:
                    for line in range(0, c.shape[1], 64):
                        prefetch(c.ctypes.data + ahead * c.shape[1] + line)
            if i > 0:  # strictly ascending, bytewise
                d = 0
                while d < 8 and keys[i, d] == keys[i - 1, d]:
                    d += 1
                if d == 8 or keys[i, d] < keys[i - 1, d]:
                    return i, pos, nb, i
            shared = 0
            if count % RESTART_INTERVAL == 0:
                restarts[nr] = pos - start
                nr += 1
            else:
                while shared < 8 and keys[i, shared] == keys[i - 1, shared]:
                    shared += 1
            pos = _varint(buf, pos, shared)
            pos = _varint(buf, pos, 16 - shared)
            pos = _varint(buf, pos, vlen)
            for b in range(shared, 8):
                buf[pos] = keys[i, b]
                pos += 1
            buf[pos] = np.uint8(1)  # (sequence 0 << 8) | kTypeValue, little-endian
            for b in range(1, 8):
                buf[pos + b] = np.uint8(0)
            pos += 8
            r = order[i] if ordered else i - row0
            for c in columns:
                w = c.shape[1]
                copy_bytes(buf.ctypes.data + pos, c.ctypes.data + r * w, w)
                pos += w
            count += 1
            i += 1
            if pos - start + 4 * (nr + 1) >= block_size or nr == restarts.size:
                break
        for r in range(nr):
            pos = _u32(buf, pos, restarts[r])
        pos = _u32(buf, pos, nr)
        handles[nb, 0] = base + start
        handles[nb, 1] = pos - start
        last_rows[nb] = i - 1
        nb += 1
        pos = _seal(buf, start, pos, tables)
    return i, pos, nb, -1


@host_kernel
def _index_block(keys, handles, buf, tables):
    """The index block (restart interval 1: each entry its own restart point): each data
    block's last key as an internal key and its (offset, size), closed by its trailer.
    Returns its size without the trailer."""
    m = keys.shape[0]
    starts = np.empty(m, np.int64)
    pos = 0
    for j in range(m):
        starts[j] = pos
        pos = _varint(buf, pos, 0)
        pos = _varint(buf, pos, 16)
        vl = 0
        for v in (handles[j, 0], handles[j, 1]):
            vl += 1
            while v >= 128:
                v >>= 7
                vl += 1
        pos = _varint(buf, pos, vl)
        for b in range(8):
            buf[pos + b] = keys[j, b]
        buf[pos + 8] = np.uint8(1)
        for b in range(9, 16):
            buf[pos + b] = np.uint8(0)
        pos += 16
        pos = _varint(buf, pos, handles[j, 0])
        pos = _varint(buf, pos, handles[j, 1])
    for j in range(m):
        pos = _u32(buf, pos, starts[j])
    pos = _u32(buf, pos, m)
    size = pos
    _seal(buf, 0, pos, tables)
    return size


# the full bloom filter RocksDB's own files carry here (``set_bloom_filter(10, False)``: 10 bits
# a key, RocksDB's FastLocalBloom; util/bloom_impl.h, table/block_based/filter_policy.cc at
# v9.8.4): a point read skips a file that lacks its key without reading its data. Without it
# every overlapping level-0 file of a bulk load is searched (20,000 random point reads among
# 10-44 ingested files: 232-449 ms without, 83-162 ms with; docs/performance.md)
BLOOM_MILLIBITS = 10_000
BLOOM_PROBES = 6  # FastLocalBloomImpl::ChooseNumProbes(10000)
FILTER_NAME = b"fullfilter.rocksdb.BuiltinBloomFilter"  # kFullFilterBlockPrefix + its name
_SECRET64 = np.uint64(0xBE4BA423396CFEB8)  # XXPH3's kSecret[0:8], little-endian
_P32_1 = np.uint64(0x9E3779B1)
_P64_2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P64_3 = np.uint64(0x165667B19E3779F9)
_LOW32 = np.uint64(0xFFFFFFFF)
_GOLDEN32 = np.uint64(0x9E3779B9)


def filter_bytes(n: int) -> int:
    """The filter's bit array for ``n`` keys: FastLocalBloom's ``CalculateSpace`` less its
    5 bytes of metadata (whole 64-byte cache lines)."""
    return (-(-n * BLOOM_MILLIBITS // 8000) + 63) & ~63


@host_kernel
def _bloom_filter(keys, buf, tables):
    """The filter block of ``keys`` [n, 8] into ``buf`` (``filter_bytes(n)`` + 10 zeroed
    bytes): each key's XXPH3 hash (``GetSliceHash64`` of its 8 bytes, seed 0), the low half
    choosing a cache line and the high half ``BLOOM_PROBES`` bits in it, then the metadata
    (-1: a new-style filter, 0: FastLocalBloom, the probes in 64-byte lines) and the block's
    trailer. Returns the block's size without the trailer."""
    length = buf.size - 10
    lines = np.uint64(length >> 6)
    for i in range(keys.shape[0]):
        v = np.uint64(0)
        for b in range(8):
            v |= np.uint64(keys[i, b]) << np.uint64(8 * b)
        # XXPH3_len_4to8_64b with len 8, then XXPH3_avalanche
        keyed = v ^ _SECRET64
        mix = np.uint64(8) + (keyed ^ (keyed >> np.uint64(51))) * _P32_1
        h = (mix ^ (mix >> np.uint64(47))) * _P64_2
        h ^= h >> np.uint64(37)
        h *= _P64_3
        h ^= h >> np.uint64(32)
        line = (((h & _LOW32) * lines) >> np.uint64(32)) << np.uint64(6)
        probe = h >> np.uint64(32)
        for _ in range(BLOOM_PROBES):
            bit = probe >> np.uint64(23)
            at = line + (bit >> np.uint64(3))
            buf[at] |= np.uint8(1) << np.uint8(bit & np.uint64(7))
            probe = (probe * _GOLDEN32) & _LOW32
    buf[length] = np.uint8(255)
    buf[length + 1] = np.uint8(0)
    buf[length + 2] = np.uint8(BLOOM_PROBES)
    _seal(buf, 0, length + 5, tables)
    return length + 5


def _varint_bytes(v: int) -> bytes:
    out = bytearray()
    while v >= 128:
        out.append((v & 127) | 128)
        v >>= 7
    out.append(v)
    return bytes(out)


def _handle(offset: int, size: int) -> bytes:
    return _varint_bytes(offset) + _varint_bytes(size)


def _small_block(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A block of a few sorted entries, none sharing a prefix (one restart point): the
    properties and meta-index blocks."""
    out = bytearray()
    for key, value in entries:
        out += _varint_bytes(0) + _varint_bytes(len(key)) + _varint_bytes(len(value))
        out += key + value
    out += struct.pack("<II", 0, 1)
    return bytes(out)


def _sealed(block: bytes) -> bytes:
    body = block + bytes([NO_COMPRESSION])
    return body + struct.pack("<I", masked(crc32c(body)))


def _session_id() -> bytes:
    """A 20-character base-36 session id (what RocksDB's unique file ids are made from)."""
    v = int.from_bytes(os.urandom(13), "little")
    digits = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    out = []
    for _ in range(20):
        v, d = divmod(v, 36)
        out.append(digits[d])
    return "".join(out).encode()


def write_table_file(path: str, keys: np.ndarray, columns: list[np.ndarray],
                     order: np.ndarray | None = None, *, block_size: int = 4096,
                     direct: bool = True, family: str = "") -> None:
    """A RocksDB table file at ``path`` (created; not synced: RocksDB syncs a file it
    ingests) whose ``i``-th entry maps ``keys[i]`` to the value ``columns[0][order[i]]``,
    ``columns[1][order[i]]``, ... laid side by side (``order`` None: ``i``): ``keys`` [n, 8]
    uint8 in strictly ascending bytewise order, ``columns`` arrays of any type whose rows
    are the value's parts (their bytes, as laid out in memory). Written past the page cache
    (``direct``: as ``SstFileWriter``, which drops what it wrote from the cache, and on VMs
    that fault in every newly cached page, 0.98 s against 1.25 s for 660 MB;
    ``docs/performance.md``). ``family``: the column family it is for, named in its
    properties as RocksDB's own files name theirs (ingestion checks only the family's id,
    left unknown; :mod:`jctr.stores.table_scan` reads the name). Raises ValueError (the file
    removed) if a key is not above the one before it."""
    keys = np.ascontiguousarray(keys, np.uint8)
    n = keys.shape[0]
    order = None if order is None else np.ascontiguousarray(order, np.int64)
    if keys.ndim != 2 or keys.shape[1] != 8 or (order is not None and order.shape != (n,)) \
            or not columns:
        raise ValueError(f"write_table_file: keys [n, 8] uint8 and an order of n rows, not "
                         f"{keys.shape} and {None if order is None else order.shape}")
    if n == 0:
        raise ValueError("write_table_file: no rows (RocksDB ingests no empty file)")
    blocks = tuple(np.ascontiguousarray(c).reshape(c.shape[0], -1).view(np.uint8)
                   for c in columns)
    if order is None:
        if any(b.shape[0] < n for b in blocks):
            raise ValueError("write_table_file: fewer rows in the columns than keys")
    elif any(b.shape[0] <= order.max() for b in blocks) or order.min() < 0:
        raise ValueError("write_table_file: the order names rows the columns do not have")
    width = sum(b.shape[1] for b in blocks)
    chunk = max(CHUNK_BYTES, 4 * (block_size + 2 * (width + 40)))
    # two buffers: one is written to the file (a thread, the interpreter let go in the
    # write) while the compiled loop fills the other; kept for the next file (new pages
    # fault in: 116k rows of 16 floats 40 ms a file with new ones, ~30 with these)
    # rows of several column blocks in an order are gathered a chunk at a time first
    # (numpy's take), then laid out in sequence: a streaming write-back's 2.5M rows of three
    # blocks (key, vector, statistics) 328-371 ms against 509-572 ms fetched ahead in the
    # compiled loop; one block's rows (online updates, a spill) are no faster staged
    stage = order is not None and len(blocks) > 1
    with buffers.reused(chunk) as one, buffers.reused(chunk) as other, \
            (buffers.reused(chunk + width) if stage  # a chunk's rows at most (the loop's most)
             else contextlib.nullcontext(_NO_BYTES)) as staging:
        _write_table_file(path, keys, blocks, order, block_size, direct, chunk, width,
                          (one, other), staging, family)


def _write_table_file(path: str, keys: np.ndarray, blocks: tuple, order: np.ndarray,
                      block_size: int, direct: bool, chunk: int, width: int,
                      bufs: tuple[np.ndarray, np.ndarray], staging: np.ndarray,
                      family: str) -> None:
    n = keys.shape[0]
    # rows (so blocks) a chunk can take: an entry is >= 11 + w bytes
    most = chunk // (11 + width) + 1
    in_order = _NO_ROWS if order is None else order  # (empty: rows in sequence)
    if staging.size:  # each chunk's rows gathered in file order, then laid out in sequence
        staged, at = [], 0
        for b in blocks:
            staged.append(staging[at:at + most * b.shape[1]].reshape(most, b.shape[1]))
            at += most * b.shape[1]
    handles_parts, last_parts = [], []
    offset = 0
    done = 0
    try:
        with (DirectWriter(path) if direct else open(path, "wb")) as f, \
                ThreadPoolExecutor(1, thread_name_prefix="jctr-table-file") as pool:
            writing = None
            handles = np.empty((most, 2), np.int64)
            last_rows = np.empty(most, np.int64)
            while done < n:
                buf = bufs[len(handles_parts) % 2]  # its last write was waited for below
                source, source_order, row0 = blocks, in_order, 0
                if staging.size:
                    rows = order[done:done + most]
                    source = tuple(np.take(b, rows, axis=0, out=st[:rows.size])
                                   for b, st in zip(blocks, staged))
                    source_order, row0 = _NO_ROWS, done
                done, used, nb, bad = _data_blocks(keys, source, source_order, row0, done, buf,
                                                   offset, block_size, TABLES, handles,
                                                   last_rows)
                if bad >= 0:
                    raise ValueError(f"write_table_file: key {bad} is not above the one before "
                                     "it (keys must be distinct, in ascending byte order)")
                if writing is not None:
                    writing.result()
                writing = pool.submit(f.write, memoryview(buf)[:used])
                offset += used
                handles_parts.append(handles[:nb].copy())
                last_parts.append(last_rows[:nb].copy())
            writing.result()
            data_size = offset
            bloom = np.zeros(filter_bytes(n) + 10, np.uint8)
            filter_size = int(_bloom_filter(keys, bloom, TABLES))
            filter_handle = _handle(offset, filter_size)
            f.write(memoryview(bloom)[:filter_size + 5])
            offset += filter_size + 5
            handles = np.concatenate(handles_parts)
            last = np.concatenate(last_parts)
            index_buf = np.empty(handles.shape[0] * (3 + 16 + 20 + 4) + 4 + 5, np.uint8)
            index_size = int(_index_block(keys[last], handles, index_buf, TABLES))
            index_handle = _handle(offset, index_size)
            f.write(memoryview(index_buf)[:index_size + 5])
            offset += index_size + 5
            props = _properties(n, width, data_size, index_size + 5, handles.shape[0],
                                data_size, filter_size, family)
            props_handle = _handle(offset, len(props))
            f.write(_sealed(props))
            offset += len(props) + 5
            meta = _small_block([(FILTER_NAME, filter_handle),
                                 (b"rocksdb.properties", props_handle)])
            meta_handle = _handle(offset, len(meta))
            f.write(_sealed(meta))
            footer = bytes([CRC32C]) + meta_handle + index_handle
            footer = footer.ljust(41, b"\0") + struct.pack("<IQ", FORMAT_VERSION, MAGIC)
            f.write(footer)
    except BaseException:
        if os.path.exists(path):
            os.remove(path)
        raise


def _properties(n: int, width: int, data_size: int, index_size: int, blocks: int,
                tail_start: int, filter_size: int, family: str = "") -> bytes:
    """The properties block: RocksDB's table properties (numbers as varints) and the user
    properties SstFileWriter adds (fixed-width), sorted by name."""
    num = _varint_bytes
    props = {
        b"rocksdb.block.based.table.index.type": struct.pack("<I", 0),  # binary search
        b"rocksdb.column.family.id": num(UNKNOWN_FAMILY),
        b"rocksdb.comparator": b"leveldb.BytewiseComparator",
        b"rocksdb.compression": b"NoCompression",
        b"rocksdb.creating.db.identity": b"SST Writer",
        b"rocksdb.creating.session.identity": _session_id(),
        b"rocksdb.creation.time": num(0),
        b"rocksdb.data.size": num(data_size),
        b"rocksdb.deleted.keys": num(0),
        b"rocksdb.external_sst_file.global_seqno": struct.pack("<Q", 0),
        b"rocksdb.external_sst_file.version": struct.pack("<I", 2),
        b"rocksdb.filter.policy": b"bloomfilter",  # BloomFilterPolicy::Name()
        b"rocksdb.filter.size": num(filter_size),
        b"rocksdb.fixed.key.length": num(0),
        b"rocksdb.format.version": num(0),
        b"rocksdb.index.key.is.user.key": num(0),
        b"rocksdb.index.size": num(index_size),
        b"rocksdb.index.value.is.delta.encoded": num(0),
        b"rocksdb.key.largest.seqno": num(0),
        b"rocksdb.merge.operands": num(0),
        b"rocksdb.num.data.blocks": num(blocks),
        b"rocksdb.num.entries": num(n),
        b"rocksdb.num.filter_entries": num(n),
        b"rocksdb.num.range-deletions": num(0),
        b"rocksdb.oldest.key.time": num(0),
        b"rocksdb.original.file.number": num(1),
        b"rocksdb.raw.key.size": num(16 * n),
        b"rocksdb.raw.value.size": num(width * n),
        b"rocksdb.tail.start.offset": num(tail_start),
    }
    if family:
        props[b"rocksdb.column.family.name"] = family.encode()
    return _small_block(sorted(props.items()))
