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
from typing import ClassVar, NamedTuple

from jctr.config.reader import ConfigError, ObjectReader, describe, join_path

LOSS_TYPES = ("BinaryCrossEntropyLoss", "CrossEntropyLoss", "MultiCrossEntropyLoss")


# HugeCTR's weight initializers (parser.cpp INITIALIZER_TYPE_MAP); left out, jctr's own
INITIALIZERS = ("Uniform", "XavierNorm", "XavierUniform", "Zero")


def _init(r: ObjectReader, key: str) -> str | None:
    return r.choice(key, INITIALIZERS, None)


@dataclass(frozen=True)
class FcParam:
    json_object: ClassVar[str] = "fc_param"  # the fields sit in this object of the layer

    num_output: int
    """``fc_param``: output width."""
    bias: bool = True
    """``fc_param``: add a bias vector."""
    weight_init: str | None = None
    """``fc_param``: HugeCTR's ``Uniform`` (±1/(in+out)), ``XavierUniform``, ``XavierNorm``
    (truncated) or ``Zero``; left out: Glorot uniform."""
    bias_init: str | None = None
    """``fc_param``: as ``weight_init`` for the bias (fan-in 0, HugeCTR's rule); left out:
    zeros."""


def _fc(r: ObjectReader):
    p = r.child(FcParam.json_object)
    out = FcParam(num_output=p.int("num_output", min_value=1), bias=p.bool("bias", True),
                  weight_init=_init(p, "weight_init"), bias_init=_init(p, "bias_init"))
    p.finish()
    return out


@dataclass(frozen=True)
class EluParam:
    json_object: ClassVar[str] = "elu_param"  # the fields sit in this object of the layer

    alpha: float = 1.0
    """``elu_param``: the negative-side scale, ``alpha * (exp(x) - 1)`` below 0."""


def _elu(r: ObjectReader):
    if not r.has(EluParam.json_object):
        return EluParam()
    p = r.child(EluParam.json_object)
    out = EluParam(alpha=p.float("alpha", 1.0))
    p.finish()
    return out


@dataclass(frozen=True)
class DropoutParam:
    rate: float = 0.5
    """The fraction of activations dropped in training (0 to 0.99)."""


def _dropout(r: ObjectReader):
    return DropoutParam(rate=r.float("rate", 0.5, min_value=0.0, max_value=0.99))


@dataclass(frozen=True)
class BatchNormParam:
    json_object: ClassVar[str] = "bn_param"  # the fields sit in this object of the layer

    factor: float = 1.0
    """``bn_param``: running statistics become ``(1 - factor) * old + factor * batch``
    (HugeCTR's; PyTorch's momentum 0.1 is factor 0.1)."""
    eps: float = 1e-5
    """``bn_param``: added to the variance."""
    gamma_init: str | None = None
    """``bn_param``: ``Zero``, or any other of HugeCTR's initializers, which give this layer
    its default (ones), as in HugeCTR."""
    beta_init: str | None = None
    """``bn_param``: accepted as in HugeCTR, where every initializer leaves beta at zero."""


def _bn(r: ObjectReader):
    if not r.has(BatchNormParam.json_object):
        return BatchNormParam()
    p = r.child(BatchNormParam.json_object)
    out = BatchNormParam(factor=p.float("factor", 1.0, min_value=0.0, max_value=1.0),
                         eps=p.float("eps", 1e-5, positive=True),
                         gamma_init=_init(p, "gamma_init"), beta_init=_init(p, "beta_init"))
    p.finish()
    return out


@dataclass(frozen=True)
class ReshapeParam:
    leading_dim: int | None = None
    """The width of the output rows (default: a sample's size, ``[batch, slots * vec]``). A
    divisor of a sample's size splits each sample into several rows, ``[batch * k,
    leading_dim]``, as HugeCTR does (DeepFM: ``[batch, 26, 11]`` -> ``[batch * 26, 11]``); it
    must be a multiple of the input's last dimension."""
    selected: tuple[int, ...] | None = None
    """Slots of an embedding output ``[batch, slots, vec]`` to keep, in this order:
    ``[batch, len(selected) * vec]`` (exclusive with ``leading_dim``)."""


