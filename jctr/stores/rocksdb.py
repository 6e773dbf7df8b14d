"""The persistent database: RocksDB (through ``rocksdict``), one column family per table.

Keys are the 8 little-endian bytes of the int64 key, values the float32 vector's bytes (the
layout HugeCTR writes). Lookups and writes go in chunks of ``max_get_batch_size`` /
``max_set_batch_size``. A database jctr created carries a marker in its default column family;
a ``path`` that holds another RocksDB database, or files that are not a database, is refused
(never written into), as is a missing path with ``read_only``.

Looking into an existing folder, and every ``read_only`` open, goes through a private folder of
links to the database's files: ``rocksdict`` rewrites its ``rocksdict-config.json`` and
RocksDB its ``LOG`` on every open, which must touch neither a foreign database nor read-only
storage. (A read-only database must not be written by another process meanwhile: its
compactions would delete the files linked to.)

Example::

    store = RocksDBStore(PersistentDatabaseParams(type="rocks_db", path="/data/hps"))
    store.insert("hps_et.m.t", keys, vectors)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import operator
import os
import shutil
import tempfile
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from jctr.config.hps import PersistentDatabaseParams
from jctr.ops import host_index
from jctr.ops.host_sort import gather_rows
from jctr.stores.base import (
    StoreError,
    as_keys,
    as_values,
    bytewise_order,
    check_dim,
    encoded_rows,
    key_columns,
    no_rows,
    put_found,
    row_bytes,
)
from jctr.stores.sst_file import write_table_file

MARKER_KEY = b"jctr.hps.format"
MARKER = b"jctr-hps-rocksdb 1"
_INGEST_PREFIX = "jctr-ingest-"  # a bulk load's table file, beside the database until moved in


@functools.cache  # once a process: the environment is RocksDB's default, shared
def _background_env(rocksdict):
    """RocksDB's default environment (every database of the process shares its thread pools),
    its compaction threads at the lowest CPU priority (nice 19, each thread as it next runs a
    job: RocksDB's ``LowerThreadPoolCPUPriority``). A compaction then takes the cores the
    serving, updating and training threads leave: on two cores it took ~20% of them during a
    burst of online updates, ahead of the updates' own apply (docs/performance.md). It never
    starves: a database whose compactions fall behind stalls its writers (RocksDB's level-0
    limits), which waits for them."""
    env = rocksdict.Env()
    env.lower_thread_pool_cpu_priority()
    return env


def _dim_key(table: str) -> bytes:
    """Where the default column family keeps a table's vector size (never in the table's
    own family: any 8 bytes there are a key)."""
    return b"jctr.dim/" + table.encode()


def _meta_key(table: str) -> bytes:
    return b"jctr.manifest/" + table.encode()


_FAMILY_PREFIX = b"jctr.family/"


def _family_key(table: str) -> bytes:
    """Where the default column family names the column family holding a table's rows, when
    it is not the table's own name (a table swapped with another, :meth:`RocksDBStore.
    swap_tables`)."""
    return _FAMILY_PREFIX + table.encode()


def _shadow(path: str) -> str:
    """A new temporary folder of links to the database files of ``path`` (not its LOCK, LOG
    or rocksdict's config): RocksDB opens it read-only and writes what it must there."""
    shadow = tempfile.mkdtemp(prefix="jctr-rocksdb-ro.")
    for name in os.listdir(path):
        if name == "LOCK" or name.startswith("LOG") or name == "rocksdict-config.json":
            continue
        os.symlink(os.path.join(path, name), os.path.join(shadow, name))
    return shadow


def _key_bytes(keys: np.ndarray) -> list[bytes]:
    return row_bytes(key_columns(keys))


class RocksDBStore:
    """``rocks_db`` persistent database (see the module docstring)."""

    name = "rocks_db"

    def __init__(self, params: PersistentDatabaseParams, *,
                 label: str = "persistent_db.path", bulk: bool = False):
        import rocksdict

        self._rd = rocksdict
        # bulk: whole tables written, then read (streaming's row store): writes go into a
        # vector memtable (no ordered insert per key) and every write is flushed at once
        # (:meth:`_settle`), since a read of an unflushed vector memtable sorts it
        self._bulk = bulk
        self.params = params
        self.label = label  # the setting that named the folder, for errors
        self.path = os.path.abspath(params.path)
        self._lock = threading.Lock()
        # rocksdict keeps the database open (and its LOCK held: an open in this process is
        # refused) while any family, handle or iterator of it lives, whatever close() said:
        # close() waits for the calls in flight, ends the passes left half done and closes
        # every family it lent (see _use, items, _handle)
        self._in_use = threading.Condition()
        self._busy = 0
        self._closed = False
        self._scans: dict[int, list] = {}  # each unfinished pass's iterator, in a cell
        # a dropped table's family is closed and dropped once every call that began before
        # (a lookup that took the family before a swap) has ended: closed under a reader it
        # raises there ("Already borrowed"), and a family kept open keeps its files on disk.
        # Calls count by the epoch they began in; each drop begins a new one
        self._epoch = 0
        self._active: dict[int, int] = {}
        self._retired: list[tuple[int, str, object]] = []  # (epoch, family name, family)
        self._dropping: set[str] = set()  # names of families released, not yet dropped
        self._handles: dict[str, object] = {}
        self._dims: dict[str, int] = {}
        self._shadow: str | None = None
        exists = os.path.isdir(self.path) and bool(os.listdir(self.path))
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise StoreError(f"{self.label} {self.path}: is a file, not a RocksDB folder")
        if exists and not os.path.exists(os.path.join(self.path, "CURRENT")):
            raise StoreError(f"{self.label} {self.path}: holds files that are not a "
                             "RocksDB database; give an empty folder or a jctr HPS database")
        if not exists and params.read_only:
            raise StoreError(f"{self.label} {self.path}: no database there to open "
                             "read-only; load one first (python -m jctr.serve load)")
        opts = self._options()
        opts.create_if_missing(not exists)
        opts.increase_parallelism(params.num_threads)
        families = {}
        if exists:
            # look before writing, through links: nothing in another's database changes
            self._shadow = _shadow(self.path)
            try:
                families = {name: self._options() for name in
                            rocksdict.Rdict.list_cf(self._shadow, self._options())}
                probe = rocksdict.Rdict(self._shadow, self._options(),
                                        column_families=families,
                                        access_type=rocksdict.AccessType.read_only())
                marker = probe.get(MARKER_KEY)
                probe.close()
            except Exception as e:  # rocksdict raises plain Exception
                self._drop_shadow()
                raise StoreError(f"{self.label} {self.path}: cannot open as RocksDB: "
                                 f"{e}") from None
            if marker != MARKER:
                self._drop_shadow()
                raise StoreError(f"{self.label} {self.path}: holds another RocksDB "
                                 "database (no jctr HPS marker); jctr does not write into it: "
                                 "give an empty folder")
            if not params.read_only:
                self._drop_shadow()
        access = (rocksdict.AccessType.read_only() if params.read_only
                  else rocksdict.AccessType.read_write())
        try:
            self.db = rocksdict.Rdict(self._shadow or self.path, opts,
                                      column_families=families or None, access_type=access)
        except Exception as e:
            self._drop_shadow()
            raise StoreError(f"{self.label} {self.path}: cannot open RocksDB: {e}") \
                from None
        if not exists:
            self.db.put(MARKER_KEY, MARKER)
        if not params.read_only:
            # a bulk load's table file left by a process killed while writing it: the
            # database's lock (now ours) says no one else is writing one
            for name in os.listdir(self.path):
                if name.startswith(_INGEST_PREFIX) and name.endswith(".sst"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(self.path, name))
        # each table's column family: its own name, or the one a swap gave it
        named = {}
        for key, value in self.db.items(from_key=_FAMILY_PREFIX):
            if not key.startswith(_FAMILY_PREFIX):
                break
            if value.decode() in families:  # (a name written before its family was made)
                named[key[len(_FAMILY_PREFIX):].decode()] = value.decode()
        taken = set(named.values())
        self._cf_names: dict[str, str] = dict(named)
        for name in families:
            if name != "default" and name not in taken and name not in named:
                self._cf_names[name] = name
        self._families = {table: self.db.get_column_family(cf)
                          for table, cf in self._cf_names.items()}
        for name in self._families:
            dim = self.db.get(_dim_key(name))
            if dim is not None:
                self._dims[name] = int(dim)

    # one LRU cache of data blocks for every table (filled as read, up to this size)
    BLOCK_CACHE_BYTES = 256 << 20
    WRITE_BUFFER_BYTES = 16 << 20  # a memtable's size (RocksDB's default: 64 MB)

    def _options(self):
        opts = self._rd.Options(raw_mode=True)
        opts.set_env(_background_env(self._rd))
        # values are float vectors, which do not compress: RocksDB's default (Snappy) only
        # spends time trying, on every file written, compacted and read (a pass's bulk load
        # of 2.5M rows 15-30% faster without; docs/performance.md)
        opts.set_compression_type(self._rd.DBCompressionType.none())
        if getattr(self, "_bulk", False):
            opts.set_memtable_factory(self._rd.MemtableFactory.vector())
            opts.set_allow_concurrent_memtable_write(False)
        else:
            # writes of scattered keys walk the memtable's skip list: a smaller one stays in
            # the CPU's caches (2M random keys in sorted batches of 10,000: 0.57M rows/s at
            # RocksDB's 64 MB, 0.88-0.93M at 16 MB; point reads alike; docs/performance.md)
            opts.set_write_buffer_size(self.WRITE_BUFFER_BYTES)
        # reads are point lookups of random keys: a bloom filter per file skips the files that
        # lack a key, and cached blocks are not read again (1.6x the lookups per second of
        # RocksDB's defaults on 1M keys; docs/performance.md "Row stores")
        if getattr(self, "_cache", None) is None:
            self._cache = self._rd.Cache(self.BLOCK_CACHE_BYTES)
        table = self._rd.BlockBasedOptions()
        # the table-file layout jctr reads itself (whole-table passes, jctr.stores.table_scan;
        # RocksDB 9's defaults: format 6, XXH3 checksums); a database an older jctr wrote
        # keeps files of format 6 until they are compacted: its passes go through RocksDB
        table.set_format_version(5)
        table.set_checksum_type(self._rd.ChecksumType.crc32c())
        table.set_bloom_filter(10, False)
        table.set_block_cache(self._cache)
        opts.set_block_based_table_factory(table)
        return opts

    def _drop_shadow(self) -> None:
        if self._shadow is not None:
            shutil.rmtree(self._shadow, ignore_errors=True)
            self._shadow = None

    def _family(self, table: str, create_dim: int | None = None):
        cf = self._families.get(table)
        if create_dim is not None and (cf is None or table not in self._dims):
            if self.params.read_only:
                raise StoreError(f"rocks_db {self.path}: read-only, cannot create table {table}")
            # the row width before the table: a process killed between the two leaves a width
            # without a table (harmless), never a table whose rows cannot be read
            self.db.put(_dim_key(table), str(create_dim).encode())
            self._dims[table] = create_dim
            if cf is None:
                name, k = table, 0
                taken = {*self._cf_names.values(), *(r[1] for r in self._retired),
                         *self._dropping}
                while name in taken:  # (the name swapped to another table, or being dropped)
                    k += 1
                    name = f"{table}#{k}"
                # named first: a family made without its name is unused
                if name != table:
                    self.db.put(_family_key(table), name.encode())
                else:  # (a name left by a process killed before it made its family)
                    self.db.delete(_family_key(table))
                cf = self.db.create_column_family(name, self._options())
                self._cf_names[table] = name
                self._families[table] = cf
        return cf

    def swap_tables(self, a: str, b: str) -> None:
        """Tables ``a`` and ``b`` exchange their rows, row widths and manifests at once (one
        write: a crash leaves both as they were or both swapped); a read of either meanwhile
        sees one or the other whole. A server's next base is written into a table of its own
        and swapped in (:meth:`jctr.serving.hps.Databases.switch_links`)."""
        if self.params.read_only:
            raise StoreError(f"rocks_db {self.path}: read-only, cannot swap table {a}")
        with self._use(), self._lock:
            for t in (a, b):
                if self._families.get(t) is None or t not in self._dims:
                    raise StoreError(f"rocks_db {self.path}: no table {t} to swap")
            wb = self._rd.WriteBatch(raw_mode=True)
            try:
                for table, other in ((a, b), (b, a)):
                    cf = self._cf_names[other]
                    if cf == table:
                        wb.delete(_family_key(table))
                    else:
                        wb.put(_family_key(table), cf.encode())
                    wb.put(_dim_key(table), str(self._dims[other]).encode())
                    meta = self.db.get(_meta_key(other))
                    if meta is None:
                        wb.delete(_meta_key(table))
                    else:
                        wb.put(_meta_key(table), meta)
                self.db.write(wb)
            finally:
                del wb
            for names in (self._cf_names, self._families, self._dims):
                names[a], names[b] = names[b], names[a]
            self._handles.pop(a, None)
            self._handles.pop(b, None)
        self._settle()

    def _check_dim(self, table: str, dim: int) -> None:
        check_dim(f"rocks_db {self.path}", table, self._dims.get(table), dim)

    def lookup(self, table: str, keys, dim: int) -> tuple[np.ndarray, np.ndarray]:
        keys, values, found = no_rows(keys, dim)
        with self._use():  # (first: a closed store raises, never reads as empty)
            if self._families.get(table) is None or not keys.size:
                return values, found
            self._check_dim(table, dim)
            kb = _key_bytes(keys)
            step = self.params.max_get_batch_size
            positions = np.arange(keys.size)
            for start in range(0, keys.size, step):
                put_found(values, found, positions[start:start + step],
                          self._families[table].get(kb[start:start + step]))
        return values, found

    # a bulk store's inserts of at least this many rows (an eviction step's spill, a restore)
    # are written as one sorted table file and ingested: no write-ahead log, memtable or
    # flush; rows of 49 floats 2.4x (2,000 rows) to 5.2x (32,000) the rows per second of
    # write batches. Each such file carries its bloom filter (:mod:`jctr.stores.sst_file`),
    # so a point read skips the level-0 files that lack its key as it does RocksDB's own
    # (docs/performance.md). A streaming pass's write-back always is (:meth:`ingest_columns`)
    INGEST_ROWS = 4_096
    # any other store's of at least this many (a served database's model load, the online
    # updates of a poll read together) are too: the file is laid out with the interpreter let
    # go, where rocksdict's write batches hold it (65,536-row updates of 16 floats into a
    # served database: 1.9-3.3M rows/s against 1.1-1.2M; docs/performance.md)
    INGEST_ROWS_LIVE = 32_768

    def insert(self, table: str, keys, values, *, pause: Callable[[], None] | None = None
               ) -> None:
        """Insert or overwrite rows in write batches of ``max_set_batch_size``, in key order
        (``INGEST_ROWS`` / ``INGEST_ROWS_LIVE`` rows or more: one bulk load). ``pause`` is
        called between the batches, outside the store's lock (online updates' persistent side
        yields there: rocksdict holds the interpreter through a write)."""
        if np.size(keys) >= (self.INGEST_ROWS if self._bulk else self.INGEST_ROWS_LIVE):
            self._ingest(table, as_keys(keys), [as_values(values, np.size(keys))])
            return
        keys, kcols, vcols = encoded_rows(keys, values, key_order=True)
        if not keys.size:
            return
        dim = vcols.shape[1] // 4
        kb, vb = row_bytes(kcols), row_bytes(vcols)
        step = self.params.max_set_batch_size
        for start in range(0, keys.size, step):
            if pause is not None and start:
                pause()
            with self._use(), self._lock:  # (each batch: the lock is let go between)
                self._check_dim(table, dim)
                self._family(table, create_dim=dim)
                self._write_batch(table, "put", kb[start:start + step], vb[start:start + step])
        self._settle()

    def _write_batch(self, table: str, op: str, *columns: list[bytes]) -> None:
        """One write batch of ``op`` (``put`` / ``delete``) over the byte strings given, into
        ``table``'s family (filled by map in C: no Python frame per key)."""
        wb = self._rd.WriteBatch(raw_mode=True)
        try:
            wb.set_default_column_family(self._handle(table))
            deque(map(getattr(wb, op), *columns), maxlen=0)
            self.db.write(wb)
        finally:
            del wb  # a traceback keeping this frame would keep the database open (the handle)

    def _handle(self, table: str):
        """``table``'s column-family handle (a write batch's target), kept here alone."""
        if table not in self._handles:
            self._handles[table] = self.db.get_column_family_handle(self._cf_names[table])
        return self._handles[table]

    def ingest_columns(self, table: str, keys, columns: list[np.ndarray]) -> None:
        """:meth:`insert` of rows given as float32 column blocks side by side (``columns[i]``:
        [n, w_i]; a row store's vector, optimizer slots, ...), always as a bulk load: the rows
        are laid out in the database's order straight from the columns (no packed copy to
        sort again)."""
        keys = as_keys(keys)
        if keys.size:
            self._ingest(table, keys, [np.asarray(c, np.float32).reshape(keys.size, -1)
                                       for c in columns])

    def _ingest(self, table: str, keys: np.ndarray, columns: list[np.ndarray]) -> None:
        """:meth:`insert` as RocksDB's bulk load: the rows sorted by their key bytes (the
        database's order; a key given twice keeps its last row, as a write batch would),
        written into one table file beside the database and moved into it. The file is laid
        out by :func:`jctr.stores.sst_file.write_table_file` (compiled, the interpreter let
        go; rocksdict's writer takes a Python call and two bytes objects a row;
        ``docs/performance.md``); a RocksDB that would not take its file gets rocksdict's
        from then on (with a warning)."""
        order = bytewise_order(key_columns(keys))
        dim = sum(c.shape[1] for c in columns)
        kcols = key_columns(np.take(keys, order))
        with self._use(), self._lock:
            self._check_dim(table, dim)
            self._family(table, create_dim=dim)
            folder = self._shadow or self.path
            path = os.path.join(folder, f"{_INGEST_PREFIX}{os.getpid()}-{threading.get_ident()}"
                                        ".sst")
            ingest = self._rd.IngestExternalFileOptions()
            ingest.set_move_files(True)
            # the family close() closes (a handle of its own would keep the database open
            # from a traceback that keeps this frame)
            family = self._families[table]
            try:
                if RocksDBStore._own_files:
                    try:
                        # each row gathered from its columns straight into the file's blocks
                        write_table_file(path, kcols, columns, order,
                                         family=self._cf_names[table])
                        family.ingest_external_file([path], ingest)
                        return
                    except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exception
                        if isinstance(e, (OSError, MemoryError)):
                            raise
                        RocksDBStore._own_files = False
                        warnings.warn(f"rocks_db {self.path}: RocksDB did not take a table "
                                      f"file jctr wrote ({e}); bulk loads go through "
                                      "rocksdict's writer from now on", stacklevel=2)
                        if os.path.exists(path):
                            os.remove(path)
                rows = np.empty((order.size, dim), "<f4")
                at = 0
                for c in columns:  # each block gathered into its place: one pass over the rows
                    gather_rows(rows, at, c, order)
                    at += c.shape[1]
                writer = self._rd.SstFileWriter(options=self._options())
                writer.open(path)
                # in C: no frame per key
                deque(map(writer.__setitem__, row_bytes(kcols), row_bytes(rows.view(np.uint8))),
                      maxlen=0)
                writer.finish()
                family.ingest_external_file([path], ingest)
            finally:
                if os.path.exists(path):
                    os.remove(path)

    # whether bulk loads write their table files themselves (False once RocksDB refused one)
    _own_files = True

    def erase(self, table: str, keys) -> None:
        keys = as_keys(keys)
        with self._use(), self._lock:
            if self._families.get(table) is None or not keys.size:
                return
            self._write_batch(table, "delete", _key_bytes(keys))
        self._settle()

    def scale_columns(self, table: str, at: int, factors: np.ndarray) -> None:
        """Columns ``at, at + 1, ...`` of every row multiplied by ``factors`` (float32): each
        chunk read is written back (the streaming statistics' daily decay of a row store's
        admission counts; :meth:`jctr.stores.row_file.RowFileStore.scale_columns` alike)."""
        f = np.asarray(factors, np.float32)
        for keys, rows in self.items(table):
            rows = rows.copy()
            rows[:, at:at + f.size] *= f
            self.insert(table, keys, rows)

    def items(self, table: str, chunk: int = 65536, *, keyed: bool = False
              ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(keys, rows) of every stored row, a chunk at a time. ``keyed``: each row holds
        its key in its first two float32 columns (a row store's rows, :class:`jctr.online.
        row_store.RowStore`): the pass reads values alone, and the keys come from them (half
        the interpreter's time a row: 310-330 ns, not 570-650; docs/performance.md). A
        pass reads the table's files itself where it can (:meth:`_table_files`,
        :mod:`jctr.stores.table_scan`; a serving database's memtable flushed first), else,
        or from a file it cannot follow on, through RocksDB's iterator (a serving database's
        pass over 20M rows: ~25 s through the iterator)."""
        files = self._table_files(table, flush=not self._bulk)
        start = None
        if files is not None:
            start = yield from self._scan_files(table, files, chunk)
            if start is None:
                return
        # a whole-table pass: its blocks would only push the point reads' blocks out of the
        # cache; the chunks are cut in C (islice), not by a Python step per row
        read = self._rd.ReadOptions()
        read.fill_cache(False)
        with self._use():
            dim = self._dims.get(table)
            if self._families.get(table) is None or dim is None:  # no width: no row written
                return
            cf = self._families[table]
            cell = [(cf.values if keyed else cf.items)(from_key=start or None, read_opt=read)]
            del cf
        self._scans[id(cell)] = cell  # the iterator lives in the cell alone: close() empties it
        last = None  # the last key read, in the database's bytes
        try:
            while True:
                with self._use():
                    if not cell:
                        raise StoreError(f"rocks_db {self.path} table {table}: the database "
                                         "was closed during a pass over the table")
                    part = list(itertools.islice(cell[0], chunk))
                    if not part:
                        cell.clear()
                        self._check_scan_end(table, read, last)
                        return
                if not keyed:
                    keys, values = _decode_pairs(part, dim)
                else:  # joined into a bytearray: a writable array without another copy
                    values = np.frombuffer(bytearray().join(part), np.float32).reshape(-1, dim)
                    keys = values[:, :2].copy().view(np.int64).reshape(-1)
                last = key_columns(keys[-1:]).tobytes()
                yield keys, values
        finally:
            cell.clear()
            self._scans.pop(id(cell), None)

    def _table_files(self, table: str, *, flush: bool = False) -> list | None:
        """``table``'s files, mapped, newest first (:mod:`jctr.stores.table_scan`), when a
        pass can read them instead of RocksDB's iterator: no row in a memtable (a bulk store
        flushes every write; ``flush``: the table's memtable is flushed first) and every
        live file one that module reads; else None. The list is one version of the
        database: a file compacted away before it was mapped makes the list be taken
        again; a row written after the flush makes it None."""
        from jctr.stores import table_scan

        def in_memory(cf) -> bool:
            return any(cf.property_int_value(f"rocksdb.num-entries-{m}") for m in
                       ("active-mem-table", "imm-mem-tables"))

        with self._use():
            if self._families.get(table) is None or table not in self._dims:
                return None
            cf = self._families[table]
            if flush and in_memory(cf):
                with self._lock:
                    cf.flush()
            if in_memory(cf):
                return None
            family = self._cf_names[table]  # (the family's own name: a swap may change it)
            for _ in range(3):
                try:
                    # (a file's family is in its properties: rocksdict's list leaves it out)
                    files = [table_scan.open_file(os.path.join(
                        self._shadow or self.path, f["name"].lstrip("/")), family)
                        for f in self.db.live_files()]
                except FileNotFoundError:
                    continue
                except table_scan.Unreadable:
                    return None
                except table_scan.TableCorrupt as e:
                    raise StoreError(f"rocks_db {self.path} table {table}: {e}") from None
                return [f for f in files if f.family == family]
        return None

    def _scan_files(self, table: str, files: list, chunk: int):
        """:meth:`items` from the table's files (checked block by block; a keyed row's key
        columns are its file key's bytes, so both layouts read alike). Returns None when
        done, or, at an entry the reader does not follow, the key bytes from which RocksDB's
        iterator goes on (b"" for the start)."""
        from jctr.stores import table_scan

        dim = self._dims[table]
        last = None
        try:
            for keys, rows in table_scan.scan(files, 4 * dim, chunk):
                if self._closed:
                    raise StoreError(f"rocks_db {self.path}: the database is closed")
                last = int(keys[-1])
                yield keys, rows.view(np.float32)
        except table_scan.TableCorrupt as e:
            raise StoreError(f"rocks_db {self.path} table {table}: the database cannot be "
                             f"read: {e}") from None
        except table_scan.Unreadable:
            if last is None:
                return b""
            after = int.from_bytes(key_columns(np.array([last], np.int64)).tobytes(), "big")
            if after == (1 << 64) - 1:  # the last key there is: nothing after it
                return None
            return (after + 1).to_bytes(8, "big")  # the next key in bytewise order
        return None

    def _check_scan_end(self, table: str, read, last: bytes | None) -> None:
        """A pass over a table stopped where it should: rocksdict's iteration ends quietly at
        a block it cannot read (a damaged file: half the rows, no error), so the key after
        the last one read is looked up again: an error there is raised. (A key found there
        and read without error was written after the pass began: a pass reads the table as
        it was when it started.)"""
        it = self._families[table].iter(read)
        try:
            if last is None:
                it.seek_to_first()
            else:
                it.seek(last)
                if it.valid():
                    it.next()
            if it.valid():  # reads (and checks) the block the pass could not
                self._families[table].get(it.key())
            it.status()
        except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exception
            raise StoreError(f"rocks_db {self.path} table {table}: the database cannot be "
                             f"read past key bytes {last!r}: {e}") from None
        finally:
            del it  # (a traceback keeping this frame would keep the database open)

    def size(self, table: str) -> int:
        return sum(k.size for k, _ in self.items(table))

    def _settle(self) -> None:
        """A bulk store's write ends with every memtable on disk: a read of an unflushed
        vector memtable would sort it."""
        if self._bulk:
            with self._use(), self._lock:
                self.db.flush()
                for cf in self._families.values():
                    cf.flush()

    def estimated_rows(self, table: str) -> int:
        """RocksDB's estimate of a table's keys (no pass over it)."""
        with self._use():
            if self._families.get(table) is None:
                return 0
            return int(self._families[table].property_int_value("rocksdb.estimate-num-keys")
                       or 0)

    def lookup_by_scan(self, table: str, keys, dim: int, *, keyed: bool = False
                       ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`lookup`'s answer from one sequential pass over the table: cheaper than point
        reads when the keys are a large share of it (a read costs several times a scanned
        row; ``docs/performance.md``). ``keyed``: see :meth:`items`."""
        keys, values, found = no_rows(keys, dim)
        with self._use():  # (a closed store raises, never reads as empty)
            if self._families.get(table) is None or not keys.size:
                return values, found
        self._check_dim(table, dim)
        index = np.full(host_index.index_size(keys.size), -1, np.int64)
        distinct = np.empty(keys.size, np.int64)
        at = np.empty(keys.size, np.int64)  # each key's place among the distinct ones
        n = host_index.upsert(index, distinct, 0, keys, at)
        rows = np.zeros((n, dim), np.float32)
        held = np.zeros(n, bool)
        for stored, vectors in self.items(table, keyed=keyed):
            host_index.scatter_found(index, distinct, stored, vectors, rows, held)
        if n == keys.size:  # no key given twice: each is its own distinct one, in order
            return rows, held
        return np.take(rows, at, axis=0), held[at]

    def dim(self, table: str) -> int | None:
        return self._dims.get(table)

    def tables(self) -> list[str]:
        return sorted(self._families)

    def get_meta(self, table: str) -> dict | None:
        with self._use():
            raw = self.db.get(_meta_key(table))
        if raw is None:
            return None
        try:
            meta = json.loads(raw)
        except ValueError:
            return None
        return meta if isinstance(meta, dict) else None

    def set_meta(self, table: str, meta: dict | None) -> None:
        if self.params.read_only:
            raise StoreError(f"rocks_db {self.path}: read-only, cannot write table {table}")
        with self._use(), self._lock:
            if meta is None:
                self.db.delete(_meta_key(table))
            else:
                # after the rows in the write-ahead log: a load killed before this line
                # leaves no manifest, whatever it had written
                self.db.put(_meta_key(table), json.dumps(meta, sort_keys=True).encode())
        self._settle()

    def drop_table(self, table: str) -> None:
        if self.params.read_only:
            raise StoreError(f"rocks_db {self.path}: read-only, cannot drop table {table}")
        with self._use(), self._lock:
            self.db.delete(_meta_key(table))  # first: a half-dropped table is not complete
            if table in self._families:
                self._handles.pop(table, None)
                with self._in_use:
                    self._epoch += 1
                    self._retired.append((self._epoch, self._cf_names.pop(table),
                                          self._families.pop(table)))
            self.db.delete(_family_key(table))
            self.db.delete(_dim_key(table))
            self._dims.pop(table, None)
        self._settle()

    # how long close() waits for calls in flight on other threads (a chunk of a pass, a
    # write batch, a bulk load) before it closes what it can anyway
    CLOSE_WAIT_S = 120.0

    @contextlib.contextmanager
    def _use(self) -> Iterator[None]:
        """A call into the database, counted: :meth:`close` waits for it; none starts after
        close."""
        with self._in_use:
            if self._closed:
                raise StoreError(f"rocks_db {self.path}: the database is closed")
            self._busy += 1
            epoch = self._epoch
            self._active[epoch] = self._active.get(epoch, 0) + 1
        try:
            yield
        finally:
            with self._in_use:
                self._active[epoch] -= 1
                if not self._active[epoch]:
                    del self._active[epoch]
                oldest = min(self._active, default=self._epoch + 1)
                done = [r for r in self._retired if r[0] <= oldest]
                self._retired = [r for r in self._retired if r[0] > oldest]
                self._dropping.update(name for _, name, _ in done)
            try:
                if done:  # no call that began before their drops is left
                    with self._lock:
                        for _, name, family in done:
                            family.close()
                            self.db.drop_column_family(name)
                            self._dropping.discard(name)
            finally:
                with self._in_use:  # (counted until then: close waits for the drops too)
                    self._busy -= 1
                    self._in_use.notify_all()

    def close(self) -> None:
        """Closes the database once the calls in flight are done; a pass over a table left
        half done (its generator still referenced) raises :class:`StoreError` if resumed. A
        database closed here opens again at once in this process."""
        with self._in_use:
            if self._closed:
                return
            self._closed = True
            if not self._in_use.wait_for(lambda: self._busy == 0, self.CLOSE_WAIT_S):
                warnings.warn(f"rocks_db {self.path}: closed while {self._busy} call(s) on "
                              f"other threads had not ended after {self.CLOSE_WAIT_S:.0f} s; "
                              "the database stays locked until they do", stacklevel=2)
        for cell in list(self._scans.values()):
            cell.clear()
        self._scans.clear()
        self._handles.clear()
        for family in self._families.values():
            family.close()
        self._families.clear()
        for _, name, family in self._retired:  # (none left: close waited for every call)
            family.close()
            self.db.drop_column_family(name)
        self._retired.clear()
        self.db.close()
        self._drop_shadow()


def _decode_pairs(pairs: list[tuple[bytes, bytes]], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values) of (key bytes, value bytes) pairs, joined in C."""
    keys = np.frombuffer(b"".join(map(operator.itemgetter(0), pairs)), "<i8").astype(np.int64)
    values = np.frombuffer(b"".join(map(operator.itemgetter(1), pairs)),
                           np.float32).reshape(-1, dim).copy()
    return keys, values
