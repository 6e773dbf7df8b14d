"""HugeCTR's own configs train unchanged: each case below is a config written here, in the
project's words, of the kind HugeCTR's v2.3 samples hold (``samples/*/*.json``,
``test/utest/simple_sparse_embedding_*.json``); the reference for each semantic is HugeCTR's
source at v2.3 (commit 65fa241), named in each test."""

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jctr.config import ConfigError, parse_config
from jctr.data.parquet import write_parquet_dataset
from jctr.data.raw import write_raw_file
from jctr.data.tools.synthetic import generate_block
from jctr.embedding.sparse_embedding import EmbeddingSpec
from jctr.models import build_network
from jctr.models import layers as L
from jctr.sharding.plan import MemoryPlan, PlanError
from jctr.train.trainer import Trainer
from tests.conftest import ROOT

SLOT_SIZES = [30, 7, 120, 3, 55, 9]


def _solver(**kw):
    return {"lr_policy": "fixed", "display": 1, "max_iter": 2, "gpu": [0], "batchsize": 64,
            "batchsize_eval": 64, "snapshot": 0, "eval_interval": 2, "eval_batches": 1, **kw}


def _deepfm_layers(vec: int = 11, slots: int = 26, dense: int = 13) -> list[dict]:
    """The dense graph of HugeCTR's samples/deepfm/deepfm.json: the embedding [batch, 26, 11]
    split by Reshape(leading_dim 11) into rows of one slot, Slice into the 10 FM dimensions and
    the first-order one, Reshape back to 260 and 26 per sample."""
    fm = vec - 1
    return [
        {"name": "reshape1", "type": "Reshape", "bottom": "emb", "top": "reshape1",
         "leading_dim": vec},
        {"name": "slice1", "type": "Slice", "bottom": "reshape1",
         "ranges": [[0, fm], [fm, vec]], "top": ["slice11", "slice12"]},
        {"name": "reshape2", "type": "Reshape", "bottom": "slice11", "top": "reshape2",
         "leading_dim": slots * fm},
        {"name": "reshape3", "type": "Reshape", "bottom": "slice12", "top": "reshape3",
         "leading_dim": slots},
        {"name": "slice2", "type": "Slice", "bottom": "dense", "ranges": [[0, dense], [0, dense]],
         "top": ["slice21", "slice22"]},
        {"name": "multiply1", "type": "Multiply", "bottom": "slice21", "weight_dims": [dense, fm],
         "top": "multiply1"},
        {"name": "multiply2", "type": "Multiply", "bottom": "slice22", "weight_dims": [dense, 1],
         "top": "multiply2"},
        {"name": "concat1", "type": "Concat", "bottom": ["reshape2", "multiply1"],
         "top": "concat1"},
        {"name": "slice3", "type": "Slice", "bottom": "concat1",
         "ranges": [[0, (slots + dense) * fm], [0, (slots + dense) * fm]],
         "top": ["slice31", "slice32"]},
        {"name": "fc1", "type": "InnerProduct", "bottom": "slice31", "top": "fc1",
         "fc_param": {"num_output": 8}},
        {"name": "relu1", "type": "ReLU", "bottom": "fc1", "top": "relu1"},
        {"name": "fc4", "type": "InnerProduct", "bottom": "relu1", "top": "fc4",
         "fc_param": {"num_output": 1}},
        {"name": "fmorder2", "type": "FmOrder2", "bottom": "slice32", "out_dim": fm,
         "top": "fmorder2"},
        {"name": "reducesum1", "type": "ReduceSum", "bottom": "fmorder2", "axis": 1,
         "top": "reducesum1"},
        {"name": "concat2", "type": "Concat", "bottom": ["reshape3", "multiply2"],
         "top": "concat2"},
        {"name": "reducesum2", "type": "ReduceSum", "bottom": "concat2", "axis": 1,
         "top": "reducesum2"},
        {"name": "add", "type": "Add", "bottom": ["fc4", "reducesum1", "reducesum2"],
         "top": "add"},
        {"name": "loss", "type": "BinaryCrossEntropyLoss", "bottom": ["add", "label"],
         "top": "loss"},
    ]


def _config(tmp_path, layers, *, slots=26, vec=11, data=None, emb=None, solver=None) -> dict:
    d = {"name": "data", "type": "Data", "source": str(tmp_path / "train" / "_file_list.txt"),
         "eval_source": str(tmp_path / "eval" / "_file_list.txt"), "check": "None",
         "label": {"top": "label", "label_dim": 1}, "dense": {"top": "dense", "dense_dim": 13},
         "sparse": [{"top": "data1", "type": "DistributedSlot",
                     "max_feature_num_per_sample": 30, "slot_num": slots}],
         "synthetic": {"num_samples": 256, "eval_num_samples": 128, "vocabulary_size": 500}}
    d.update(data or {})
    e = {"name": "sparse_embedding1", "type": "DistributedSlotSparseEmbeddingHash",
         "bottom": "data1", "top": "emb",
         "sparse_embedding_hparam": {"max_vocabulary_size_per_gpu": 20000,
                                     "embedding_vec_size": vec, "combiner": 0}}
    e.update(emb or {})
    return {"solver": _solver(**(solver or {})),
            "optimizer": {"type": "Adam", "update_type": "Global",
                          "adam_hparam": {"learning_rate": 0.001}},
            "layers": [d, e, *layers]}