def _reshape(r: ObjectReader):
    if r.has("selected"):
        if r.has("leading_dim"):
            raise r.error("selected", "a selective Reshape takes no leading_dim (HugeCTR reads "
                          "one or the other); drop one of them")
        sel = r.int_list("selected", min_value=0)
        if not sel:
            raise r.error("selected", "expected at least one slot index")
        return ReshapeParam(selected=tuple(sel))
    return ReshapeParam(leading_dim=r.int("leading_dim", None, min_value=1))


@dataclass(frozen=True)
class SliceParam:
    ranges: tuple[tuple[int, int], ...]
    """``[[begin, end], ...]`` column ranges of the input, one top each."""


def _slice(r: ObjectReader):
    ranges = r.list("ranges")
    out = []
    for i, rg in enumerate(ranges):
        where = join_path(join_path(r.path, "ranges"), i)
        if (not isinstance(rg, list) or len(rg) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in rg)
                or not 0 <= rg[0] < rg[1]):
            raise ConfigError(where, f"expected [begin, end) with 0 <= begin < end, got "
                              f"{describe(rg)}", r.source)
        # HugeCTR's SliceLayer: ranges in order, none inside an earlier one (equal is fine)
        if out and not (out[-1][0] <= rg[0] and out[-1][1] <= rg[1]):
            raise ConfigError(where, f"{rg} comes before or inside the previous "
                              f"range {list(out[-1])}; HugeCTR takes ranges in order "
                              "(begin and end both non-decreasing)", r.source)
        out.append((rg[0], rg[1]))
    if not out:
        raise r.error("ranges", "expected at least one range")
    if len(out) > 5:
        raise r.error("ranges", f"{len(out)} ranges; HugeCTR's Slice gives at most 5 tops")
    return SliceParam(ranges=tuple(out))


@dataclass(frozen=True)
class MultiplyParam:
    weight_dims: tuple[int, int]
    """``[slot_num, vec_size]``: the weight each input column is multiplied with."""
    weight_init: str | None = None
    """One of HugeCTR's initializers (fan-in ``slot_num``, fan-out ``slot_num * vec_size``);
    left out: Glorot uniform."""


def _multiply(r: ObjectReader):
    dims = r.int_list("weight_dims", min_value=1)
    if len(dims) != 2:
        raise r.error("weight_dims", f"expected [slot_num, vec_size], got {list(dims)}")
    return MultiplyParam(weight_dims=(dims[0], dims[1]), weight_init=_init(r, "weight_init"))


@dataclass(frozen=True)
class FmOrder2Param:
    out_dim: int
    """The width of one field (the embedding size)."""


def _fm(r: ObjectReader):
    return FmOrder2Param(out_dim=r.int("out_dim", min_value=1))


@dataclass(frozen=True)
class MultiCrossParam:
    json_object: ClassVar[str] = "mc_param"  # the fields sit in this object of the layer

    num_layers: int
    """``mc_param``: cross layers."""
    weight_init: str | None = None
    """``mc_param``: ``Zero``, or any other of HugeCTR's initializers, which give this layer its
    default (Xavier uniform), as in HugeCTR; left out: Glorot uniform."""
    bias_init: str | None = None
    """``mc_param``: accepted as in HugeCTR, where every initializer leaves this bias at
    zero."""


def _multicross(r: ObjectReader):
    p = r.child(MultiCrossParam.json_object)
    out = MultiCrossParam(num_layers=p.int("num_layers", min_value=1),
                          weight_init=_init(p, "weight_init"), bias_init=_init(p, "bias_init"))
    p.finish()
    return out


@dataclass(frozen=True)
class ReduceSumParam:
    axis: int = 1
    """The axis summed (0 is the batch), kept with size 1."""


def _reduce_sum(r: ObjectReader):
    return ReduceSumParam(axis=r.int("axis", 1, min_value=0))


@dataclass(frozen=True)
class LossParam:
    regularizer: str | None = None
    """``L1`` or ``L2`` on the fully connected weights: ``lambda * sum(abs(w)) / batch`` or
    ``lambda/2 * sum(w^2) / batch`` joins the loss."""
    lambda_: float = 0.0
    """``lambda``: the regularization strength (1e-4 when ``regularizer`` is set)."""
    target_weight: tuple[float, ...] = ()
    """MultiCrossEntropyLoss: one weight per label column."""


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
    params: type  # the parameters' dataclass (what ``parse`` returns)
    bottoms: tuple[int, int]  # (min, max)
    tops: int | None  # a count; None: one per Slice range; -1: any number >= 2
    doc: str  # what it computes (the config reference prints it)


