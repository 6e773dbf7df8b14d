"""HugeCTR-style model files and the non-trainable (BatchNorm) JSON.

Byte layouts (all little endian):

* **dense model file**: the trainable weights of the dense layers concatenated as float32, in the
  order of the layers in the config, each layer's arrays in this order:
  InnerProduct / FusedInnerProduct: kernel ``[in, out]`` row-major, then bias ``[out]`` (if any);
  BatchNorm: gamma ``[n]``, beta ``[n]``; Multiply: weight ``[slots, dim]``;
  MultiCross: for each cross layer ``i``: ``w_i [n]`` then ``b_i [n]``.
  Layers without weights contribute nothing. No header: the file size must match exactly.
* **sparse model** (one per embedding): a folder ``<name>.model`` holding ``key`` (int64 [n]) and
  ``emb_vector`` (float32 [n, dim], row i belongs to key i).
* **non-trainable JSON**: ``{"layers": [{"type": "BatchNorm", "mean": [...], "var": [...]}, ...]}``
  with one entry per BatchNorm layer in config order.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jctr.checkpoint.integrity import check_files, note_written
from jctr.errors import UserError
from jctr.models import layers as L
from jctr.ops.host_sort import first_repeat
from jctr.runtime.direct_io import DirectWriter, replacing, write_file
from jctr.runtime.host_memory import room_left
from jctr.sharding.mesh import to_host
from jctr.sharding.rows import export_keys, export_placed, import_placed

if TYPE_CHECKING:
    from jctr.models.ctr import StepConfig, TrainState


class ModelFileError(UserError, ValueError):
    """A model file does not match the model; the message names the file and what differs."""


def _weight_slots(net) -> list[tuple[object, str, tuple[int, ...], int | None]]:
    """(module, attribute, shape, index along axis 0 or None) in file order: each layer lists
    its own (:meth:`jctr.models.layers.Layer.file_weights`)."""
    out = []
    for mod in net.layers:
        for attr, i in mod.file_weights():
            shape = getattr(mod, attr)[...].shape
            out.append((mod, attr, shape if i is None else shape[1:], i))
    return out


def dense_weights(net) -> np.ndarray:
    """All trainable dense weights as one float32 vector in file order."""
    parts = []
    for mod, attr, _, i in _weight_slots(net):
        arr = np.asarray(getattr(mod, attr)[...], np.float32)
        parts.append((arr[i] if i is not None else arr).ravel())
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def write_dense_model(path: str, net) -> None:
    _atomic_write(path, dense_weights(net).astype("<f4").tobytes())


def load_dense_model(path: str, net) -> None:
    """Set ``net``'s trainable weights from a dense model file (in place)."""
    _check_in_bundle(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read dense model file: {e.strerror}") from e
    set_dense_weights(data, net, path)


def set_dense_weights(data: bytes, net, where: str) -> None:
    """Set ``net``'s trainable weights from a dense model file's bytes (in place); ``where``
    names them in errors."""
    slots = _weight_slots(net)
    expected = sum(int(np.prod(shape)) for _, _, shape, _ in slots)
    if len(data) != 4 * expected:
        raise ModelFileError(f"{where}: dense model file holds {len(data)} bytes; "
                             f"this network's weights need {4 * expected} "
                             f"({expected} float32 in layer order)")
    flat = np.frombuffer(data, dtype="<f4")
    bad = np.flatnonzero(~np.isfinite(flat))
    if bad.size:
        raise ModelFileError(f"{where}: {bad.size} non-finite weight(s) (NaN or infinity), the "
                             f"first at float {int(bad[0])}; a model with them predicts NaN: "
                             "export it again from a sound checkpoint")
    pos = 0
    for mod, attr, shape, i in slots:
        size = int(np.prod(shape))
        chunk = jnp.asarray(flat[pos:pos + size].reshape(shape))
        pos += size
        var = getattr(mod, attr)
        var[...] = chunk if i is None else var[...].at[i].set(chunk)


def dense_from_bytes(graphdef, params, batch_stats, dense: bytes,
                     non_trainable_json: str | None = None, *, where: str = "dense weights"):
    """New (params, batch_stats) from a dense model file's bytes (and the BatchNorm JSON, if
    given), checked like the files; only the dense network is touched and ``params`` /
    ``batch_stats`` are left as they were (serving swaps the result in).

    Example::

        params, stats = dense_from_bytes(step_config.graphdef, params, stats, payload)
    """
    net = nnx.merge(graphdef, params, batch_stats, copy=True)
    set_dense_weights(dense, net, where)
    if non_trainable_json:
        set_non_trainable(non_trainable_json, net, where)
    _, new_params, new_stats = nnx.split(net, nnx.Param, ...)
    return new_params, new_stats


def write_sparse_model(path: str, keys: np.ndarray, vectors: np.ndarray,
                       slots: np.ndarray | None = None) -> None:
    """Write one embedding's ``key`` and ``emb_vector`` files into the folder ``path``, and
    with ``slots`` a ``slot_id`` file (int64 per key, as HugeCTR's LocalizedSlot models).
    ``keys`` or ``vectors`` that are read-only maps of a whole file holding exactly the bytes
    the model file needs (a checkpoint's rows: :func:`jctr.checkpoint.manager.read_rows`)
    become a hard link to it, not a copy; where linking fails, the bytes are written."""
    os.makedirs(path, exist_ok=True)
    _link_or_write(os.path.join(path, "key"), keys, "<i8")
    _link_or_write(os.path.join(path, "emb_vector"), vectors, "<f4")
    if slots is not None:
        _atomic_write(os.path.join(path, "slot_id"), _le_bytes(slots, "<i8"))


def write_sparse_model_parts(path: str, parts: Iterable[dict[str, np.ndarray]]) -> int:
    """:func:`write_sparse_model` of rows that come a part at a time (dicts with ``keys``
    and ``values``: e.g. a pass over a table larger than memory), the ``key`` and
    ``emb_vector`` files written part after part; no part is held after its write. Returns
    the key count."""
    os.makedirs(path, exist_ok=True)
    kp, vp = os.path.join(path, "key"), os.path.join(path, "emb_vector")
    n = 0
    with replacing(kp) as kt, replacing(vp) as vt:
        with DirectWriter(kt, checksum=True) as kf, DirectWriter(vt, checksum=True) as vf:
            for part in parts:
                kf.write(_le_bytes(part["keys"], "<i8"))
                vf.write(_le_bytes(part["values"], "<f4"))
                n += int(part["keys"].shape[0])
        digests = ((kp, kf.tell(), kf.crc), (vp, vf.tell(), vf.crc))
    for written in digests:  # a bundle's manifest records them without reading them back
        note_written(*written)
    return n


def read_slot_ids(path: str, num_keys: int) -> np.ndarray | None:
    """The ``slot_id`` file of a sparse model folder (None when absent)."""
    sp = os.path.join(path, "slot_id")
    if not os.path.isfile(sp):
        return None
    if os.path.getsize(sp) != 8 * num_keys:
        raise ModelFileError(f"{sp}: holds {os.path.getsize(sp)} bytes; {num_keys} keys need "
                             f"{8 * num_keys} (one int64 slot id per key)")
    return np.fromfile(sp, dtype="<i8").astype(np.int32)


def read_sparse_model(path: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys [n], vectors [n, dim]) of a sparse model folder, checked against each other, and
    against the checksums of the jctr bundle that holds it, if one does."""
    kp, vp, n = _sparse_model_files(path, dim)
    keys = np.fromfile(kp, dtype="<i8")
    vectors = np.fromfile(vp, dtype="<f4").reshape(n, dim)
    _check_finite(vp, keys, vectors)
    _check_unique(kp, keys)
    return keys.astype(np.int64), vectors


def sparse_model_parts(path: str, dim: int, part_rows: int, *, unique: bool = True
                       ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """:func:`read_sparse_model`'s rows, ``part_rows`` at a time and in the files' order, for
    a model larger than memory (the HPS loading it into RocksDB). The sizes and a bundle's
    checksums are checked first, each part's vectors as it is read; with ``unique`` the keys
    are checked for duplicates where three copies of them fit in memory beside the rest (a
    key given twice otherwise keeps its last row, as HugeCTR's loader does).

    Example::

        for keys, vectors in sparse_model_parts("base/sparse/emb.model", 16, 1 << 20):
            store.insert("emb", keys, vectors)
    """
    kp, vp, n = _sparse_model_files(path, dim)
    room = room_left() if unique else None
    if unique and (room is None or 3 * 8 * n <= room):
        _check_unique(kp, np.fromfile(kp, dtype="<i8"))
    part_rows = max(1, int(part_rows))
    with open(kp, "rb") as fk, open(vp, "rb") as fv:
        for s in range(0, n, part_rows):
            m = min(part_rows, n - s)
            keys = np.fromfile(fk, dtype="<i8", count=m)
            vectors = np.fromfile(fv, dtype="<f4", count=m * dim).reshape(m, dim)
            if keys.size != m or vectors.shape[0] != m:
                raise ModelFileError(f"{kp}: shorter than it was a moment ago (changed while "
                                     "it was read)")
            _check_finite(vp, keys, vectors)
            yield keys.astype(np.int64), vectors


def _sparse_model_files(path: str, dim: int) -> tuple[str, str, int]:
    """The ``key`` and ``emb_vector`` files of a sparse model folder and its rows, their sizes
    checked against each other (and a bundle's checksums)."""
    kp, vp = os.path.join(path, "key"), os.path.join(path, "emb_vector")
    for p in (kp, vp):
        if not os.path.isfile(p):
            raise ModelFileError(f"{p}: missing (a sparse model is a folder with `key` and "
                                 "`emb_vector` files)")
    _check_in_bundle(path)
    if os.path.getsize(kp) % 8:
        raise ModelFileError(f"{kp}: size {os.path.getsize(kp)} is not a multiple of 8 "
                             "(int64 keys)")
    n = os.path.getsize(kp) // 8
    want = n * dim * 4
    if os.path.getsize(vp) != want:
        raise ModelFileError(f"{vp}: holds {os.path.getsize(vp)} bytes; {n} keys of "
                             f"embedding_vec_size {dim} need {want}")
    return kp, vp, n


def _check_finite(vp: str, keys: np.ndarray, vectors: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(vectors).all(axis=1))
    if bad.size:
        raise ModelFileError(f"{vp}: {bad.size} row(s) with non-finite values (NaN or "
                             f"infinity), the first of key {int(keys[bad[0]])}; export the "
                             "model again from a sound checkpoint")


def _check_unique(kp: str, keys: np.ndarray) -> None:
    twice = first_repeat(keys)
    if twice is not None:
        raise ModelFileError(f"{kp}: duplicate keys (key {twice}, maybe others)")


def non_trainable(net) -> dict:
    """The non-trainable parameters (BatchNorm running statistics) in HugeCTR's JSON form."""
    layers = []
    for mod in net.layers:
        if isinstance(mod, L.BatchNorm):
            layers.append({"type": "BatchNorm",
                           "mean": [float(v) for v in np.asarray(mod.mean[...])],
                           "var": [float(v) for v in np.asarray(mod.var[...])]})
    return {"layers": layers}


def write_non_trainable(path: str, net) -> None:
    _atomic_write(path, json.dumps(non_trainable(net), indent=1).encode())


def load_non_trainable(path: str, net) -> None:
    """Set ``net``'s BatchNorm statistics from a ``non_trainable`` JSON file (in place)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read non-trainable parameters: {e}") from e
    set_non_trainable(text, net, path)


def set_non_trainable(text: str, net, where: str) -> None:
    """Set ``net``'s BatchNorm statistics from HugeCTR's non-trainable JSON (in place)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{where}: cannot read non-trainable parameters: {e}") from e
    bns = [m for m in net.layers if isinstance(m, L.BatchNorm)]
    entries = data.get("layers", []) if isinstance(data, dict) else []
    if len(entries) != len(bns):
        raise ModelFileError(f"{where}: {len(entries)} BatchNorm entries for {len(bns)} "
                             "BatchNorm layers")
    for i, (mod, entry) in enumerate(zip(bns, entries)):
        n = mod.mean[...].shape[0]
        if len(entry.get("mean", [])) != n or len(entry.get("var", [])) != n:
            raise ModelFileError(f"{where}: layers[{i}]: expected mean and var of length {n}")
        try:
            finite = np.isfinite(np.asarray([entry["mean"], entry["var"]], np.float64)).all()
        except (TypeError, ValueError):
            finite = False
        if not finite:
            raise ModelFileError(f"{where}: layers[{i}]: mean and var must be finite numbers")
        mod.mean[...] = jnp.asarray(entry["mean"], jnp.float32)
        mod.var[...] = jnp.asarray(entry["var"], jnp.float32)


def save_model_files(prefix: str, step_config: StepConfig, state: TrainState,
                     placements=None) -> list[str]:
    """Write a model as HugeCTR does: ``<prefix>dense_<iter>.model``, one
    ``<prefix><embedding>_sparse_<iter>.model`` folder per embedding and
    ``<prefix>non_trainable_<iter>.json``. Every process takes part (tables are gathered);
    process 0 writes. Returns the paths.

    Example::

        save_model_files("models/dlrm_", step_config, state, placements)
    """
    step = int(to_host(state.step))
    paths = [f"{prefix}dense_{step}.model", f"{prefix}non_trainable_{step}.json"]
    paths += [f"{prefix}{spec.name}_sparse_{step}.model" for spec in step_config.specs]
    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(prefix + "x")), exist_ok=True)
    write_model_files(step_config, state, placements, paths[0], paths[1], paths[2:])
    return paths


def host_network(step_config: StepConfig, state: TrainState):
    """The dense network of ``state`` as a concrete NNX module of host arrays (gathered across
    processes if needed)."""
    return nnx.merge(step_config.graphdef, jax.tree.map(to_host, state.params),
                     jax.tree.map(to_host, state.batch_stats))


def write_model_files(step_config: StepConfig, state: TrainState, placements, dense: str,
                      non_trainable_json: str, sparse: list[str], *,
                      slot_ids: bool = True, keys: list[np.ndarray] | None = None,
                      tables: list | None = None) -> list[int]:
    """Write the dense model file, the BatchNorm JSON and one sparse model folder per
    embedding (with ``slot_id`` files unless ``slot_ids`` is False) at the given paths; with
    ``keys`` (one array per embedding) only the rows of those keys the tables hold;
    ``tables`` (stored-table dicts, one per embedding; or a list or iterator of such dicts,
    the table's parts: written one after the other, none held after its write) are written
    instead of the state's. Every process takes part (tables are gathered); process 0
    writes. Returns each table's key count."""
    placements = placements or (None,) * len(step_config.specs)
    if tables is None and keys is None:
        # written here and dropped: views of the state, no copy
        tables = [export_placed(es, p, copy=False) for es, p in zip(state.embeddings, placements)]
    elif tables is None:
        tables = [export_keys(es, k, p) for es, k, p in zip(state.embeddings, keys, placements)]
    if jax.process_index() == 0:
        net = host_network(step_config, state)
        write_dense_model(dense, net)
        write_non_trainable(non_trainable_json, net)
        counts = []
        for path, t in zip(sparse, tables):
            if isinstance(t, dict):
                write_sparse_model(path, t["keys"], t["values"], t["slot"] if slot_ids else None)
                counts.append(int(t["keys"].shape[0]))
            else:  # parts: no slot ids (an inference bundle's tables)
                counts.append(write_sparse_model_parts(path, t))
        return counts
    return [int(t["keys"].shape[0]) if isinstance(t, dict)
            else sum(int(part["keys"].shape[0]) for part in t) for t in tables]


def load_model_files(step_config: StepConfig, state: TrainState, dense: str | None = None,
                     sparse: tuple[str, ...] = (), placements=None,
                     put_dense: Any = None, non_trainable_json: str | None = None,
                     ) -> TrainState:
    """``state`` with weights from HugeCTR-style model files (a warm start: optimizer state
    stays as it is), and with ``non_trainable_json`` the BatchNorm statistics. ``put_dense``
    places the loaded dense arrays (default: the default device); tables go where
    ``placements`` put them.

    Example::

        state = load_model_files(step_config, state, "dense_1000.model",
                                 ("sparse_embedding1_sparse_1000.model",))
    """
    if dense or non_trainable_json:
        net = nnx.merge(step_config.graphdef, state.params, state.batch_stats)
        if dense:
            load_dense_model(dense, net)
        if non_trainable_json:
            load_non_trainable(non_trainable_json, net)
        _, params, stats = nnx.split(net, nnx.Param, ...)
        params, stats = (put_dense or jax.device_put)((params, stats))
        state = state._replace(params=params, batch_stats=stats)
    if sparse:
        specs = step_config.specs
        if len(sparse) != len(specs):
            raise ModelFileError(f"sparse_model_file: {len(sparse)} files for {len(specs)} "
                                 "embeddings (one per embedding, in config order)")
        placements = placements or (None,) * len(specs)
        embs = []
        for spec, es, path, placement in zip(specs, state.embeddings, sparse, placements):
            keys, vectors = read_sparse_model(path, spec.dim)
            stored = {"keys": keys, "values": vectors}
            slots = read_slot_ids(path, keys.size)
            if slots is not None:
                stored["slot"] = slots
            try:
                embs.append(import_placed(spec, es, stored, placement, source=path))
            except ValueError as e:
                raise ModelFileError(str(e)) from e
        state = state._replace(embeddings=tuple(embs))
    return state


def _check_in_bundle(path: str) -> None:
    """A model file or sparse model folder inside a jctr bundle (``<bundle>/dense.model``,
    ``<bundle>/sparse/<name>.model``; a streaming base or delta model among them) is checked
    against the sizes and checksums its manifest recorded; other layouts (HugeCTR's) are read
    as they are."""
    path = os.path.abspath(path)
    for root in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        try:
            with open(os.path.join(root, "manifest.json"), encoding="utf-8") as f:
                files = json.load(f).get("files")
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(files, dict):
            return
        rel = os.path.relpath(path, root)
        if rel in files:
            check_files(root, {rel: files[rel]}, ModelFileError, "bundle")
        else:
            check_files(root, files, ModelFileError, "bundle", only=rel)
        return


def _le_bytes(array, dtype: str) -> np.ndarray:
    """The array's bytes in ``dtype`` (little-endian), as a flat uint8 view: no copy where it
    is one already (a table's rows: hundreds of MB)."""
    return np.ascontiguousarray(array, dtype).reshape(-1).view(np.uint8)


def _mapped_file(array, dtype: str) -> str | None:
    """The file ``array`` maps whole, byte for byte in ``dtype`` (a read-only ``np.memmap``
    from offset 0 to the file's end), or None."""
    name = getattr(array, "filename", None)
    if not (isinstance(array, np.memmap) and name and array.offset == 0
            and array.dtype == np.dtype(dtype) and array.flags.c_contiguous):
        return None
    try:
        return name if os.path.getsize(name) == array.nbytes else None
    except OSError:
        return None


def _link_or_write(path: str, array, dtype: str) -> None:
    """``path`` as a hard link to the file ``array`` maps whole (the same bytes: no copy of
    hundreds of MB), else written from it (:func:`_atomic_write`)."""
    source = _mapped_file(array, dtype)
    if source is not None:
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            os.link(source, tmp)
            os.replace(tmp, path)
            return
        except OSError:  # another file system, links not allowed: the bytes are written
            with contextlib.suppress(OSError):
                os.remove(tmp)
    _atomic_write(path, _le_bytes(array, dtype))


def _atomic_write(path: str, data: bytes | np.ndarray) -> None:
    with replacing(path) as tmp:
        size, crc = write_file(tmp, data)  # synced; a table's vectors past the page cache
    note_written(path, size, crc)  # a bundle's manifest records it without reading it back