# ---- Reshape with a leading_dim smaller than a sample (DeepFM) --------------------------------


def test_deepfm_reshape_slice_graph_equals_its_formula_and_gradients(tmp_path):
    """HugeCTR ``reshape_layer.cu`` (ReshapeLayer: output ``[elements / leading_dim,
    leading_dim]``) and ``slice_layer.cu`` (SliceLayer: column ranges of a 2-D tensor): the
    DeepFM graph of samples/deepfm/deepfm.json equals the model written out by hand, forward
    and gradient with respect to the embeddings."""
    cfg = parse_config(_config(tmp_path, _deepfm_layers()))
    net = build_network(cfg, nnx.Rngs(0))
    assert net.shapes["reshape1"] == (26, 11) and isinstance(net.shapes["reshape1"], L.Rows)
    assert L.fmt_shape(net.shapes["reshape1"]) == "[batch*26, 11]"
    assert net.shapes["reshape2"] == (260,) and net.shapes["reshape3"] == (26,)
    rng = np.random.default_rng(0)
    b = 5
    emb = jnp.asarray(rng.normal(size=(b, 26, 11)).astype(np.float32))
    dense = jnp.asarray(rng.normal(size=(b, 13)).astype(np.float32))
    label = jnp.asarray(rng.integers(0, 2, (b, 1)).astype(np.float32))
    ctx = L.Context(False, None, jnp.ones(b, jnp.float32))
    mods = {name: mod for name, mod in zip([ly.name for ly in cfg.layers], net.layers)}
    w1 = mods["multiply1"].weight[...]
    w2 = mods["multiply2"].weight[...]
    fc1, fc4 = mods["fc1"], mods["fc4"]

    def by_graph(e):
        return net({"emb": e, "dense": dense, "label": label}, ctx)[0]

    def by_hand(e):
        v = e[:, :, :10]  # the FM dimensions of each slot
        first = e[:, :, 10]  # the first-order weight of each slot
        dense_v = (dense[:, :, None] * w1[None]).reshape(b, -1)  # [b, 130]
        x = jnp.concatenate([v.reshape(b, 260), dense_v], axis=1)  # [b, 390]
        h = jax.nn.relu(x @ fc1.kernel[...] + fc1.bias[...])
        deep = h @ fc4.kernel[...] + fc4.bias[...]
        f = x.reshape(b, 39, 10)
        s = f.sum(1)
        fm = 0.5 * (s * s - (f * f).sum(1)).sum(1, keepdims=True)
        lin = first.sum(1, keepdims=True) + (dense * w2[:, 0]).sum(1, keepdims=True)
        z = (deep + fm + lin)[:, 0]
        y = label[:, 0]
        return jnp.mean(jnp.maximum(z, 0) - z * y + jnp.log1p(jnp.exp(-jnp.abs(z))))

    np.testing.assert_allclose(by_graph(emb), by_hand(emb), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(by_graph)(emb), jax.grad(by_hand)(emb), rtol=1e-4,
                               atol=1e-6)


def test_deepfm_sample_graph_trains(tmp_path):
    """The whole DeepFM config (data, embedding, the graph above) trains two steps."""
    trainer = Trainer(parse_config(_config(tmp_path, _deepfm_layers())))
    trainer.fit()
    assert np.isfinite(trainer.history[-1].get("loss", 0.0))


@pytest.mark.parametrize("change, message", [
    # ReshapeLayer: "leading_dim < in_dims[im_idx] or leading_dim % in_dims[2] != 0"
    ({"leading_dim": 5}, r"leading_dim 5 must be a multiple of the input's last dimension 11"),
    ({"leading_dim": 2 * 286}, r"leading_dim 572 must divide a sample.s 286 values"),
    ({"leading_dim": 4 * 11}, r"leading_dim 44 must divide a sample's 286 values"),
    # the selective ReshapeLayer: "selected is invalid" when more slots than the input has
    ({"selected": list(range(27))}, r"selects 27 slots of an input with 26"),
    ({"selected": [0, 26]}, r"selected slot 26 does not exist"),
])
def test_reshape_checks_of_hugectr(tmp_path, change, message):
    layers = _deepfm_layers()
    layers[0] = {k: v for k, v in layers[0].items() if k != "leading_dim"} | change
    cfg = parse_config(_config(tmp_path, layers))
    with pytest.raises(ConfigError, match=r"layers\[2\]: Reshape \"reshape1\": " + message):
        build_network(cfg, nnx.Rngs(0))