LAYER_TYPES: dict[str, LayerType] = {
    "InnerProduct": LayerType(_fc, FcParam, (1, 1), 1, "fully connected, ``x @ W + b``"),
    "FusedInnerProduct": LayerType(_fc, FcParam, (1, 1), 1, "fully connected followed by ReLU"),
    "ReLU": LayerType(_none, NoParam, (1, 1), 1, "``max(x, 0)``"),
    "ELU": LayerType(_elu, EluParam, (1, 1), 1, "exponential linear unit"),
    "Dropout": LayerType(_dropout, DropoutParam, (1, 1), 1,
                         "inverted dropout in training, the identity in evaluation"),
    "BatchNorm": LayerType(_bn, BatchNormParam, (1, 1), 1,
                           "batch normalization over the batch axis (padding samples left "
                           "out); running statistics are saved as non-trainable JSON"),
    "Reshape": LayerType(_reshape, ReshapeParam, (1, 1), 1,
                         "rows of ``leading_dim`` values: ``[batch, leading_dim]`` (a sample "
                         "per row) or ``[batch * k, leading_dim]`` (k rows per sample); or the "
                         "``selected`` slots of an embedding output"),
    "Concat": LayerType(_none, NoParam, (2, 5), 1,
                        "joins 2-D inputs on the feature axis, 3-D inputs on the slot axis"),
    "Slice": LayerType(_slice, SliceParam, (1, 1), None,
                       "column ranges of the input, one top per range"),
    "Split": LayerType(_none, NoParam, (1, 1), -1, "copies the input to every top (two or more)"),
    "Multiply": LayerType(_multiply, MultiplyParam, (1, 1), 1,
                          "``[batch, slots]`` times a weight ``[slots, vec]`` row by row, "
                          "flattened to ``[batch, slots * vec]`` (DeepFM's dense embeddings)"),
    # HugeCTR 3.x's name of the same layer
    "WeightMultiply": LayerType(_multiply, MultiplyParam, (1, 1), 1,
                                "HugeCTR 3.x's name of ``Multiply``"),
    "FmOrder2": LayerType(_fm, FmOrder2Param, (1, 1), 1,
                          "the second-order factorization-machine term "
                          "``0.5 * ((sum v)^2 - sum v^2)``: ``[batch, fields * out_dim]`` to "
                          "``[batch, out_dim]``"),
    "MultiCross": LayerType(_multicross, MultiCrossParam, (1, 1), 1,
                            "DCN cross network, ``x_{l+1} = x_0 * (x_l . w_l) + b_l + x_l``"),
    "ReduceSum": LayerType(_reduce_sum, ReduceSumParam, (1, 1), 1,
                           "sum over ``axis``, kept with size 1"),
    "Add": LayerType(_none, NoParam, (2, 16), 1, "elementwise sum of inputs of one shape"),
    "DotProduct": LayerType(_none, NoParam, (2, 16), 1,
                            "elementwise product of inputs of one shape"),
    # [dense, embeddings] or embeddings alone
    "Interaction": LayerType(_none, NoParam, (1, 2), 1,
                             "DLRM dot interaction of ``[dense, embeddings]`` (or the "
                             "embeddings alone): the dense vector, the pairwise dots and one "
                             "zero pad column"),
    "BinaryCrossEntropyLoss": LayerType(_loss, LossParam, (2, 2), 1,
                                        "sigmoid cross-entropy of ``[batch, 1]`` logits "
                                        "against the label"),
    "CrossEntropyLoss": LayerType(_loss, LossParam, (2, 2), 1,
                                  "two-class softmax cross-entropy; the label holds the class "
                                  "index"),
    "MultiCrossEntropyLoss": LayerType(_loss, LossParam, (2, 2), 1,
                                       "sigmoid cross-entropy per label column, weighted by "
                                       "``target_weight``"),
}
