"""A RocksDB table's rows read straight from its table files, merged as RocksDB merges them.

A whole-table pass through rocksdict makes a Python bytes object a row (~330 ns a row of a
streaming row store; ``docs/performance.md``). A bulk store's column family is a set of
immutable block-based table files (its writes are flushed at once, so no memtable holds
rows): this module maps them, checks every data block's CRC-32C and walks their entries in
compiled code, the newest file's entry of a key winning and a deletion hiding older rows.

What it follows (RocksDB v9.8.4's ``table/format.cc``, ``table/block_based/block.cc``,
``index_builder.cc``, ``db/dbformat.h``, ``db/version_set.cc``): the footer of format versions
1-5 with CRC-32C block checksums; blocks without compression and without a data-block hash
index; index blocks of binary search, their values full or delta-encoded block handles;
internal keys of 8 user-key bytes and the 8-byte (sequence << 8 | type) trailer, entries of a
key ordered newest first within a file; values (type 1), deletions (0, 7). Files are ranked
as ``GetLiveFilesMetaData`` lists them for a column family: level 0 newest first, then levels
1, 2, ...; a key in a lower rank is newer. Anything else (format version 6, compression,
merge operands, range deletions, a wide-column or blob entry, a file whose column family is
not named) raises :class:`Unreadable`: the caller reads through RocksDB instead. A block whose
checksum does not match raises :class:`TableCorrupt`.

Example::

    files = [open_file(path) for path in paths_newest_first]
    for keys, rows in scan([f for f in files if f.family == "t"], value_bytes=4 * dim):
        ...
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numba
import numpy as np

from jctr.ops.checksum import TABLES, crc32c_range, mask
from jctr.ops.host_index import copy_bytes, host_kernel
from jctr.stores.sst_file import CRC32C, MAGIC

FOOTER_BYTES = 53  # format versions 1-5: checksum type, two handles padded to 41, version, magic
BLOCK_TRAILER = 5  # after each block: its compression type and checksum


class Unreadable(Exception):
    """A table file this reader does not follow: read the table through RocksDB."""


class TableCorrupt(Exception):
    """A table file whose block does not match its checksum (or whose entries are broken)."""


@dataclass
class TableFile:
    """One table file, mapped: its column family, each data block's (offset, size) and last
    user key (big-endian, so that integers order as RocksDB's bytewise comparator does)."""

    path: str
    family: str
    data: np.ndarray  # the file's bytes (a read-only map)
    handles: np.ndarray  # [blocks, 2] int64
    last_keys: np.ndarray  # [blocks] uint64
    entries: int
    mapped: mmap.mmap | None = None  # the map under ``data`` (pages read are let go of)


# -- small blocks (footer, meta-index, properties) in Python: a few per file ---------------
def _varint(buf, pos: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise Unreadable("a varint runs past its block")
        b = buf[pos]
        pos += 1
        v |= (b & 127) << shift
        if b < 128:
            return v, pos
        shift += 7


def _checked_block(data: np.ndarray, offset: int, size: int, path: str) -> bytes:
    fault = _block_fault(data, offset, size, TABLES)
    if fault == 1:
        raise TableCorrupt(f"{path}: the block at byte {offset} does not match its checksum")
    if fault:
        raise Unreadable(f"{path}: a block outside the file, or compressed")
    return bytes(data[offset:offset + size])


def _block_entries(block: bytes, path: str) -> list[tuple[bytes, bytes]]:
    """(key, value) of a block of plain entries (meta-index, properties)."""
    restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    end = len(block) - 4 * (restarts + 1)
    if restarts >= 1 << 31 or end < 0:
        raise Unreadable(f"{path}: a block with a hash index or a bad restart count")
    out, pos, key = [], 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        own, pos = _varint(block, pos)
        size, pos = _varint(block, pos)
        key = key[:shared] + block[pos:pos + own]
        pos += own
        out.append((key, block[pos:pos + size]))
        pos += size
    return out


def open_file(path: str, family: str | None = None) -> TableFile:
    """``path`` mapped and its footer, meta-index, properties and index read (each block's
    checksum checked; the index only if the file is ``family``'s, when given). Raises
    FileNotFoundError if it is gone, :class:`Unreadable` if it is not a file this module
    reads."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < FOOTER_BYTES:
            raise Unreadable(f"{path}: shorter than a table file's footer")
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        data = np.frombuffer(mapped, np.uint8)
    tail = bytes(data[size - FOOTER_BYTES:])
    version, magic = struct.unpack_from("<IQ", tail, 41)
    if magic != MAGIC or not 1 <= version <= 5 or tail[0] != CRC32C:
        raise Unreadable(f"{path}: table format {version} / checksum type {tail[0]} (this "
                         "reader follows format versions 1-5 with CRC-32C)")
    meta_off, pos = _varint(tail, 1)
    meta_size, pos = _varint(tail, pos)
    index_off, pos = _varint(tail, pos)
    index_size, pos = _varint(tail, pos)
    meta = dict(_block_entries(_checked_block(data, meta_off, meta_size, path), path))
    if b"rocksdb.properties" not in meta:
        raise Unreadable(f"{path}: no properties block")
    props_off, p = _varint(meta[b"rocksdb.properties"], 0)
    props_size, _ = _varint(meta[b"rocksdb.properties"], p)
    props = dict(_block_entries(_checked_block(data, props_off, props_size, path), path))

    def number(name: bytes) -> int:
        return _varint(props[name], 0)[0] if name in props else 0
    name = props.get(b"rocksdb.column.family.name", b"").decode("utf-8", "replace")
    if not name:
        raise Unreadable(f"{path}: the file does not name its column family")
    if props.get(b"rocksdb.comparator", b"leveldb.BytewiseComparator") != \
            b"leveldb.BytewiseComparator":
        raise Unreadable(f"{path}: another comparator")
    if number(b"rocksdb.merge.operands") or number(b"rocksdb.num.range-deletions"):
        raise Unreadable(f"{path}: merge operands or range deletions")
    index_type = props.get(b"rocksdb.block.based.table.index.type", b"\0\0\0\0")
    if len(index_type) != 4 or struct.unpack("<I", index_type)[0] != 0:
        raise Unreadable(f"{path}: an index other than binary search")
    if b"rocksdb.num.data.blocks" not in props or b"rocksdb.num.entries" not in props:
        raise Unreadable(f"{path}: no block or entry count")
    blocks = number(b"rocksdb.num.data.blocks")
    if family is not None and name != family:  # another table's: its index not needed
        return TableFile(path, name, data, np.zeros((0, 2), np.int64), np.zeros(0, np.uint64),
                         0)
    _checked_block(data, index_off, index_size, path)  # (its checksum)
    handles = np.zeros((blocks, 2), np.int64)
    last = np.zeros(blocks, np.uint64)
    got = _index(data, index_off, index_size,
                 bool(number(b"rocksdb.index.value.is.delta.encoded")),
                 bool(number(b"rocksdb.index.key.is.user.key")), handles, last)
    if got != blocks:
        raise Unreadable(f"{path}: its index does not hold {blocks} well-formed data blocks "
                         f"({got})")
    return TableFile(path, name, data, handles, last, number(b"rocksdb.num.entries"), mapped)


@numba.njit(inline="always")
def _read_varint(data, pos, end):
    """(value, position after) of the varint at ``pos``; position -1 if it runs past
    ``end``."""
    v = np.uint64(0)
    shift = 0
    while pos < end and shift <= 63:
        b = data[pos]
        pos += 1
        v |= np.uint64(b & 127) << np.uint64(shift)
        if b < 128:
            return v, pos
        shift += 7
    return v, -1


@numba.njit(inline="always")
def _u32_at(data, pos):
    """The little-endian 32-bit number at ``pos`` (a restart count, a stored checksum)."""
    return np.int64(data[pos]) | (np.int64(data[pos + 1]) << 8) | \
        (np.int64(data[pos + 2]) << 16) | (np.int64(data[pos + 3]) << 24)


@host_kernel
def _block_fault(data, off, size, tables):
    """0 if the block at ``off`` of ``size`` bytes is in the file, uncompressed and matches its
    trailer's masked CRC-32C; 1 if its checksum does not match; 2 if it is outside the file
    or compressed."""
    end = off + size
    if off < 0 or size < 4 or end + 5 > data.size or data[end] != 0:
        return 2
    if np.int64(mask(crc32c_range(data, off, end + 1, tables))) != _u32_at(data, end + 1):
        return 1
    return 0


@numba.njit(inline="always")
def _two_varints(data, pos, end):
    """Two varints one after the other (a key's shared and own lengths, a block handle);
    position -1 if they run past ``end``."""
    a, pos = _read_varint(data, pos, end)
    if pos < 0:
        return a, a, pos
    b, pos = _read_varint(data, pos, end)
    return a, b, pos


@numba.njit(inline="always")
def _be8(buf):
    v = np.uint64(0)
    for b in range(8):
        v = (v << np.uint64(8)) | np.uint64(buf[b])
    return v


@host_kernel
def _index(data, offset, size, delta, user_keys, handles, last):
    """Each data block's (offset, size) and the largest user key it may hold (``last``)
    from an index block of binary search (keys: user keys, or internal keys when
    ``user_keys`` is false, either maybe separators shorter than a key; values: block
    handles, or, in a
    delta-encoded index, after an entry's shared key bytes the size's zigzag delta).
    Returns the blocks read, or -1 if the entries are malformed or the blocks do not follow
    one another from byte 0."""
    end = offset + size
    restarts = _u32_at(data, end - 4)
    stop = end - 4 * (restarts + 1)
    if restarts <= 0 or stop < offset:
        return -1
    key = np.zeros(64, np.uint8)
    pos = offset
    n = 0
    prev_off = np.int64(0)
    prev_size = np.int64(0)
    while pos < stop:
        shared, own, pos = _two_varints(data, pos, stop)
        if pos < 0:
            return -1
        if not delta:
            _vlen, pos = _read_varint(data, pos, stop)
            if pos < 0:
                return -1
        length = shared + own
        if length > 64 or pos + own > stop:
            return -1
        for b in range(own):
            key[shared + b] = data[pos + b]
        pos += own
        if n >= handles.shape[0]:
            return -1
        if delta and shared != 0:  # (block_builder.cc: a delta only after shared bytes)
            z, pos = _read_varint(data, pos, stop)
            if pos < 0:
                return -1
            d = np.int64(z >> np.uint64(1)) ^ -np.int64(z & np.uint64(1))  # zigzag
            off = prev_off + prev_size + 5
            sz = prev_size + d
        else:
            uo, us, pos = _two_varints(data, pos, stop)
            if pos < 0:
                return -1
            off = np.int64(uo)
            sz = np.int64(us)
        expected = 0 if n == 0 else prev_off + prev_size + 5
        if off != expected or sz < 4:
            return -1
        handles[n, 0] = off
        handles[n, 1] = sz
        if not user_keys:  # internal keys: the user key before the 8-byte trailer
            length -= 8
        if length < 1:
            return -1
        if length >= 8:  # a (user or internal) key: the block's keys are at most its user key
            last[n] = _be8(key)
        else:
            # a shortened separator S (RocksDB's FindShortestSeparator): the block's 8-byte
            # keys are below S padded with zeros, the next block's at or above it
            for b in range(length, 8):
                key[b] = 0
            padded = _be8(key)
            if padded == 0:
                return -1
            last[n] = padded - np.uint64(1)
        prev_off = off
        prev_size = sz
        n += 1
    return n


@host_kernel
def _blocks_entries(data, handles, first, stop_block, value_bytes, tables, keys, types,
                    values, file_no, files):
    """The entries of data blocks ``first .. stop_block - 1`` appended: user key (big-endian),
    type, value offset, the file's number. Returns (entries, error, block): error 0 fine,
    1 a checksum mismatch, 2 a malformed or unexpected entry, 3 no room for ``block``'s
    entries (those before it written)."""
    n = 0
    key = np.zeros(16, np.uint8)
    for j in range(first, stop_block):
        off = handles[j, 0]
        size = handles[j, 1]
        end = off + size
        if n + size // 4 + 1 > keys.size:  # an entry takes 4 bytes or more
            return n, 3, j
        fault = _block_fault(data, off, size, tables)
        if fault:
            return n, fault, j
        restarts = _u32_at(data, end - 4)
        stop = end - 4 * (restarts + 1)
        if restarts <= 0 or restarts >= 1 << 31 or stop < off:
            return n, 2, j
        pos = off
        while pos < stop:
            shared, own, pos = _two_varints(data, pos, stop)
            if pos < 0:
                return n, 2, j
            vlen, pos = _read_varint(data, pos, stop)
            if pos < 0 or shared + own != 16 or pos + own > stop:
                return n, 2, j
            for b in range(own):
                key[shared + b] = data[pos + b]
            pos += own
            kind = key[8]
            if kind == 1:
                if vlen != value_bytes:
                    return n, 2, j
            elif kind == 0 or kind == 7:
                pass
            else:  # merge operands, blob indexes, wide columns, ...: not this reader's
                return n, 2, j
            if pos + vlen > stop or n >= keys.size:
                return n, 2, j
            keys[n] = _be8(key)
            types[n] = kind
            values[n] = pos
            files[n] = file_no
            pos += vlen
            n += 1
    return n, 0, -1


@host_kernel
def _merge(keys, types, starts, winners):
    """Entries of several files (file ``f``'s at ``starts[f] .. starts[f + 1] - 1``, each in
    its key order, a key's entries newest first; file 0 newest): each key's newest entry,
    in key order, values only (a newest deletion hides the key). Returns the winners' count,
    or -1 if a file's keys go down."""
    k = starts.size - 1
    cur = starts[:-1].copy()
    n = 0
    while True:
        best = -1
        low = np.uint64(0)
        for f in range(k):
            if cur[f] < starts[f + 1]:
                v = keys[cur[f]]
                if best < 0 or v < low:
                    best = f
                    low = v
        if best < 0:
            return n
        if types[cur[best]] == 1:
            winners[n] = cur[best]
            n += 1
        for f in range(k):  # every version of the key passed, in every file
            while cur[f] < starts[f + 1] and keys[cur[f]] == low:
                cur[f] += 1
            if cur[f] < starts[f + 1] and keys[cur[f]] < low:
                return -1


def _unmap_blocks(f: TableFile, first: int, stop: int) -> None:
    """Data blocks ``first .. stop - 1`` of ``f``, read, let go of: a pass over a table
    larger than memory would otherwise hold every page it read in its resident memory to the
    end (clean pages the kernel can take back, but counted as the process's; a server's 20M
    rows: 1.4 -> 3.1 GB). The pages stay in the page cache; a block read again (a range's
    edge) comes back from there."""
    if first >= stop or f.mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(f.handles[first, 0]) // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(int(f.handles[stop - 1, 0] + f.handles[stop - 1, 1]) + BLOCK_TRAILER,
              f.data.size)
    if end > start:
        f.mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


@host_kernel
def _gather(data, offsets, rows, at):
    """``rows[at[i]] = data[offsets[i] : offsets[i] + rows.shape[1]]``."""
    w = rows.shape[1]
    for i in range(offsets.size):
        copy_bytes(rows.ctypes.data + at[i] * w, data.ctypes.data + offsets[i], w)


def scan(files: list[TableFile], value_bytes: int, chunk: int = 65536, *,
         range_entries: int = 1 << 20) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(keys int64, rows [m, value_bytes] uint8) of the table ``files`` hold (newest first),
    in key order, about ``chunk`` rows at a time. The key space is cut at data blocks' last
    keys into ranges of about ``range_entries`` entries, each read and merged in turn (memory
    for one range, not the table)."""
    if not files:
        return
    bounds = _ranges(files, range_entries)
    lo = None
    for hi in bounds:  # keys in (lo, hi]
        spans = []
        estimate = 4096
        for f in files:
            first = 0 if lo is None else int(np.searchsorted(f.last_keys, lo, "left"))
            stop = f.last_keys.size if hi is None else \
                min(int(np.searchsorted(f.last_keys, hi, "left")) + 1, f.last_keys.size)
            spans.append((first, stop))
            estimate += int(1.25 * (stop - first) * f.entries / max(f.last_keys.size, 1))
        out = _Entries(estimate)
        starts = np.zeros(len(files) + 1, np.int64)
        for i, (f, (first, stop)) in enumerate(zip(files, spans)):
            begin = out.n
            while first < stop:
                got, err, block = _blocks_entries(
                    f.data, f.handles, first, stop, value_bytes, TABLES, out.keys[out.n:],
                    out.types[out.n:], out.offs[out.n:], i, out.fids[out.n:])
                out.n += got
                if err == 3:  # more entries than estimated: room, then on from that block
                    out.grow()
                    first = block
                    continue
                if err == 1:
                    raise TableCorrupt(f"{f.path}: data block {block} (byte "
                                       f"{f.handles[block, 0]}) does not match its checksum")
                if err:
                    raise Unreadable(f"{f.path}: data block {block} holds an entry this "
                                     "reader does not follow")
                break
            # only keys of this range (a block at its edge holds keys of the next)
            seg = out.keys[begin:out.n]
            a = 0 if lo is None else int(np.searchsorted(seg, lo, "right"))
            b = seg.size if hi is None else int(np.searchsorted(seg, hi, "right"))
            if a or b < seg.size:
                for arr in (out.keys, out.types, out.offs, out.fids):
                    arr[begin:begin + b - a] = arr[begin + a:begin + b].copy()
            out.n = begin + b - a
            starts[i + 1] = out.n
        at = out.n
        keys, types, offs, fids = out.keys, out.types, out.offs, out.fids
        winners = np.empty(at, np.int64)
        m = _merge(keys[:at], types[:at], starts, winners)
        if m < 0:
            raise Unreadable("a table file's keys are not in order")
        winners = winners[:m]
        for s in range(0, m, chunk):
            w = winners[s:s + chunk]
            rows = np.empty((w.size, value_bytes), np.uint8)
            wf = fids[w]
            for i, f in enumerate(files):
                sel = np.flatnonzero(wf == i)
                if sel.size:
                    _gather(f.data, offs[w[sel]], rows, sel)
            yield keys[w].byteswap().view(np.int64), rows
        for f, (first, stop) in zip(files, spans):
            _unmap_blocks(f, first, stop)
        lo = hi
        if hi is None:
            return


class _Entries:
    """The entries of one key range (user key, type, value offset, file), grown on demand."""

    def __init__(self, size: int):
        self.n = 0
        self.keys = np.empty(size, np.uint64)
        self.types = np.empty(size, np.uint8)
        self.offs = np.empty(size, np.int64)
        self.fids = np.empty(size, np.int32)

    def grow(self) -> None:
        for name in ("keys", "types", "offs", "fids"):
            old = getattr(self, name)
            new = np.empty(2 * old.size + 4096, old.dtype)
            new[:self.n] = old[:self.n]
            setattr(self, name, new)


def _ranges(files: list[TableFile], range_entries: int) -> list:
    """Upper bounds (inclusive; None: the end) of key ranges of about ``range_entries``
    entries, cut at data blocks' last keys."""
    per_block = [f.entries / max(f.last_keys.size, 1) for f in files]
    cuts = np.concatenate([f.last_keys for f in files])
    weight = np.concatenate([np.full(f.last_keys.size, w) for f, w in zip(files, per_block)])
    if not cuts.size:
        return [None]
    order = np.argsort(cuts, kind="stable")
    total = np.cumsum(weight[order])
    picks = np.searchsorted(total, np.arange(range_entries, total[-1], range_entries))
    bounds = list(np.unique(cuts[order][picks])) if picks.size else []
    return [*bounds, None]
