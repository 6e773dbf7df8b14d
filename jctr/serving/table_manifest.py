"""What a database table holds: the manifest ``python -m jctr.serve load`` writes as the last step
of loading a table, and the check ``serve`` makes before it answers from it.

A manifest names the model files the rows came from by content (SHA-256 of the dense file and
of the table's ``key`` and ``emb_vector`` files, combined into one ``identity``), with the row
count and vector size; with streaming training's delta models applied over a base, the chain
of their sparse files and the last delta's dense file. A table without one was never loaded
completely (a load stopped half way); a table whose identity differs holds another export of
the model. Either would serve
wrong rows under the new dense weights, so ``serve`` refuses both.

Hashing is the slow part of a restart (a 50 GB model takes ~50 s), so a manifest also keeps,
under ``files``, each file's size, times, inode and digest; a later start takes a stored
digest instead of reading the file again where all of those still match and the file was
last written well before it was hashed (:func:`remember`, git's index check). A file changed
since changes its ``ctime``, which no program can set back.

Example::

    expected = table_manifest(dense_path, sparse_folder, rows=n, dim=16)
    problem = mismatch(store.get_meta(table), expected)   # None: the table is this export's
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

_CHUNK = 1 << 22
# a file written this close to the start of its hashing may have been written again in the
# same tick of the file system's clock (a few ms; seconds on some network file systems)
RACY_NS = 2_000_000_000
# (path, size, mtime, ctime, inode) -> (sha256, when its hashing began): hashed once
_digests: dict[tuple[str, int, int, int, int], tuple[str, int]] = {}
_lock = threading.Lock()


def _stat_key(path: str) -> tuple[str, int, int, int, int]:
    st = os.stat(path)
    return (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _digest(path: str) -> tuple[tuple, str, int]:
    """(the file's stat key, its SHA-256, when the hashing began), hashed once a key."""
    key = _stat_key(path)
    with _lock:
        if key in _digests:
            return (key, *_digests[key])
    began = time.time_ns()
    digest = _hash_file(path)
    if _stat_key(path) == key:  # written while read: not remembered
        with _lock:
            _digests[key] = (digest, began)
    return key, digest, began


def _hash_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: str) -> str:
    """SHA-256 of a file's bytes (remembered while the file keeps its size, times and inode)."""
    return _digest(path)[1]


def remember(stored: dict | None) -> int:
    """Take the digests a stored manifest recorded (its ``files``) for the files that are
    still as they were then and were written ``RACY_NS`` or more before their hashing began;
    returns how many were taken."""
    taken = 0
    for path, f in ((stored or {}).get("files") or {}).items():
        try:
            key = (path, int(f["size"]), int(f["mtime_ns"]), int(f["ctime_ns"]),
                   int(f["ino"]))
            digest, began = str(f["sha256"]), int(f["hashed_ns"])
            if (_stat_key(path) != key or max(key[2], key[3]) > began - RACY_NS
                    or len(digest) != 64):
                continue
        except (OSError, KeyError, TypeError, ValueError, AttributeError):
            continue
        with _lock:
            _digests.setdefault(key, (digest, began))
        taken += 1
    return taken


def _file_record(path: str) -> tuple[str, dict]:
    key, digest, began = _digest(path)
    return key[0], {"size": key[1], "mtime_ns": key[2], "ctime_ns": key[3], "ino": key[4],
                    "sha256": digest, "hashed_ns": began}


def table_manifest(dense_file: str, sparse_folder: str, *, rows: int, dim: int,
                   deltas: tuple[str, ...] = ()) -> dict:
    """The manifest of one table loaded from ``sparse_folder`` for the model whose dense
    weights are ``dense_file``; ``deltas`` (streaming training's delta models of this table,
    in order) are applied over it. ``links`` names each sparse part (the base, then every
    delta) by content, so a table holding the first links of a chain takes only the rest."""
    parts = {"dense_sha256": file_digest(dense_file),
             "key_sha256": file_digest(os.path.join(sparse_folder, "key")),
             "emb_vector_sha256": file_digest(os.path.join(sparse_folder, "emb_vector"))}
    links = [_link(sparse_folder)] + [_link(d) for d in deltas]
    files = dict(_file_record(p) for p in
                 [dense_file] + [os.path.join(folder, name) for folder in (sparse_folder,
                                                                           *deltas)
                                 for name in ("key", "emb_vector")])
    if deltas:
        identity = _sha("chain" + parts["dense_sha256"] + "".join(links))
    else:
        identity = _sha("".join(parts[k] for k in sorted(parts)))
    return {"identity": identity, "rows": int(rows), "dim": int(dim), **parts,
            "links": links, "dense_file": os.path.abspath(dense_file),
            "sparse_file": os.path.abspath(sparse_folder),
            "delta_files": [os.path.abspath(d) for d in deltas], "files": files}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _link(sparse_folder: str) -> str:
    return _sha(file_digest(os.path.join(sparse_folder, "key"))
                + file_digest(os.path.join(sparse_folder, "emb_vector")))


def links_held(stored: dict | None, expected: dict) -> int | None:
    """How many links of ``expected``'s chain a table holding ``stored`` has, when they are
    its first ones and it holds fewer (the rest can be applied over it); else None."""
    if not stored or stored.get("incomplete") or stored.get("dim") != expected["dim"]:
        return None
    have, want = stored.get("links") or [], expected["links"]
    if 0 < len(have) < len(want) and want[:len(have)] == have:
        return len(have)
    return None


def incomplete(stored: dict) -> dict:
    """``stored`` marked as being updated: a table left so by a stop is loaded afresh."""
    return {**stored, "incomplete": True}


def short(identity: str | None) -> str:
    return "none" if not identity else identity[:12]


def mismatch(stored: dict | None, expected: dict) -> str | None:
    """None when ``stored`` is ``expected``'s manifest; else why not, in words."""
    if stored is None:
        return ("holds rows but no manifest: it was never loaded completely (a load stopped "
                "half way, or another program wrote it)")
    if stored.get("incomplete"):
        return ("was being updated with delta models when the update stopped: it holds some "
                "of their rows")
    if stored.get("identity") != expected["identity"]:
        return (f"holds export {short(stored.get('identity'))} (from "
                f"{stored.get('sparse_file', '?')}), but the model files give export "
                f"{short(expected['identity'])}")
    if stored.get("dim") != expected["dim"]:
        return f"holds vectors of size {stored.get('dim')}, the model has {expected['dim']}"
    return None
