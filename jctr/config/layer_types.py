"""Dense layer types of the config, declared once each: the parameters (a frozen dataclass), how
they are read from JSON, and how many bottoms and tops the layer takes. The modules that build
and run them are in :mod:`jctr.models.layers` (one class per type, keyed by the same names).

Adding a layer type: its parameters and parser here plus an entry in :data:`LAYER_TYPES`, its
module in :mod:`jctr.models.layers`, and a test.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from jctr.config.reader import ConfigError, ObjectReader, describe, join_path

LOSS_TYPES = ("BinaryCrossEntropyLoss", "CrossEntropyLoss", "MultiCrossEntropyLoss")


@dataclass(frozen=True)
class FcParam:
    num_output: int
    bias: bool = True


def _fc(r: ObjectReader):
    p = r.child("fc_param")
    out = FcParam(num_output=p.int("num_output", min_value=1), bias=p.bool("bias", True))
    p.finish()
    return out


@dataclass(frozen=True)
class EluParam:
    alpha: float = 1.0


def _elu(r: ObjectReader):
    if not r.has("elu_param"):
        return EluParam()
    p = r.child("elu_param")
    out = EluParam(alpha=p.float("alpha", 1.0))
    p.finish()
    return out


@dataclass(frozen=True)
class DropoutParam:
    rate: float = 0.5


def _dropout(r: ObjectReader):
    return DropoutParam(rate=r.float("rate", 0.5, min_value=0.0, max_value=0.99))


@dataclass(frozen=True)
class BatchNormParam:
    factor: float = 1.0
    eps: float = 1e-5


def _bn(r: ObjectReader):
    if not r.has("bn_param"):
        return BatchNormParam()
    p = r.child("bn_param")
    out = BatchNormParam(factor=p.float("factor", 1.0, min_value=0.0, max_value=1.0),
                         eps=p.float("eps", 1e-5, positive=True))
    p.finish()
    return out


@dataclass(frozen=True)
class ReshapeParam:
    leading_dim: int


def _reshape(r: ObjectReader):
    return ReshapeParam(leading_dim=r.int("leading_dim", min_value=1))


@dataclass(frozen=True)
class SliceParam:
    ranges: tuple[tuple[int, int], ...]


def _slice(r: ObjectReader):
    ranges = r.list("ranges")
    out = []
    for i, rg in enumerate(ranges):
        if (not isinstance(rg, list) or len(rg) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in rg)
                or not 0 <= rg[0] < rg[1]):
            raise ConfigError(join_path(join_path(r.path, "ranges"), i),
                              f"expected [begin, end) with 0 <= begin < end, got {describe(rg)}",
                              r.source)
        out.append((rg[0], rg[1]))
    if not out:
        raise r.error("ranges", "expected at least one range")
    return SliceParam(ranges=tuple(out))


@dataclass(frozen=True)
class MultiplyParam:
    weight_dims: tuple[int, int]


def _multiply(r: ObjectReader):
    dims = r.int_list("weight_dims", min_value=1)
    if len(dims) != 2:
        raise r.error("weight_dims", f"expected [slot_num, vec_size], got {list(dims)}")
    return MultiplyParam(weight_dims=(dims[0], dims[1]))


@dataclass(frozen=True)
class FmOrder2Param:
    out_dim: int


def _fm(r: ObjectReader):
    return FmOrder2Param(out_dim=r.int("out_dim", min_value=1))


@dataclass(frozen=True)
class MultiCrossParam:
    num_layers: int


def _multicross(r: ObjectReader):
    p = r.child("mc_param")
    out = MultiCrossParam(num_layers=p.int("num_layers", min_value=1))
    p.finish()
    return out


@dataclass(frozen=True)
class ReduceSumParam:
    axis: int = 1


def _reduce_sum(r: ObjectReader):
    return ReduceSumParam(axis=r.int("axis", 1, min_value=0))


@dataclass(frozen=True)
class LossParam:
    regularizer: str | None = None  # "L1" or "L2"
    lambda_: float = 0.0
    target_weight: tuple[float, ...] = ()


def _loss(r: ObjectReader):
    reg = r.choice("regularizer", ("L1", "L2"), None)
    lam = r.float("lambda", 1e-4 if reg else 0.0, min_value=0.0)
    target = ()
    if r.has("target_weight"):
        tw = r.list("target_weight")
        if not tw or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                             and math.isfinite(v) for v in tw):
            raise r.error("target_weight", f"expected a list of finite numbers, got "
                          f"{describe(tw)}")
        target = tuple(float(v) for v in tw)
    return LossParam(regularizer=reg, lambda_=lam, target_weight=target)


@dataclass(frozen=True)
class NoParam:
    pass


def _none(r: ObjectReader):
    return NoParam()


class LayerType(NamedTuple):
    """How a dense layer type reads its parameters and how many bottoms and tops it takes."""

    parse: Callable[[ObjectReader], object]
    bottoms: tuple[int, int]  # (min, max)
    tops: int | None  # a count; None: one per Slice range; -1: any number >= 2


LAYER_TYPES: dict[str, LayerType] = {
    "InnerProduct": LayerType(_fc, (1, 1), 1),
    "FusedInnerProduct": LayerType(_fc, (1, 1), 1),
    "ReLU": LayerType(_none, (1, 1), 1),
    "ELU": LayerType(_elu, (1, 1), 1),
    "Dropout": LayerType(_dropout, (1, 1), 1),
    "BatchNorm": LayerType(_bn, (1, 1), 1),
    "Reshape": LayerType(_reshape, (1, 1), 1),
    "Concat": LayerType(_none, (2, 5), 1),
    "Slice": LayerType(_slice, (1, 1), None),
    "Split": LayerType(_none, (1, 1), -1),  # any number >= 2 of copies
    "Multiply": LayerType(_multiply, (1, 1), 1),
    "FmOrder2": LayerType(_fm, (1, 1), 1),
    "MultiCross": LayerType(_multicross, (1, 1), 1),
    "ReduceSum": LayerType(_reduce_sum, (1, 1), 1),
    "Add": LayerType(_none, (2, 16), 1),
    "Interaction": LayerType(_none, (1, 2), 1),  # [dense, embeddings] or embeddings alone
    "BinaryCrossEntropyLoss": LayerType(_loss, (2, 2), 1),
    "CrossEntropyLoss": LayerType(_loss, (2, 2), 1),
    "MultiCrossEntropyLoss": LayerType(_loss, (2, 2), 1),
}
