"""The Dataset Feature Specification (NVIDIA DeepLearningExamples) as a jctr data source.

A YAML file with ``feature_spec`` (feature -> dtype, cardinality, ...), ``source_spec`` (mapping,
e.g. ``train`` / ``test`` -> list of chunks ``{type, features, files}``), ``channel_spec``
(``label``, ``numerical``, ``categorical`` -> feature lists) and optional ``metadata``.
Files are relative to the YAML's folder; within a chunk, rows continue from one file to the next.

Chunk types: ``csv`` (no header, one column per chunk feature, in chunk order) and
``split_binary`` (each file a flat little-endian array of the feature dtype; a multi-feature
chunk is row-major ``[rows, features]``). Numerical features are read in ``channel_spec`` order
and must appear in the same order in ``source_spec``; each categorical feature is one one-hot
slot with keys in ``[0, cardinality)`` (jctr adds slot offsets).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import yaml

from jctr.config.schema import DataConfig
from jctr.data.dataset import Dataset
from jctr.data.records import DataError, RecordBlock, check_slot_keys, slot_offsets

CHUNK_TYPES = ("csv", "split_binary")
CHANNELS = ("label", "numerical", "categorical")
UNIT_ROWS = 1 << 18


def numpy_dtype(name: str, where: str) -> np.dtype:
    """``torch.int8``, ``np.float16``, ``int32``, ``bool``... as a little-endian numpy dtype."""
    base = str(name).split(".")[-1]
    try:
        dt = np.dtype(base)
    except TypeError:
        raise DataError(f"{where}: unknown dtype \"{name}\"") from None
    return dt.newbyteorder("<") if dt.itemsize > 1 else dt


@dataclass
class Chunk:
    type: str
    features: list[str]
    files: list[str]


@dataclass
class FeatureSpec:
    """A parsed feature specification (paths already resolved against the YAML's folder)."""

    path: str
    features: dict[str, dict]
    source: dict[str, list[Chunk]]
    channels: dict[str, list[str]]
    metadata: dict

    @property
    def base(self) -> str:
        return os.path.dirname(os.path.abspath(self.path))

    def cardinalities(self, mappings: dict[str, dict[str, np.ndarray]] | None = None
                      ) -> list[int]:
        """Per categorical feature; ``auto`` (or none) is inferred as the largest value + 1
        over every mapping (read here unless given)."""
        out = []
        for f in self.channels.get("categorical", []):
            c = self.features[f].get("cardinality", "auto")
            if c == "auto" or c is None:
                if mappings is None:
                    mappings = {m: read_mapping(self, m) for m in self.source}
                c = max((int(cols[f].max()) + 1 if len(cols[f]) else 1)
                        for cols in mappings.values())
            elif isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise DataError(f"{self.path}: feature_spec.{f}.cardinality: expected a "
                                f"positive integer or auto, got {c!r}")
            out.append(int(c))
        return out


def load_feature_spec(path: str, *, check_files: bool = True) -> FeatureSpec:
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise DataError(f"{path}: cannot read feature specification: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise DataError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise DataError(f"{path}: expected a mapping with feature_spec, source_spec, "
                        "channel_spec")
    for key in ("feature_spec", "source_spec", "channel_spec"):
        if not isinstance(raw.get(key), dict):
            raise DataError(f"{path}: {key}: required mapping is missing")
    unknown_top = set(raw) - {"feature_spec", "source_spec", "channel_spec", "metadata"}
    if unknown_top:
        raise DataError(f"{path}: unknown section \"{sorted(unknown_top)[0]}\"; known: "
                        "feature_spec, source_spec, channel_spec, metadata")
    features = {str(k): (v or {}) for k, v in raw["feature_spec"].items()}
    base = os.path.dirname(os.path.abspath(path))
    channels = {}
    for ch, names in raw["channel_spec"].items():
        if ch not in CHANNELS:
            raise DataError(f"{path}: channel_spec.{ch}: unknown channel; jctr reads "
                            + ", ".join(CHANNELS))
        names = list(names or [])
        for n in names:
            if n not in features:
                raise DataError(f"{path}: channel_spec.{ch}: unknown feature \"{n}\" (not in "
                                "feature_spec)")
        channels[ch] = names
    if len(channels.get("label", [])) < 1:
        raise DataError(f"{path}: channel_spec.label: expected at least one feature")
    source = {}
    for mapping, chunks in raw["source_spec"].items():
        out = []
        for i, c in enumerate(chunks or []):
            where = f"{path}: source_spec.{mapping}[{i}]"
            if not isinstance(c, dict):
                raise DataError(f"{where}: expected a chunk with type, features, files")
            if c.get("type") not in CHUNK_TYPES:
                raise DataError(f"{where}.type: chunk type {c.get('type')!r} cannot be read; "
                                "expected csv or split_binary")
            feats = list(c.get("features") or [])
            for fname in feats:
                if fname not in features:
                    raise DataError(f"{where}.features: unknown feature \"{fname}\"")
            files = [os.path.join(base, f) for f in (c.get("files") or [])]
            if not files:
                raise DataError(f"{where}.files: no file listed")
            if check_files:
                for f in files:
                    if not os.path.isfile(f):
                        raise DataError(f"{where}.files: \"{os.path.relpath(f, base)}\" does "
                                        f"not exist (relative to {base})")
            out.append(Chunk(c["type"], feats, files))
        source[str(mapping)] = out
    spec = FeatureSpec(path, features, source, channels, raw.get("metadata") or {})
    # numerical order must agree between channel_spec and source_spec
    for mapping, chunks in source.items():
        in_source = [f for c in chunks for f in c.features if f in channels.get("numerical", [])]
        want = channels.get("numerical", [])
        if [f for f in in_source if f in want] != want[:len(in_source)] or \
                sorted(in_source) != sorted(want):
            raise DataError(f"{path}: source_spec.{mapping}: numerical features must appear "
                            f"once each, in channel_spec order {want}; found {in_source}")
    return spec


def _read_csv(path: str, names: list[str], dtypes: list[np.dtype]) -> dict[str, np.ndarray]:
    types = {n: (pa.float64() if dt.kind == "f" else pa.int64()) for n, dt in zip(names, dtypes)}
    try:
        table = pacsv.read_csv(path, read_options=pacsv.ReadOptions(column_names=names),
                               convert_options=pacsv.ConvertOptions(column_types=types))
    except pa.ArrowInvalid as e:
        row = _first_bad_row(path, len(names))
        where = f"row {row}: expected {len(names)} fields ({', '.join(names)}); " \
            if row is not None else ""
        raise DataError(f"{path}: {where}{e}") from e
    out = {}
    for n in names:
        col = table.column(n)
        if col.null_count:
            row = int(np.argmax(np.asarray(col.is_null())))
            raise DataError(f"{path}: row {row}: field \"{n}\" is empty")
        out[n] = col.to_numpy()
    return out


def _first_bad_row(path: str, ncols: int, delim: int = ord(",")) -> int | None:
    """The first line whose field count is not ``ncols`` (vectorised over the bytes)."""
    data = np.fromfile(path, np.uint8)
    if data.size == 0:
        return None
    if data[-1] != ord("\n"):
        data = np.append(data, np.uint8(ord("\n")))
    ends = np.nonzero(data == ord("\n"))[0]
    commas = np.concatenate([[0], np.cumsum(data == delim)])
    starts = np.concatenate([[0], ends[:-1] + 1])
    fields = commas[ends] - commas[starts] + 1
    bad = np.nonzero((fields != ncols) & (ends > starts))[0]
    return int(bad[0]) if bad.size else None


def read_mapping(spec: FeatureSpec, mapping: str) -> dict[str, np.ndarray]:
    """Every feature of a mapping as one column array (all rows)."""
    if mapping not in spec.source:
        raise DataError(f"{spec.path}: source_spec has no mapping \"{mapping}\"; it has "
                        f"{sorted(spec.source)}")
    cols: dict[str, np.ndarray] = {}
    for i, chunk in enumerate(spec.source[mapping]):
        dtypes = [numpy_dtype(spec.features[f].get("dtype", "float32"),
                              f"{spec.path}: feature_spec.{f}.dtype") for f in chunk.features]
        parts: dict[str, list[np.ndarray]] = {f: [] for f in chunk.features}
        for path in chunk.files:
            if chunk.type == "csv":
                data = _read_csv(path, chunk.features, dtypes)
            else:
                if len(set(dtypes)) != 1:
                    raise DataError(f"{spec.path}: source_spec.{mapping}[{i}]: a split_binary "
                                    "chunk holds features of one dtype")
                dt = dtypes[0]
                size = os.path.getsize(path)
                row_bytes = dt.itemsize * len(chunk.features)
                if size % row_bytes:
                    raise DataError(f"{path}: size {size} is not a multiple of the row size "
                                    f"{row_bytes} ({len(chunk.features)} x {dt.name})")
                arr = np.fromfile(path, dtype=dt).reshape(-1, len(chunk.features))
                data = {f: arr[:, j] for j, f in enumerate(chunk.features)}
            for f in chunk.features:
                parts[f].append(data[f])
        for f in chunk.features:
            cols[f] = np.concatenate(parts[f])
    lengths = {f: len(v) for f, v in cols.items()}
    if len(set(lengths.values())) > 1:
        raise DataError(f"{spec.path}: source_spec.{mapping}: chunks hold different row counts "
                        f"{sorted(set(lengths.values()))}")
    for ch, names in spec.channels.items():
        for n in names:
            if n not in cols:
                raise DataError(f"{spec.path}: source_spec.{mapping}: feature \"{n}\" of channel "
                                f"{ch} is in no chunk")
    return cols


class FeatureSpecDataset(Dataset):
    """Batches from one mapping of a feature specification; units are ranges of rows.

    The Data layer names the YAML as ``source`` (mapping ``train``) and ``eval_source``
    (mapping ``test``); ``format`` is ``FeatureSpec`` (a jctr extension).
    """

    def __init__(self, path: str, mapping: str, data: DataConfig, **kw):
        super().__init__(data, **kw)
        self.spec = load_feature_spec(path)
        self.mapping = mapping
        ch = self.spec.channels
        for name, got, want in (("label", len(ch.get("label", [])), data.label_dim),
                                ("numerical", len(ch.get("numerical", [])), data.dense_dim),
                                ("categorical", len(ch.get("categorical", [])),
                                 data.total_slots)):
            if got != want:
                raise DataError(f"{path}: channel_spec.{name} has {got} features but the config "
                                f"expects {want}")
        for sp in data.sparse:
            if not sp.one_hot:
                raise DataError(f"{path}: feature-spec data is one-hot; sparse input "
                                f"\"{sp.top}\" must have max_nnz 1")
        self.cards = self.spec.cardinalities()
        self.offsets = slot_offsets(self.cards)
        self._cols: dict[str, np.ndarray] | None = None

    def columns(self) -> dict[str, np.ndarray]:
        if self._cols is None:
            self._cols = read_mapping(self.spec, self.mapping)
        return self._cols

    def num_rows(self) -> int:
        return len(next(iter(self.columns().values())))

    def num_units(self) -> int:
        return max(1, -(-self.num_rows() // UNIT_ROWS))

    def unit_name(self, index: int) -> str:
        return f"{self.spec.path} [{self.mapping}, rows {index * UNIT_ROWS}..]"

    def _read_unit(self, index: int) -> RecordBlock:
        cols = self.columns()
        ch = self.spec.channels
        sl = slice(index * UNIT_ROWS, (index + 1) * UNIT_ROWS)
        label = np.stack([cols[f][sl] for f in ch["label"]], 1).astype(np.float32)
        num = ch.get("numerical", [])
        n = label.shape[0]
        dense = (np.stack([cols[f][sl] for f in num], 1).astype(np.float32) if num
                 else np.zeros((n, 0), np.float32))
        keys = np.stack([cols[f][sl].astype(np.int64) for f in ch["categorical"]], 1)
        check_slot_keys(keys, self.cards, self.unit_name(index), index * UNIT_ROWS)
        keys += self.offsets[None, :]
        return RecordBlock(label, dense, np.ones(keys.shape, np.int32), keys.ravel())


def write_split_binary(out_dir: str, mapping: str, label: np.ndarray, dense: np.ndarray,
                       cats: np.ndarray, cards: list[int]) -> list[dict]:
    """Write one mapping as split binary (the DLRM layout: label bool, numerical float16 in one
    chunk, each categorical its own chunk of the smallest int type) and return its chunks."""
    os.makedirs(os.path.join(out_dir, mapping), exist_ok=True)
    chunks = []

    def put(name, arr, features):
        rel = os.path.join(mapping, name)
        np.ascontiguousarray(arr).tofile(os.path.join(out_dir, rel))
        chunks.append({"type": "split_binary", "features": features, "files": [rel]})

    put("label.bin", label.astype(np.bool_), [f"label_{i}" for i in range(label.shape[1])])
    if dense.shape[1]:
        put("numerical.bin", dense.astype("<f2"),
            [f"num_{i}" for i in range(dense.shape[1])])
    for s in range(cats.shape[1]):
        put(f"cat_{s}.bin", cats[:, s].astype(categorical_dtype(cards[s])), [f"cat_{s}"])
    return chunks


def categorical_dtype(cardinality: int) -> np.dtype:
    for dt in ("<i1", "<i2", "<i4"):
        if cardinality <= np.iinfo(np.dtype(dt)).max + 1:
            return np.dtype(dt)
    return np.dtype("<i8")


def split_binary_spec(label_dim: int, dense_dim: int, cards: list[int],
                      chunks: dict[str, list[dict]]) -> dict:
    """The YAML dict describing split-binary mappings written by :func:`write_split_binary`."""
    features = {f"label_{i}": {"dtype": "bool"} for i in range(label_dim)}
    features.update({f"num_{i}": {"dtype": "float16"} for i in range(dense_dim)})
    features.update({f"cat_{s}": {"dtype": categorical_dtype(c).name, "cardinality": int(c)}
                     for s, c in enumerate(cards)})
    return {"feature_spec": features, "source_spec": chunks,
            "channel_spec": {"label": [f"label_{i}" for i in range(label_dim)],
                             "numerical": [f"num_{i}" for i in range(dense_dim)],
                             "categorical": [f"cat_{s}" for s in range(len(cards))]},
            "metadata": {}}
