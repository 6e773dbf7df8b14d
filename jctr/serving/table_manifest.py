"""What a database table holds: the manifest ``python -m jctr.serve load`` writes as the last step
of loading a table, and the check ``serve`` makes before it answers from it.

A manifest names the model files the rows came from by content (SHA-256 of the dense file and
of the table's ``key`` and ``emb_vector`` files, combined into one ``identity``), with the row
count and vector size. A table without one was never loaded completely (a load stopped half
way); a table whose identity differs holds another export of the model. Either would serve
wrong rows under the new dense weights, so ``serve`` refuses both.

Example::

    expected = table_manifest(dense_path, sparse_folder, rows=n, dim=16)
    problem = mismatch(store.get_meta(table), expected)   # None: the table is this export's
"""

from __future__ import annotations

import hashlib
import os
import threading

_CHUNK = 1 << 22
_digests: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256: hashed once
_lock = threading.Lock()


def file_digest(path: str) -> str:
    """SHA-256 of a file's bytes (remembered while the file keeps its size and time)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _digests:
            return _digests[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    with _lock:
        _digests[key] = digest
    return digest


def table_manifest(dense_file: str, sparse_folder: str, *, rows: int, dim: int) -> dict:
    """The manifest of one table loaded from ``sparse_folder`` for the model whose dense
    weights are ``dense_file``."""
    parts = {"dense_sha256": file_digest(dense_file),
             "key_sha256": file_digest(os.path.join(sparse_folder, "key")),
             "emb_vector_sha256": file_digest(os.path.join(sparse_folder, "emb_vector"))}
    identity = hashlib.sha256("".join(parts[k] for k in sorted(parts)).encode()).hexdigest()
    return {"identity": identity, "rows": int(rows), "dim": int(dim), **parts,
            "dense_file": os.path.abspath(dense_file),
            "sparse_file": os.path.abspath(sparse_folder)}


def short(identity: str | None) -> str:
    return "none" if not identity else identity[:12]


def mismatch(stored: dict | None, expected: dict) -> str | None:
    """None when ``stored`` is ``expected``'s manifest; else why not, in words."""
    if stored is None:
        return ("holds rows but no manifest: it was never loaded completely (a load stopped "
                "half way, or another program wrote it)")
    if stored.get("identity") != expected["identity"]:
        return (f"holds export {short(stored.get('identity'))} (from "
                f"{stored.get('sparse_file', '?')}), but the model files give export "
                f"{short(expected['identity'])}")
    if stored.get("dim") != expected["dim"]:
        return f"holds vectors of size {stored.get('dim')}, the model has {expected['dim']}"
    return None
