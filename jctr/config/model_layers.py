"""The classic CTR networks (WDL, DCN, DeepFM, DLRM) as HugeCTR layer lists: plain JSON-ready
dicts, the same that ``scripts/make_configs.py`` writes into the shipped configs and that
:mod:`jctr.models.zoo` turns into NNX modules.

Inputs are named as in HugeCTR's samples: ``label``, ``dense``, ``sparse_embedding1`` (and
``sparse_embedding2`` for the wide / first-order part of WDL and DeepFM).

Example::

    layers = dlrm_layers(dense_dim=13, num_slots=26, embedding_dim=16)
"""

from __future__ import annotations

from collections.abc import Sequence


def _fc(name, bottom, n, fused=False):
    return {"name": name, "type": "FusedInnerProduct" if fused else "InnerProduct",
            "bottom": bottom, "top": name, "fc_param": {"num_output": n}}


def _simple(name, ltype, bottom, **extra):
    return {"name": name, "type": ltype, "bottom": bottom, "top": name, **extra}


def _mlp(prefix: str, bottom: str, sizes: Sequence[int], dropout: float, layers: list) -> str:
    for i, n in enumerate(sizes, 1):
        layers.append(_fc(f"{prefix}fc{i}", bottom, n))
        layers.append(_simple(f"{prefix}relu{i}", "ReLU", f"{prefix}fc{i}"))
        bottom = f"{prefix}relu{i}"
        if dropout:
            layers.append(_simple(f"{prefix}dropout{i}", "Dropout", bottom, rate=dropout))
            bottom = f"{prefix}dropout{i}"
    return bottom


def _loss(bottom: str) -> dict:
    return {"name": "loss", "type": "BinaryCrossEntropyLoss", "bottom": [bottom, "label"],
            "top": "loss"}


def wdl_layers(dense_dim=13, num_slots=26, embedding_dim=16, wide_slots=1,
               hidden=(1024, 1024), dropout=0.5) -> list[dict]:
    layers = [
        _simple("reshape1", "Reshape", "sparse_embedding1", leading_dim=num_slots * embedding_dim),
        _simple("reshape2", "Reshape", "sparse_embedding2", leading_dim=wide_slots),
        _simple("reshape3", "ReduceSum", "reshape2", axis=1),
        {"name": "concat1", "type": "Concat", "bottom": ["reshape1", "dense"], "top": "concat1"},
    ]
    top = _mlp("", "concat1", hidden, dropout, layers)
    layers.append(_fc("fc_out", top, 1))
    layers.append({"name": "add1", "type": "Add", "bottom": ["fc_out", "reshape3"],
                   "top": "add1"})
    layers.append(_loss("add1"))
    return layers


def dcn_layers(dense_dim=13, num_slots=26, embedding_dim=16, cross_layers=6,
               hidden=(1024, 1024), dropout=0.5) -> list[dict]:
    width = num_slots * embedding_dim + dense_dim
    layers = [
        _simple("reshape1", "Reshape", "sparse_embedding1", leading_dim=num_slots * embedding_dim),
        {"name": "concat1", "type": "Concat", "bottom": ["reshape1", "dense"], "top": "concat1"},
        {"name": "slice1", "type": "Slice", "bottom": "concat1",
         "ranges": [[0, width], [0, width]], "top": ["slice11", "slice12"]},
        {"name": "multicross1", "type": "MultiCross", "bottom": "slice11", "top": "multicross1",
         "mc_param": {"num_layers": cross_layers}},
    ]
    top = _mlp("", "slice12", hidden, dropout, layers)
    layers.append({"name": "concat2", "type": "Concat", "bottom": [top, "multicross1"],
                   "top": "concat2"})
    layers.append(_fc("fc_out", "concat2", 1))
    layers.append(_loss("fc_out"))
    return layers


def deepfm_layers(dense_dim=13, num_slots=26, embedding_dim=10, hidden=(400, 400, 400),
                  dropout=0.5) -> list[dict]:
    width = (num_slots + dense_dim) * embedding_dim
    # dense features get embeddings of their own (multiply1) and a first-order term (fc_dense);
    # without them both go
    layers = [
        _simple("reshape1", "Reshape", "sparse_embedding1", leading_dim=num_slots * embedding_dim),
        *([_simple("multiply1", "Multiply", "dense", weight_dims=[dense_dim, embedding_dim]),
           {"name": "concat1", "type": "Concat", "bottom": ["reshape1", "multiply1"],
            "top": "concat1"}] if dense_dim else []),
        {"name": "slice1", "type": "Slice", "bottom": "concat1" if dense_dim else "reshape1",
         "ranges": [[0, width], [0, width]], "top": ["slice11", "slice12"]},
        _simple("fmorder2", "FmOrder2", "slice12", out_dim=embedding_dim),
        _simple("reducesum1", "ReduceSum", "fmorder2", axis=1),
        _simple("reshape2", "Reshape", "sparse_embedding2", leading_dim=num_slots),
        _simple("reducesum2", "ReduceSum", "reshape2", axis=1),
        *([_fc("fc_dense", "dense", 1)] if dense_dim else []),
    ]
    top = _mlp("", "slice11", hidden, dropout, layers)
    layers.append(_fc("fc_out", top, 1))
    layers.append({"name": "add1", "type": "Add",
                   "bottom": ["fc_out", "reducesum1", "reducesum2",
                              *(["fc_dense"] if dense_dim else [])], "top": "add1"})
    layers.append(_loss("add1"))
    return layers


def dlrm_layers(dense_dim=13, num_slots=26, embedding_dim=16, bottom_mlp=(512, 256, 64, 16),
                top_mlp=(512, 256, 1), dropout: float = 0.0) -> list[dict]:
    """DLRM (HugeCTR's samples); ``dropout`` after each hidden layer of the top MLP."""
    if bottom_mlp[-1] != embedding_dim:
        raise ValueError(f"the bottom MLP must end at embedding_dim {embedding_dim}, "
                         f"got {bottom_mlp[-1]}")
    layers = []
    bottom = "dense"
    for i, n in enumerate(bottom_mlp if dense_dim else (), 1):
        layers.append(_fc(f"bot_fc{i}", bottom, n, fused=True))
        bottom = f"bot_fc{i}"
    # without dense features the interaction runs over the embeddings alone
    inputs = [bottom, "sparse_embedding1"] if dense_dim else ["sparse_embedding1"]
    layers.append({"name": "interaction1", "type": "Interaction", "bottom": inputs,
                   "top": "interaction1"})
    bottom = "interaction1"
    for i, n in enumerate(top_mlp, 1):
        layers.append(_fc(f"top_fc{i}", bottom, n, fused=i < len(top_mlp)))
        bottom = f"top_fc{i}"
        if dropout and i < len(top_mlp):
            layers.append(_simple(f"top_dropout{i}", "Dropout", bottom, rate=dropout))
            bottom = f"top_dropout{i}"
    layers.append(_loss(bottom))
    return layers