def test_selected_slots_and_default_leading_dim(tmp_path):
    """HugeCTR parser.cpp, ``Layer_t::Reshape``: ``selected`` picks slots of an embedding
    output side by side; without ``leading_dim`` a sample becomes one row."""
    rng = np.random.default_rng(1)
    e = rng.normal(size=(4, 26, 11)).astype(np.float32)
    ctx = L.Context(False, None, jnp.ones(4))
    for params, want in (({"selected": [3, 0, 25]}, e[:, [3, 0, 25]].reshape(4, 33)),
                         ({}, e.reshape(4, 286))):
        layers = [{"name": "r", "type": "Reshape", "bottom": "emb", "top": "r", **params},
                  {"name": "fc", "type": "InnerProduct", "bottom": "r", "top": "fc",
                   "fc_param": {"num_output": 1}},
                  {"name": "loss", "type": "BinaryCrossEntropyLoss", "bottom": ["fc", "label"],
                   "top": "loss"}]
        cfg = parse_config(_config(tmp_path, layers))
        net = build_network(cfg, nnx.Rngs(0))
        np.testing.assert_array_equal(net.layers[0]([jnp.asarray(e)], ctx)[0], want)
    with pytest.raises(ConfigError, match="selective Reshape takes no leading_dim"):
        parse_config(_config(tmp_path, [{**layers[0], "selected": [1], "leading_dim": 11},
                                        *layers[1:]]))


def test_rows_of_a_split_sample_reach_only_layers_that_take_them(tmp_path):
    """A ``[batch*26, 11]`` tensor goes through the layers HugeCTR runs on any 2-D tensor
    (ReLU, InnerProduct, Slice, Concat of equal heights, ReduceSum axis 1) and is refused by
    those that mix a sample's rows, with the shape named."""
    ok = [{"name": "r", "type": "Reshape", "bottom": "emb", "top": "r", "leading_dim": 11},
          {"name": "fc", "type": "InnerProduct", "bottom": "r", "top": "fc",
           "fc_param": {"num_output": 3}},
          {"name": "relu", "type": "ReLU", "bottom": "fc", "top": "relu"},
          {"name": "cat", "type": "Concat", "bottom": ["relu", "r"], "top": "cat"},
          {"name": "sum", "type": "ReduceSum", "bottom": "cat", "axis": 1, "top": "sum"},
          {"name": "back", "type": "Reshape", "bottom": "sum", "top": "back", "leading_dim": 26},
          {"name": "fc2", "type": "InnerProduct", "bottom": "back", "top": "fc2",
           "fc_param": {"num_output": 1}},
          {"name": "loss", "type": "BinaryCrossEntropyLoss", "bottom": ["fc2", "label"],
           "top": "loss"}]
    net = build_network(parse_config(_config(tmp_path, ok)), nnx.Rngs(0))
    assert net.shapes["cat"] == (26, 14) and net.shapes["back"] == (26,)
    bad = ok[:1] + [{"name": "mc", "type": "MultiCross", "bottom": "r", "top": "mc",
                     "mc_param": {"num_layers": 1}}] + ok[-2:]
    bad[-2] = {**bad[-2], "bottom": "mc"}
    with pytest.raises(ConfigError, match=r"MultiCross \"mc\": expects one row per sample "
                                          r"\[batch, n\], got \[batch\*26, 11\]"):
        build_network(parse_config(_config(tmp_path, bad)), nnx.Rngs(0))
    mixed = ok[:1] + [{"name": "cat", "type": "Concat", "bottom": ["r", "dense"],
                       "top": "cat"}] + ok[-2:]
    mixed[-2] = {**mixed[-2], "bottom": "cat"}
    with pytest.raises(ConfigError, match="same rows per sample"):
        build_network(parse_config(_config(tmp_path, mixed)), nnx.Rngs(0))


def test_slice_ranges_in_hugectr_order(tmp_path):
    """SliceLayer: "A range cannot be out-order nor included in another" (equal ranges, as
    in DeepFM's slice2/slice3, are fine), at most 5 tops."""
    layers = _deepfm_layers()
    layers[1] = {**layers[1], "ranges": [[1, 11], [0, 10]]}
    with pytest.raises(ConfigError, match=r"layers\[3\]\.ranges\[1\]: \[0, 10\] comes before"):
        parse_config(_config(tmp_path, layers))
    layers[1] = {**layers[1], "ranges": [[0, 2]] * 6, "top": [f"t{i}" for i in range(6)]}
    with pytest.raises(ConfigError, match="at most 5 tops"):
        parse_config(_config(tmp_path, layers))


# ---- LocalizedSlotSparseEmbeddingOneHot / Hash sized by slot_size_array -----------------------


