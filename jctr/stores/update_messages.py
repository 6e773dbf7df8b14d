"""The binary layout of online model updates (training publishes them to Kafka, the HPS applies
them). Never pickle: a fixed header and little-endian arrays.

One message is one table's rows, one table's erased keys, or one model's dense weights::

    offset  size  field
    0       8     magic b"JCTRUPD1"
    8       1     kind: 1 embedding rows, 2 dense weights, 3 erased keys
    9       1     reserved (0)
    10      2     model name length M (uint16)
    12      2     table name length T (uint16; 0 for dense weights)
    14      2     rows: 0; dense weights: the number of parts P
    16      8     step: the training iteration the values are from (int64)
    24      4     rows N (uint32; dense weights: this part's index, 0..P-1)
    28      4     vector size D (uint32; dense weights: bytes of the dense model file;
                  erased keys: 0)
    32      M     model name (UTF-8)
    32+M    T     table name (UTF-8)
    then    8N    keys (int64)            | dense: this part's bytes of the dense model file
                  (erased keys: nothing more)
            4ND   vectors (float32 [N,D]) | (the parts in order make D bytes); the last part
                                          | ends with the BatchNorm JSON (UTF-8)

Dense weights larger than one message travel in P consecutive messages of the same step.
Erased keys are keys the trained table no longer holds (the streaming shrink deleted them, or
an evicting table evicted them without spilling): a server forgets their rows, in the order
the messages of the table's topic come (a later row of a key brings it back).

Example::

    data = encode_rows("dlrm", "sparse_embedding1", step, keys, vectors)
    msg = decode(data)      # Update(kind="rows", model=..., table=..., keys=..., values=...)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"JCTRUPD1"
ROWS, DENSE, ERASE = 1, 2, 3
_HEADER = struct.Struct("<8sBBHHHqII")


class MessageError(ValueError):
    """A message that is not a jctr update (the text says what is wrong)."""


@dataclass(frozen=True)
class Update:
    kind: str  # "rows", "erase", "dense" (whole) or "dense_part" (see join_dense)
    model: str
    table: str
    step: int
    keys: np.ndarray | None = None
    values: np.ndarray | None = None
    dense: bytes = b""
    non_trainable: str = ""
    part: int = 0
    parts: int = 1
    dense_bytes: int = 0


def _names(model: str, table: str) -> tuple[bytes, bytes]:
    m, t = model.encode(), table.encode()
    if len(m) > 0xFFFF or len(t) > 0xFFFF:
        raise MessageError("model or table name longer than 65535 bytes")
    return m, t


def encode_rows(model: str, table: str, step: int, keys: np.ndarray,
                values: np.ndarray) -> bytes:
    """One message of embedding rows (``keys`` int64 [N], ``values`` float32 [N, D])."""
    keys = np.ascontiguousarray(keys, "<i8")
    values = np.ascontiguousarray(values, "<f4")
    if values.ndim != 2 or values.shape[0] != keys.size:
        raise MessageError(f"values {values.shape} do not match {keys.size} keys")
    m, t = _names(model, table)
    head = _HEADER.pack(MAGIC, ROWS, 0, len(m), len(t), 0, int(step), keys.size,
                        values.shape[1])
    return b"".join((head, m, t, keys.tobytes(), values.tobytes()))


def encode_erase(model: str, table: str, step: int, keys: np.ndarray) -> bytes:
    """One message of keys ``table`` no longer holds (int64 [N])."""
    keys = np.ascontiguousarray(keys, "<i8")
    m, t = _names(model, table)
    head = _HEADER.pack(MAGIC, ERASE, 0, len(m), len(t), 0, int(step), keys.size, 0)
    return b"".join((head, m, t, keys.tobytes()))


def encode_dense(model: str, step: int, dense: bytes, non_trainable: str, *,
                 max_bytes: int = 1 << 30) -> list[bytes]:
    """The messages of dense weights (the dense model file's bytes and the BatchNorm JSON),
    each at most about ``max_bytes``."""
    m, _ = _names(model, "")
    nt = non_trainable.encode()
    room = max(max_bytes - _HEADER.size - len(m), 1024)
    chunks = [dense[s:s + room] for s in range(0, len(dense), room)] or [b""]
    if len(chunks) > 0xFFFF:
        raise MessageError(f"dense weights of {len(dense)} bytes need more than 65535 parts")
    out = []
    for i, chunk in enumerate(chunks):
        head = _HEADER.pack(MAGIC, DENSE, 0, len(m), 0, len(chunks), int(step), i, len(dense))
        out.append(b"".join((head, m, chunk, nt if i == len(chunks) - 1 else b"")))
    return out


def join_dense(parts: list[Update]) -> Update:
    """One dense update from its parts (in order); :class:`MessageError` if they do not add
    up."""
    data = b"".join(p.dense for p in parts)
    last = parts[-1]
    if len(data) < last.dense_bytes or [p.part for p in parts] != list(range(last.parts)):
        raise MessageError(f"{last.model}: dense parts of step {last.step} do not add up")
    try:
        nt = data[last.dense_bytes:].decode()
    except UnicodeDecodeError:
        raise MessageError(f"{last.model}: BatchNorm JSON is not UTF-8") from None
    return Update("dense", last.model, "", last.step, dense=data[:last.dense_bytes],
                  non_trainable=nt)


def decode(data: bytes) -> Update:
    """The :class:`Update` of one message; :class:`MessageError` if it is not one."""
    if len(data) < _HEADER.size or data[:8] != MAGIC:
        raise MessageError("not a jctr update message (no JCTRUPD1 header)")
    _, kind, _, lm, lt, nparts, step, n, d = _HEADER.unpack_from(data)
    at = _HEADER.size
    try:
        model = data[at:at + lm].decode()
        table = data[at + lm:at + lm + lt].decode()
    except UnicodeDecodeError:
        raise MessageError("model or table name is not UTF-8") from None
    at += lm + lt
    if kind == ROWS:
        need = at + 8 * n + 4 * n * d
        if len(data) != need:
            raise MessageError(f"{model}/{table}: {len(data)} bytes, {n} rows of {d} need "
                               f"{need}")
        # views of the message's bytes (read-only; converted only on a big-endian host):
        # the consumer gathers a poll's messages into one array anyway, and a copy here
        # was one more pass over every row on the serving path
        keys = np.frombuffer(data, "<i8", n, at).astype(np.int64, copy=False)
        values = np.frombuffer(data, "<f4", n * d, at + 8 * n).reshape(n, d).astype(
            np.float32, copy=False)
        return Update("rows", model, table, step, keys, values)
    if kind == ERASE:
        if d != 0 or len(data) != at + 8 * n:
            raise MessageError(f"{model}/{table}: {len(data)} bytes of erased keys, {n} keys "
                               f"need {at + 8 * n}")
        return Update("erase", model, table, step, np.frombuffer(data, "<i8", n, at)
                      .astype(np.int64))
    if kind == DENSE:
        if nparts < 1 or n >= nparts:
            raise MessageError(f"{model}: dense part {n} of {nparts}")
        if nparts == 1:
            if len(data) < at + d:
                raise MessageError(f"{model}: dense message shorter than its {d} weight bytes")
            body, nt_bytes = data[at:at + d], data[at + d:]
        else:  # a part: its bytes (the last one ends with the JSON; join_dense splits)
            return Update("dense_part", model, "", step, dense=bytes(data[at:]), part=n,
                          parts=nparts, dense_bytes=d)
        try:
            nt = nt_bytes.decode()
        except UnicodeDecodeError:
            raise MessageError(f"{model}: BatchNorm JSON is not UTF-8") from None
        return Update("dense", model, "", step, dense=bytes(body), non_trainable=nt)
    raise MessageError(f"unknown message kind {kind}")


def rows_per_message(dim: int, send_buffer_size: int) -> int:
    """How many rows of size ``dim`` fit one message of at most ``send_buffer_size`` bytes
    (``dim`` 0: erased keys)."""
    return max(1, (send_buffer_size - _HEADER.size - 512) // (8 + 4 * dim))