def _onehot_config(tmp_path, fmt="Raw", gpu=None, etype="LocalizedSlotSparseEmbeddingOneHot",
                   max_feature=6, **hparam):
    n = len(SLOT_SIZES)
    data = {"format": fmt, "slot_size_array": SLOT_SIZES,
            "sparse": [{"top": "data1", "type": "LocalizedSlot",
                        "max_feature_num_per_sample": max_feature, "slot_num": n}]}
    if fmt == "Raw":
        data.update(source=str(tmp_path / "train.bin"), eval_source=str(tmp_path / "eval.bin"),
                    num_samples=300, eval_num_samples=100, float_label_dense=True)
    else:
        data.update(source=str(tmp_path / "train" / "_file_list.txt"),
                    eval_source=str(tmp_path / "eval" / "_file_list.txt"))
    layers = [{"name": "r", "type": "Reshape", "bottom": "emb", "top": "r"},
              {"name": "fc", "type": "InnerProduct", "bottom": "r", "top": "fc",
               "fc_param": {"num_output": 1}},
              {"name": "loss", "type": "BinaryCrossEntropyLoss", "bottom": ["fc", "label"],
               "top": "loss"}]
    raw = _config(tmp_path, layers, slots=n, vec=4, data=data,
                  solver={"gpu": gpu or [0], "batchsize": 64, "batchsize_eval": 64},
                  emb={"type": etype, "sparse_embedding_hparam": {
                      "slot_size_array": SLOT_SIZES, "embedding_vec_size": 4, "combiner": 0,
                      **hparam}})
    raw["layers"][0].pop("synthetic")
    return raw


def _write_onehot(tmp_path, fmt, train=300, evals=100, extra=0):
    kw = dict(slot_nnz=[1] * len(SLOT_SIZES), vocab=SLOT_SIZES, dense_dim=13, seed=2)
    offsets = np.cumsum(SLOT_SIZES) - SLOT_SIZES
    for name, n, stream in (("train", train, 0), ("eval", evals, 1)):
        block = generate_block(n + extra, key_type="I32", stream=stream, **kw)
        keys = block.keys.reshape(n + extra, -1) - offsets
        if fmt == "Raw":
            write_raw_file(str(tmp_path / f"{name}.bin"), block.label, block.dense, keys,
                           float_label_dense=True)
        else:
            write_parquet_dataset(str(tmp_path / name), [(block.label, block.dense, keys)])


def test_onehot_table_sized_from_slot_size_array(tmp_path):
    """HugeCTR ``localized_slot_sparse_embedding_one_hot.hpp`` ``cal_max_voc_size_per_gpu``:
    with ``slot_size_array`` (and no ``max_vocabulary_size_per_gpu``, as in every DLRM
    sample) a device's table holds the slots it owns; jctr balances the slots by size, never
    needing more rows per device than HugeCTR's dealing in turn."""
    one = parse_config(_onehot_config(tmp_path))
    emb = one.embeddings[0]
    assert emb.slot_size_array == tuple(SLOT_SIZES)
    assert emb.max_vocabulary_size_per_gpu == sum(SLOT_SIZES)
    two = parse_config(_onehot_config(tmp_path, gpu=[0, 1]))
    # largest first onto the least loaded: {120} and {55, 30, 9, 7, 3}
    assert two.embeddings[0].max_vocabulary_size_per_gpu == 120
    hugectr_dealt = max(sum(SLOT_SIZES[0::2]), sum(SLOT_SIZES[1::2]))
    assert 120 <= hugectr_dealt
    assert EmbeddingSpec.from_config(two, two.embeddings[0]).capacity == 120
    # the Hash variant reads the same sizes; a given max_vocabulary_size_per_gpu is ignored
    # there as in HugeCTR; a plan_file list (one per node) is accepted
    h = parse_config(_onehot_config(tmp_path, etype="LocalizedSlotSparseEmbeddingHash",
                                    max_vocabulary_size_per_gpu=7))
    assert h.embeddings[0].max_vocabulary_size_per_gpu == sum(SLOT_SIZES)
    raw = _onehot_config(tmp_path)
    raw["layers"][1]["plan_file"] = ["plan_node0.json", "plan_node1.json"]
    parse_config(raw)


@pytest.mark.parametrize("change, message", [
    (lambda r: r["layers"][1]["sparse_embedding_hparam"].update(slot_size_array=[5, 5]),
     r"layers\[1\]\.sparse_embedding_hparam\.slot_size_array: has 2 entries but input "
     r"\"data1\" has slot_num 6"),
    (lambda r: r["layers"][1]["sparse_embedding_hparam"].pop("slot_size_array"),
     r"slot_size_array: required for LocalizedSlotSparseEmbeddingOneHot"),
])
def test_slot_size_array_errors(tmp_path, change, message):
    raw = _onehot_config(tmp_path)
    change(raw)
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_hugectr_3x_sparse_inputs_and_table_sizes(tmp_path):
    """HugeCTR 3.x (v3.3 ``create_datareader.cpp``, ``parser.hpp``
    get_max_feature_num_per_sample_from_nnz_per_slot, ``create_embedding.cpp``): inputs give
    ``nnz_per_slot`` (a number or one per slot; the sample's bound is their sum) and
    ``is_fixed_length``, no type; tables give ``workspace_size_per_gpu_in_mb`` (MB of float
    vectors per device) and ``combiner`` as a word; a DistributedSlot table's
    ``slot_size_array`` is read and not used when the workspace sizes it."""
    raw = _onehot_config(tmp_path, etype="DistributedSlotSparseEmbeddingHash")
    sp = raw["layers"][0]["sparse"][0]
    del sp["type"], sp["max_feature_num_per_sample"]
    sp.update(nnz_per_slot=[1, 2, 1, 3, 1, 1], is_fixed_length=False)
    raw["layers"][0]["format"] = "Norm"
    h = raw["layers"][1]["sparse_embedding_hparam"]
    h.update(workspace_size_per_gpu_in_mb=2, combiner="mean")
    cfg = parse_config(raw)
    s = cfg.data.sparse[0]
    assert (s.max_feature_num_per_sample, s.max_nnz, s.type) == (9, 3, "DistributedSlot")
    e = cfg.embeddings[0]
    assert e.max_vocabulary_size_per_gpu == (2 << 20) // (4 * 4) and e.combiner == "mean"
    assert e.slot_size_array == ()
    del h["workspace_size_per_gpu_in_mb"]  # only the sizes: the table holds them all
    assert parse_config(raw).embeddings[0].max_vocabulary_size_per_gpu == sum(SLOT_SIZES)
    sp["nnz_per_slot"] = 2
    assert parse_config(raw).data.sparse[0].max_feature_num_per_sample == 12
    sp["nnz_per_slot"] = [1, 2]
    with pytest.raises(ConfigError, match=r"sparse\[0\]\.nnz_per_slot: has 2 entries for "
                                          r"slot_num 6"):
        parse_config(raw)
    sp.update(nnz_per_slot=1, max_nnz=1)
    with pytest.raises(ConfigError, match="give nnz_per_slot .* not both"):
        parse_config(raw)


def test_hugectr_3x_solver_keys(tmp_path):
    """HugeCTR 3.x ``solver_parser.cpp``: ``max_eval_batches`` or ``max_eval_samples``
    (truncated to whole batches; never both), ``auc_threshold`` of the Python API's solver,
    GPU scheduling switches accepted, optimizer state files refused with the reason."""
    raw = _config(tmp_path, _deepfm_layers())
    solver = raw["solver"]
    del solver["eval_batches"]
    solver.update(max_eval_samples=64 * 5 + 3, auc_threshold=0.8, holistic_cuda_graph=True,
                  export_predictions_prefix="./pred")
    cfg = parse_config(raw)
    assert cfg.solver.eval_batches == 5 and cfg.solver.auc_threshold == 0.8
    solver["max_eval_batches"] = 4
    with pytest.raises(ConfigError, match="give one of eval_batches, max_eval_batches"):
        parse_config(raw)
    del solver["max_eval_samples"]
    from jctr.config import override_solver

    assert override_solver(parse_config(raw), {"eval_batches": 2}).solver.eval_batches == 2
    solver["dense_opt_states_file"] = "opt.bin"
    with pytest.raises(ConfigError, match="dense_opt_states_file: HugeCTR's optimizer state"):
        parse_config(raw)


def test_network_file_of_graph_to_json_parses(tmp_path):
    """The network file an HPS model names (HugeCTR's ``graph_to_json`` for inference,
    v3.3 test/scripts/dcn_inference.json): layers and an ``inference`` clause, no solver,
    optimizer or data sources."""
    raw = _config(tmp_path, _deepfm_layers())
    del raw["solver"], raw["optimizer"]
    data = raw["layers"][0]
    for key in ("source", "eval_source", "synthetic"):
        del data[key]
    raw["inference"] = {"max_batchsize": 4096, "hit_rate_threshold": 0.6,
                        "dense_model_file": "/models/_dense_10000.model",
                        "sparse_model_file": "/models/0_sparse_10000.model"}
    cfg = parse_config(raw, require_solver=False)
    assert [e.name for e in cfg.embeddings] == ["sparse_embedding1"]
    with pytest.raises(ConfigError, match="solver"):
        parse_config(raw)


@pytest.mark.parametrize("fmt, max_feature", [("Raw", 26), ("Parquet", 100)])
def test_raw_and_parquet_with_max_feature_num_and_no_max_nnz_train(tmp_path, fmt, max_feature):
    """HugeCTR parser.cpp reads ``max_nnz`` with ``max_feature_num_per_sample`` as its default,
    an upper bound: its Raw and Parquet readers take exactly one key per slot, so the one-hot
    configs of its samples (26, 30 or 100 there, no max_nnz) train as one-hot inputs. Two
    sharded devices: the OneHot table balanced by slot size."""
    raw = _onehot_config(tmp_path, fmt=fmt, gpu=[0, 1], max_feature=max_feature)
    cfg = parse_config(raw)
    assert cfg.data.sparse[0].one_hot
    _write_onehot(tmp_path, fmt)
    trainer = Trainer(cfg)
    trainer.fit()
    metrics = trainer.evaluate()
    assert 0.0 <= metrics["AUC"] <= 1.0
    # every key of the data fits the sized table: no more rows than the slots hold
    assert int(np.asarray(trainer.state.embeddings[0].row_slot >= 0).sum()) <= sum(SLOT_SIZES)


def test_raw_file_longer_than_num_samples_reads_num_samples(tmp_path):
    """HugeCTR ``mmap_offset_list.hpp``: a Raw file is mapped for ``num_samples`` records;
    records after them are never read. A shorter file is an error naming both counts."""
    from jctr.data.loader import open_dataset

    _write_onehot(tmp_path, "Raw", extra=50)
    cfg = parse_config(_onehot_config(tmp_path))
    ds = open_dataset(str(tmp_path / "train.bin"), cfg.data, "I32")
    assert sum(len(ds.read_unit(i)) for i in ds.host_units()) == 300
    raw = _onehot_config(tmp_path)
    raw["layers"][0]["num_samples"] = 400
    from jctr.data.records import DataError

    with pytest.raises(DataError, match=r"train\.bin: holds 350 records of 80 bytes .* says 400"):
        open_dataset(str(tmp_path / "train.bin"), parse_config(raw).data, "I32")


# ---- devices named by solver.gpu -------------------------------------------------------------


def _run_train(cfg: dict, tmp_path, *args) -> subprocess.CompletedProcess:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a fresh machine's
    return subprocess.run([sys.executable, "-m", "jctr.train", "--config", str(path), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_four_device_gpu_list_runs_on_a_cpu_machine_without_xla_flags(tmp_path):
    """HugeCTR's dcn.json names ``gpu: [0, 1, 2, 3]``: on the CPU platform jctr creates four
    host devices itself (one line saying so) and runs the config's placement over them."""
    raw = _config(tmp_path, _deepfm_layers(), solver={"gpu": [0, 1, 2, 3]})
    res = _run_train(raw, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "solver.gpu names 4 devices: on the CPU platform this process runs them as 4 " \
           "XLA:CPU host devices" in res.stderr
    assert "mesh: 4 devices on 1 process(es)" in res.stderr


def test_two_node_gpu_list_in_one_process(tmp_path):
    """HugeCTR's dcn2nodes sample lists a GPU list per node; one CPU process runs the nodes'
    devices side by side and says how to run one process per node instead."""
    raw = _config(tmp_path, _deepfm_layers(), solver={"gpu": [[0, 1], [0, 1]]})
    res = _run_train(raw, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert ("solver.gpu lists 2 nodes: on the CPU platform this one process runs their devices "
            "side by side as 4 XLA:CPU host devices (one process per node: "
            "scripts/launch_local.sh 2 CONFIG)") in res.stderr
    assert "mesh: 4 devices on 1 process(es)" in res.stderr


def test_host_devices_needed():
    from jctr.runtime.devices import host_devices_needed

    assert host_devices_needed(((0, 1, 2, 3),), 1) == 4
    assert host_devices_needed(((0, 2),), 1) == 3
    assert host_devices_needed(((0, 1), (0, 1, 2)), 1) == 5
    assert host_devices_needed(((0, 1), (2, 3)), 1) == 4  # HugeCTR's local ids per node
    assert host_devices_needed(((0, 1), (0, 1)), 2) == 2


# ---- memory: the plan covers the whole step --------------------------------------------------


def test_batch_larger_than_the_dataset_trains_and_plans_its_step(tmp_path):
    """HugeCTR's criteo sample trains batches of 40,960 on a small set; here a batch of 512
    on 256 samples: batches are filled across epochs, and the printed plan holds XLA's
    figures for the step's temporaries."""
    lines = []
    raw = _config(tmp_path, _deepfm_layers(), solver={"batchsize": 512, "batchsize_eval": 512})
    trainer = Trainer(parse_config(raw), log=lines.append)
    plan = trainer.memory_plan
    assert plan.temp > 0 and plan.state > 0 and plan.batch > 0 and plan.reader > 0
    text = "\n".join(lines)
    assert re.search(r"memory plan: per device state .* temporaries .* in all", text)
    trainer.fit()
    assert trainer.history


def test_a_step_that_will_not_fit_is_refused_with_the_figure(tmp_path):
    """A batch whose keys alone exceed the machine is refused before any table is allocated,
    naming the step's needs and what the machine has."""
    raw = _config(tmp_path, _deepfm_layers(),
                  solver={"batchsize": 1 << 22, "batchsize_eval": 512})
    raw["layers"][0]["sparse"][0]["max_feature_num_per_sample"] = 200
    big = copy.deepcopy(raw)
    big["solver"]["batchsize"] = 1 << 24  # 3.4 billion key positions: not even addressable
    with pytest.raises(ConfigError, match=r"solver\.batchsize: 16,777,216 samples x 200 key "
                                          r"positions .* pass 2\^31 keys in one batch"):
        parse_config(big)
    with pytest.raises(PlanError, match=r"the training step does not fit: it needs [0-9.]+ GiB "
                                        r"in all .* but the machine has [0-9.]+ GiB available, of "
                                        r"which .* stay free for the system; "
                                        r"lower solver\.batchsize"):
        Trainer(parse_config(raw), generate_data=False)


def test_memory_plan_figures():
    gib = 1 << 30
    plan = MemoryPlan(devices=2, state=gib, batch=gib // 8, temp=2 * gib, reader=gib // 4,
                      process=gib // 2, platform="cpu", available=20 * gib, heap_reserve=True)
    assert plan.steps_in_flight == 1  # GiBs of temporaries: the next step waits
    # the never-trimmed heap may hold every device's temporaries a second time
    assert plan.total == 2 * (gib + gib // 8 + 2 * gib) + 4 * gib + gib // 4 + gib // 2
    assert "heap reserve 4.00 GiB" in plan.describe()
    # what data kept in memory beside the run leaves room for: all but the state and process
    assert plan.transient == 2 * (gib // 8 + 2 * gib) + 4 * gib + gib // 4
    assert "= 11.00 GiB in all" in plan.describe()
    plan.check()
    tight = dataclasses.replace(plan, available=11 * gib)  # 5% stays free: 10.45 < 11 - 0.5
    assert not tight.fits() and dataclasses.replace(tight, heap_reserve=False).fits()
    small = MemoryPlan(devices=1, state=gib, batch=1 << 20, temp=1 << 20, reader=0, process=0,
                       platform="cpu", available=None)
    assert small.steps_in_flight == 2 and small.per_device == gib + 4 * (1 << 20)
    with pytest.raises(PlanError, match="each device needs"):
        MemoryPlan(devices=1, state=gib, batch=0, temp=gib, reader=0, process=0,
                   platform="gpu", device_limit=gib).check()


def test_hugectr_samples_script_trains_a_config(tmp_path):
    """``scripts/hugectr_samples.py`` writes data of a config's declared shape at the paths it
    names and reports the run against the memory plan."""
    cfg = _config(tmp_path, _deepfm_layers())
    cfg["layers"][0].pop("synthetic")
    cfg["layers"][0].update(source="./data/train.txt", eval_source="./data/eval.txt")
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "deepfm_like.json").write_text(json.dumps(cfg))
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "hugectr_samples.py"),
                          str(folder), "--iters", "2", "--samples", "256"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("deepfm_like.json"))
    assert " ran " in line and "loss" in line
    peak, plan = (float(v) for v in line.split()[2:4])
    assert peak > 0 and plan > 0
    assert (folder / "_runs" / "deepfm_like" / "data" / "train.txt").exists()



# ---- a HugeCTR user's model repository, served ----------------------------------------------


def _graph_to_json(train_raw: dict, dense: str, sparse: list[str]) -> dict:
    """The network file HugeCTR 3.x's ``graph_to_json`` writes for a trained model (as in
    v3.3 test/scripts/dcn_inference.json): the layers, sparse inputs with ``nnz_per_slot``,
    tables sized by ``workspace_size_per_gpu_in_mb``, combiners as words, no solver, optimizer
    or data sources, and an ``inference`` clause."""
    layers = copy.deepcopy(train_raw["layers"])
    data = layers[0]
    for key in ("source", "eval_source", "synthetic", "cache_eval_data"):
        data.pop(key, None)
    for sp in data["sparse"]:
        width = sp.pop("max_feature_num_per_sample")
        nnz = sp.pop("max_nnz", width)
        sp.pop("type")
        sp.update(is_fixed_length=False, nnz_per_slot=nnz)
    for layer in layers[1:]:
        h = layer.get("sparse_embedding_hparam")
        if h:
            rows = h.pop("max_vocabulary_size_per_gpu")
            h["workspace_size_per_gpu_in_mb"] = -(-rows * 4 * h["embedding_vec_size"] >> 20)
            h["combiner"] = {0: "sum", 1: "mean"}.get(h.get("combiner", 0), h.get("combiner"))
    return {"inference": {"max_batchsize": 256, "hit_rate_threshold": 0.9,
                          "dense_model_file": dense, "sparse_model_file": sparse},
            "layers": layers}


def test_hugectr_model_repository_served_from_the_seed_ps_json(tmp_path, tiny):
    """HPS seed (002): a model's ``network_file`` (graph_to_json's JSON), ``dense_file`` and
    ``sparse_files`` (HugeCTR model files) in ps.json, served as they stand: predictions equal
    the trainer's."""
    from jctr.config import load_config
    from jctr.config.hps import load_ps_config
    from jctr.serving.hps import Databases
    from jctr.serving.hps_model import HPSModel

    raw = tiny("dcn", max_iter=6, display=100, eval_interval=10_000, eval_batches=1)
    sp, h = raw["layers"][0]["sparse"][0], raw["layers"][1]["sparse_embedding_hparam"]
    trainer = Trainer(load_config(raw), log=lambda s: None)
    trainer.fit()
    files = trainer.save_model_files(str(tmp_path / "model" / "dcn_"))
    dense = next(f for f in files if "dense_" in f)
    sparse = [f for f in files if "_sparse_" in f]
    net = tmp_path / "model" / "dcn.json"
    net.write_text(json.dumps(_graph_to_json(raw, dense, sparse)))
    ps = tmp_path / "ps.json"
    ps.write_text(json.dumps({
        "supportlonglong": True,
        "models": [{"model": "dcn", "sparse_files": sparse, "dense_file": dense,
                    "network_file": str(net), "num_of_worker_buffer_in_pool": 2,
                    "deployed_device_list": [0], "max_batch_size": 256,
                    "default_value_for_each_table": [0.0], "hit_rate_threshold": 0.9,
                    "gpucacheper": 0.5, "gpucache": True,
                    "maxnum_catfeature_query_per_table_per_sample": [sp["slot_num"]],
                    "embedding_vecsize_per_table": [h["embedding_vec_size"]],
                    "embedding_table_names": ["sparse_embedding1"]}]}))
    params = load_ps_config(ps)
    dbs = Databases(params.volatile_db, params.persistent_db)
    model = HPSModel(params.models[0], dbs, where="models[0]", source=params.source)
    try:
        model.load_databases()
        batch = next(iter(trainer.data.eval.batches(256, epochs=1)))
        np.testing.assert_allclose(model.predict(batch), trainer.predict(batch), rtol=3e-5,
                                   atol=3e-6)
    finally:
        model.close()
        dbs.close()


def test_hugectr_weight_initializers(tmp_path):
    """HugeCTR v2.3 ``fully_connected_layer.cu`` / ``multiply_layer.cu``
    (get_uniform/xavier_*_initializer) and ``data_simulator.hpp`` (VarianceScalingSimulator):
    ``weight_init`` / ``bias_init`` draw Uniform ±1/(fan_in + fan_out) (the bias with fan-in
    0), Xavier uniform ±sqrt(3 / fan_avg), Xavier normal truncated at 2 sigma, or zeros;
    MultiCross and BatchNorm know only Zero besides their defaults, as in HugeCTR."""
    layers = [{"name": "r", "type": "Reshape", "bottom": "emb", "top": "r"},
              {"name": "fc", "type": "InnerProduct", "bottom": "r", "top": "fc",
               "fc_param": {"num_output": 64, "weight_init": "Uniform",
                            "bias_init": "XavierNorm"}},
              {"name": "fc2", "type": "InnerProduct", "bottom": "fc", "top": "fc2",
               "fc_param": {"num_output": 1, "weight_init": "XavierUniform",
                            "bias_init": "Zero"}},
              {"name": "loss", "type": "BinaryCrossEntropyLoss", "bottom": ["fc2", "label"],
               "top": "loss"}]
    net = build_network(parse_config(_config(tmp_path, layers)), nnx.Rngs(0))
    fc, fc2 = net.layers[1], net.layers[2]
    k = np.asarray(fc.kernel[...])
    assert np.abs(k).max() <= 1 / (286 + 64) and np.abs(k).max() > 0.8 / (286 + 64)
    b = np.asarray(fc.bias[...])
    std = (1 / 32) ** 0.5 / 0.87962566103423978  # fan_avg (0 + 64) / 2
    assert np.abs(b).max() <= 2 * std + 1e-6 and b.std() > 0.3 * std
    k2 = np.asarray(fc2.kernel[...])
    assert np.abs(k2).max() <= (3 / 32.5) ** 0.5 and np.all(np.asarray(fc2.bias[...]) == 0)
    bad = copy.deepcopy(layers)
    bad[1]["fc_param"]["weight_init"] = "He"
    with pytest.raises(ConfigError, match=r"fc_param\.weight_init: expected one of "
                                          r"\"Uniform\", \"XavierNorm\""):
        parse_config(_config(tmp_path, bad))


def test_big_blocks_can_be_given_back_at_run_time():
    """When a step's temporaries could not be held twice (the never-trimmed heap's worst
    case), the trainer switches glibc back to mmap for big blocks with mallopt."""
    import platform

    from jctr.runtime.host_memory import give_back_big_blocks

    # glibc takes it; elsewhere (no mallopt) the trainer keeps the plan with its reserve
    assert give_back_big_blocks() == (platform.libc_ver()[0] == "glibc")
