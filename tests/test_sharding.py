"""Tables over a device mesh (8 forced CPU devices, see conftest) and across two processes."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_config, xla_flags
from jax.sharding import Mesh

from jctr.config import ConfigError, OptimizerConfig, load_config
from jctr.data.batch import Batch
from jctr.data.loader import open_dataset
from jctr.embedding.engine import LocalEmbeddings
from jctr.embedding.sparse_embedding import EmbeddingSpec, init_embedding
from jctr.sharding import Placement, PlanError, ShardedEmbeddings, plan_embeddings
from jctr.sharding.sharded_embeddings import globalize_segments
from jctr.train.trainer import Trainer

pytestmark = pytest.mark.skipif(jax.device_count() < 8,
                                reason="needs 8 devices (conftest forces 8 CPU devices)")

STEPS = 20
TYPES = ("LocalizedSlotSparseEmbeddingHash", "DistributedSlotSparseEmbeddingHash")


def _config(tmp, model, gpu, etype=None, **solver):
    cfg = tiny_config(tmp, model, max_iter=STEPS, display=1, eval_interval=10_000,
                      eval_batches=2, batchsize=256, batchsize_eval=256, gpu=gpu, **solver)
    if etype:
        for layer in cfg["layers"]:
            if "SparseEmbedding" in layer["type"]:
                layer["type"] = etype
    return cfg


def _train(cfg):
    t = Trainer(load_config(cfg), log=lambda s: None)
    t.fit()
    losses = [h["loss"] for h in t.history if h["kind"] == "train"]
    auc = [h["AUC"] for h in t.history if h["kind"] == "eval"][-1]
    return t, np.array(losses), auc


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sharding")


@pytest.fixture(scope="module")
def single_runs(data_dir):
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = _train(_config(data_dir, model, [0]))[1:]
        return cache[model]

    return get


# every model once, both placements on the multi-hot one (suite time: not the full cross)
@pytest.mark.parametrize("model, etype", [
    ("dlrm", TYPES[0]), ("dcn", TYPES[1]), ("deepfm", TYPES[0]), ("deepfm", TYPES[1]),
    ("wdl", TYPES[1]),
])
def test_eight_devices_train_like_one(model, etype, data_dir, single_runs):
    ref_losses, ref_auc = single_runs(model)
    t, losses, auc = _train(_config(data_dir, model, list(range(8)), etype))
    kinds = {p.kind for p in t.placements}
    assert kinds == {"localized" if etype.startswith("Localized") else "distributed"}
    assert len(losses) == STEPS
    # same data, same initial vectors (key-derived): only the summation order differs
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    assert auc == pytest.approx(ref_auc, abs=1e-5)


def test_bfloat16_dlrm_on_eight_devices_trains_like_one(data_dir):
    """The CPU bf16 formulations (row-major linear backward, Gram interaction) under the
    data-parallel mesh: same losses as one device up to bf16 rounding of the gradients."""
    _, ref_losses, ref_auc = _train(_config(data_dir, "dlrm", [0], compute_dtype="bfloat16"))
    _, losses, auc = _train(_config(data_dir, "dlrm", list(range(8)), TYPES[1],
                                    compute_dtype="bfloat16"))
    assert len(losses) == STEPS and np.isfinite(losses).all()
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    assert auc == pytest.approx(ref_auc, abs=1e-2)


def test_replicated_and_mixed_placements(data_dir, single_runs):
    ref_losses, _ = single_runs("wdl")
    cfg = _config(data_dir, "wdl", list(range(8)), replicate_table_bytes=200_000)
    t, losses, _ = _train(cfg)
    kinds = [p.kind for p in t.placements]
    assert sorted(kinds) == ["distributed", "replicated"]  # the wide table is the small one
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    # a replicated table is one identical copy per device
    values = t.state.embeddings[kinds.index("replicated")].values
    shards = [np.asarray(s.data) for s in values.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards[1:])


# ---- routing on skewed input ----------------------------------------------------------------


def _batch(keys_per_sample, slot_num, max_features):
    """A Batch for one multi-hot input from per-sample lists of (slot, key)."""
    b = len(keys_per_sample)
    keys = np.zeros(b * max_features, np.int64)
    segs = np.full(b * max_features, b * slot_num, np.int32)
    for s, items in enumerate(keys_per_sample):
        for j, (slot, key) in enumerate(items):
            keys[s * max_features + j] = key
            segs[s * max_features + j] = s * slot_num + slot
    mask = np.array([bool(items) for items in keys_per_sample])
    return Batch(np.zeros((b, 1), np.float32), np.zeros((b, 1), np.float32), (keys,), (segs,),
                 mask)


@pytest.mark.parametrize("kind", ["distributed", "localized", "replicated"])
@pytest.mark.parametrize("opt", ["SGD", "Adam", "SparseAdaGradSGDRule", "admission"])
def test_routing_with_skewed_keys(kind, opt):
    d, slot_num, mf, b = 8, 3, 4, 16
    # admission: keys shown 3 times without a click (or clicked once) get their embedx
    optimizer = (OptimizerConfig("SparseAdaGradSGDRule", learning_rate=1.0,
                                 embedx_threshold=0.3) if opt == "admission"
                 else OptimizerConfig(opt))
    spec = EmbeddingSpec("e", capacity=64, dim=5, slot_num=slot_num, max_features=mf,
                         one_hot=False, input_index=0, optimizer=optimizer,
                         combiner="mean")
    rng = np.random.default_rng(0)
    samples = []
    for s in range(b):
        if s >= 10:  # the last devices hold padding samples only
            samples.append([])
        elif s % 2:  # one hot key, repeated within and across samples
            samples.append([(0, 7), (0, 7), (2, 7)])
        else:
            samples.append([(int(rng.integers(slot_num)), int(rng.integers(1, 40)))
                            for _ in range(int(rng.integers(0, mf + 1)))])
    batch = _batch(samples, slot_num, mf)
    batch = batch._replace(label=(rng.random((b, 1)) < 0.3).astype(np.float32))
    owner = (0, 0, 0) if kind == "localized" else ()  # every slot on device 0: 7 empty shards
    placement = Placement(kind, d, owner)
    mesh = Mesh(np.array(jax.devices()[:d]), ("d",))
    sharded = ShardedEmbeddings(mesh, (spec,), (placement,))
    local = LocalEmbeddings((spec,))
    grads = (jnp.asarray(rng.normal(size=(b, slot_num, spec.dim)), jnp.float32),)
    lrs = (jnp.float32(0.1),)
    count = jnp.int32(1)

    @jax.jit
    def run_sharded(batch):
        embs = (sharded.init_one(spec, placement),)
        embs, res, pooled = sharded.lookup(embs, batch, train=True)
        return sharded.apply(embs, res, batch, grads, lrs, count), pooled

    @jax.jit
    def run_local(batch):
        embs = (init_embedding(spec),)
        embs, res, pooled = local.lookup(embs, batch, train=True)
        return local.apply(embs, res, batch, grads, lrs, count), pooled

    embs_s, pooled_s = run_sharded(jax.device_put(batch))
    embs_l, pooled_l = run_local(batch)
    np.testing.assert_allclose(np.asarray(pooled_s[0]), np.asarray(pooled_l[0]), rtol=1e-6,
                               atol=1e-7)
    from jctr.sharding.rows import export_placed

    got = export_placed(embs_s[0], placement)
    want = export_placed(embs_l[0])
    order_g, order_w = np.argsort(got["keys"]), np.argsort(want["keys"])
    np.testing.assert_array_equal(got["keys"][order_g], want["keys"][order_w])
    for name in want:
        np.testing.assert_allclose(got[name][order_g], want[name][order_w], rtol=1e-6,
                                   atol=1e-7, err_msg=name)
    if opt == "admission":  # some rows have their embedx, others not (yet)
        admitted = want["accessor"][:, 2] > 0
        assert admitted.any() and not admitted.all()
        assert (want["values"][~admitted, 1:] == 0).all()
        assert (want["values"][admitted, 1:] != 0).all()
    if kind == "localized":  # every row sits on device 0
        sizes = np.asarray(embs_s[0].table.size)
        assert sizes[0] == len(want["keys"]) and not sizes[1:].any()
    if kind != "replicated":  # the hot key crowds one device: too much for small buffers
        assert sharded.fits(batch)
        assert not ShardedEmbeddings(mesh, (spec,), (placement,), capacity_factor=2.0).fits(batch)


@pytest.mark.parametrize("kind", ["distributed", "localized"])
def test_small_send_buffers_route_like_full_ones(kind):
    d, slot_num, mf, b = 8, 4, 8, 64
    spec = EmbeddingSpec("e", capacity=4096, dim=3, slot_num=slot_num, max_features=mf,
                         one_hot=False, input_index=0, optimizer=OptimizerConfig("Adam"))
    rng = np.random.default_rng(1)
    samples = [[(int(rng.integers(slot_num)), int(rng.integers(1, 10**12)))
                for _ in range(int(rng.integers(0, mf + 1)))] for _ in range(b)]
    batch = _batch(samples, slot_num, mf)
    placement = Placement(kind, d, tuple(s % d for s in range(slot_num)))
    mesh = Mesh(np.array(jax.devices()[:d]), ("d",))
    grads = (jnp.asarray(rng.normal(size=(b, slot_num, spec.dim)), jnp.float32),)
    outs = []
    for factor in (None, 2.5):
        engine = ShardedEmbeddings(mesh, (spec,), (placement,), capacity_factor=factor)
        assert engine.fits(batch)
        assert engine.buffer_rows(b // d * mf) == (b // d * mf if factor is None else 20)

        @jax.jit
        def run(batch, engine=engine):
            embs, res, pooled = engine.lookup(engine.init(), batch, train=True)
            return engine.apply(embs, res, batch, grads, (jnp.float32(0.1),), jnp.int32(1)), pooled

        embs, pooled = run(jax.device_put(batch))
        from jctr.sharding.rows import export_placed

        t = export_placed(embs[0], placement)
        order = np.argsort(t["keys"])
        outs.append((np.asarray(pooled[0]), {k: v[order] for k, v in t.items()}))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-6)
    for name in outs[0][1]:
        np.testing.assert_allclose(outs[0][1][name], outs[1][1][name], rtol=1e-6, err_msg=name)


def test_skewed_batches_fall_back_to_full_buffers(tmp_path):
    """Batches that overflow the small send buffers take the full-buffer step: same losses."""
    cfg = _config(tmp_path, "dlrm", [0])
    ref, ref_losses, _ = _train(cfg)
    cfg8 = _config(tmp_path, "dlrm", list(range(8)), all2all_capacity_factor=1.0)
    t, losses, _ = _train(cfg8)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    summary = [h for h in t.history if h["kind"] == "summary"][-1]
    assert summary["routing_fallback_steps"] > 0  # factor 1: any imbalance falls back


# ---- plans and mesh errors -------------------------------------------------------------------


def test_plan_that_does_not_fit_fails_before_allocating(tmp_path):
    cfg = _config(tmp_path, "dlrm", list(range(8)))
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = 5_000_000_000
    with pytest.raises(PlanError, match=r'the 8 host device\(s\) need .* in all but the '
                                        r'machine has .*short by.*embedding "sparse_embedding1"'):
        Trainer(load_config(cfg), log=lambda s: None, generate_data=False)


def test_plan_balances_localized_slots_by_size(tmp_path):
    cfg = load_config(_config(tmp_path, "dcn", [0], "LocalizedSlotSparseEmbeddingHash"))
    n = cfg.data.sparse[0].slot_num
    sizes = [1000] + [10] * (n - 1)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data,
                                                            slot_size_array=tuple(sizes)))
    specs = tuple(EmbeddingSpec.from_config(cfg, e) for e in cfg.embeddings)
    plan = plan_embeddings(cfg, specs, 4, device_memory=1 << 40)
    owner = plan.placements[0].slot_owner
    assert owner.count(owner[0]) == 1  # the big slot has a device to itself
    loads = [sum(sizes[s] for s in range(n) if owner[s] == dev) for dev in range(4)]
    assert max(loads[dev] for dev in range(4) if dev != owner[0]) - \
        min(loads[dev] for dev in range(4) if dev != owner[0]) <= 10
    text = plan.describe()
    assert "localized" in text and "per device" in text


def test_single_device_other_than_zero(tmp_path):
    t = Trainer(load_config(_config(tmp_path, "dlrm", [3])), log=lambda s: None)
    t.fit(max_iter=3)
    dev = jax.devices()[3]
    assert t.state.embeddings[0].values.devices() == {dev}
    assert all(x.devices() == {dev} for x in jax.tree.leaves(t.state.params))


def test_mesh_and_batch_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"solver\.gpu.*device 9 does not exist"):
        Trainer(load_config(_config(tmp_path, "dlrm", [0, 9])), generate_data=False)
    cfg = _config(tmp_path, "dlrm", list(range(8)))
    cfg["solver"]["batchsize"] = 100
    with pytest.raises(ConfigError, match=r"solver\.batchsize.*8 devices"):
        Trainer(load_config(cfg), generate_data=False)
    # nodes in one process run side by side on CPU, as far as the process's devices go
    with pytest.raises(ConfigError, match=r"solver\.gpu: lists 2 nodes, run by this process "
                                          r"as 12 host devices, but it has 8"):
        Trainer(load_config(_config(tmp_path, "dlrm", [list(range(6)), list(range(6))])),
                generate_data=False)


# ---- checkpoints across device counts -------------------------------------------------------


def test_checkpoint_written_on_8_devices_resumes_on_1_and_2(data_dir):
    cfg = _config(data_dir, "deepfm", list(range(8)), TYPES[0], snapshot=10,
                  snapshot_prefix=str(data_dir / "ck8") + "/")
    full, losses, _ = _train(cfg)
    batch = next(iter(full.data.eval.batches(256, epochs=1)))
    for gpu in ([0], [0, 1]):
        cfg_m = {**cfg, "solver": {**cfg["solver"], "gpu": gpu}}
        t = Trainer(load_config(cfg_m), log=lambda s: None)
        assert t.restore_checkpoint(step=10) == 10
        t.fit()
        resumed = np.array([h["loss"] for h in t.history if h["kind"] == "train"])
        np.testing.assert_allclose(resumed, losses[10:], rtol=2e-6)
        np.testing.assert_allclose(t.predict(batch), full.predict(batch), rtol=1e-5, atol=1e-6)
    # HugeCTR-style model files of the slot-wise table (with slot_id) warm-start 2 devices
    paths = full.save_model_files(str(data_dir / "files8") + "/")
    assert os.path.isfile(os.path.join(paths[2], "slot_id"))
    cfg_2 = {**cfg, "solver": {**cfg["solver"], "gpu": [0, 1], "dense model_file": paths[0],
                               "sparse_model_file": paths[2:]}}
    warm = Trainer(load_config(cfg_2), log=lambda s: None)
    np.testing.assert_allclose(warm.predict(batch), full.predict(batch), rtol=1e-5, atol=1e-6)
    # the 8-device checkpoint exports without a trainer or a mesh, onto one device
    from jctr.serving import InferenceModel, export_checkpoint

    bundle = export_checkpoint(str(data_dir / "ck8" / "checkpoints"), str(data_dir / "b8"),
                               step=20)
    np.testing.assert_allclose(InferenceModel.load(bundle).predict(batch), full.predict(batch),
                               rtol=1e-5, atol=1e-6)


# ---- two processes with jax.distributed -------------------------------------------------------


def _as_two_processes(cfg) -> tuple[Trainer, list[float], float]:
    """One process training ``cfg`` (four devices) on the batches two processes would see:
    each global batch process 0's share, then process 1's. Returns the trainer, its STEPS
    losses and its evaluation's AUC."""
    ref = Trainer(load_config(cfg), log=lambda s: None)
    c = ref.cfg
    shares = [open_dataset(c.data.source, c.data, c.solver.input_key_type, process_index=p,
                           process_count=2).batches(c.solver.batchsize // 2) for p in range(2)]
    slot_nums = tuple(s.slot_num for s in c.data.sparse)
    losses = []
    for _ in range(STEPS):
        parts = [globalize_segments(next(it), slot_nums, p, 2) for p, it in enumerate(shares)]
        batch = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
        ref.state, m = ref.train_step(ref.state, ref.placed.to_devices(batch, False))
        losses.append(float(m["loss"]))
    return ref, losses, ref.evaluate()["AUC"]


def _launch_two(tmp_path, cfg, name, *flags, **solver) -> tuple[list, list, str]:
    """``cfg`` trained by two jax.distributed processes of two devices each
    (scripts/launch_local.sh): their train losses, evaluation AUCs and stderr."""
    cfg["solver"].update(gpu=[[0, 1], [0, 1]], log_dir=str(tmp_path / name), **solver)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_local.sh"), "2",
                           str(path), *flags], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh: 4 devices on 2 process(es)" in proc.stderr
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text()
             .splitlines()]
    return ([x["loss"] for x in lines if x["kind"] == "train"],
            [x["AUC"] for x in lines if x["kind"] == "eval"], proc.stderr)


def _ten_then_resumed(tmp_path, cfg, ref_losses: list[float], ref_auc: float) -> None:
    """Two processes train ten steps and checkpoint (``tmp_path/ck``), then resume from that
    checkpoint to STEPS: together their losses, and the evaluation at the end, must be the
    reference's."""
    prefix = str(tmp_path / "ck") + "/"
    losses, _, _ = _launch_two(tmp_path, cfg, "first", "--max-iter", "10", snapshot=10,
                               snapshot_prefix=prefix)
    np.testing.assert_allclose(losses, ref_losses[:10], rtol=2e-6)
    resumed, aucs, err = _launch_two(tmp_path, cfg, "second", "--resume", "--max-iter",
                                     str(STEPS), snapshot=10, snapshot_prefix=prefix)
    assert "resumed from iter 10" in err
    np.testing.assert_allclose(resumed, ref_losses[10:], rtol=2e-6)
    assert aucs[-1] == pytest.approx(ref_auc, abs=1e-5)


def test_two_processes_agree_with_one_process(tmp_path):
    """Two jax.distributed processes of two devices each train, checkpoint, resume and export
    as one process of four devices does. The table is full and evicts (issue 36): the
    checkpoint the two processes write keeps every part's slot layout, and the resumed run's
    slots at the end are the reference's, key for key (a restore by rows alone puts keys in
    other slots, and later evictions choose among other keys)."""
    cfg = _config(tmp_path, "dlrm", [0, 1, 2, 3], TYPES[1])
    emb = cfg["layers"][1]
    emb["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = 150  # 600 of 2,000 keys
    emb["eviction"] = {"policy": "lru"}
    ref, ref_losses, ref_auc = _as_two_processes(cfg)  # (ref also generates the data)
    _ten_then_resumed(tmp_path, cfg, ref_losses, ref_auc)
    meta = json.loads((tmp_path / "ck" / "checkpoints" / "10" / "meta" / "metadata").read_text())
    assert len(meta["readers"]) == 2 and meta["processes"] == 2

    from jctr.checkpoint.manager import LAYOUT_PREFIX, read_rows

    table = ref.state.embeddings[0].table
    assert int(np.asarray(table.evicted).sum()) > 0
    saved = read_rows(str(tmp_path / "ck" / "checkpoints" / str(STEPS) / "rows"))
    np.testing.assert_array_equal(saved[LAYOUT_PREFIX + "sparse_embedding1"]["slot_keys"],
                                  np.asarray(table.slot_keys))

    # the two processes' checkpoint exports here, on one device, without a trainer
    from jctr.serving import InferenceModel, export_checkpoint

    bundle = export_checkpoint(str(tmp_path / "ck" / "checkpoints"), str(tmp_path / "b2"),
                               step=STEPS)
    batch = next(iter(ref.data.eval.batches(256, epochs=1)))
    np.testing.assert_allclose(InferenceModel.load(bundle).predict(batch), ref.predict(batch),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("replicated", [False, True])
def test_two_processes_spill_as_one_process_with_room_trains(tmp_path, replicated):
    """A spilling table (issue 36 point 2) across two jax.distributed processes of two devices
    each: spread over the four devices (1,400 rows each for ~8,000 keys) every device spills
    into and takes back from its own process's database, replicated (5,000 rows) each
    process's first device writes; a checkpoint gathers both processes' spilled rows, a resume
    gives each database its own devices' keys back. The losses of the first ten steps and of
    the resumed ten, and the evaluation after them, are those of one process training a table
    with room for every key on four devices."""
    cfg = _config(tmp_path, "dlrm", [0, 1, 2, 3], TYPES[1])
    cfg["solver"].update(batchsize=512, batchsize_eval=512)  # a batch's keys fit the table
    emb = cfg["layers"][1]
    emb["optimizer"] = {"type": "Adam", "update_type": "Local",
                        "adam_hparam": {"learning_rate": 0.01}}
    hparam = emb["sparse_embedding_hparam"]
    hparam.update(max_vocabulary_size_per_gpu=10_000, replicated=replicated)
    _, ref_losses, ref_auc = _as_two_processes(cfg)  # room for every key

    hparam["max_vocabulary_size_per_gpu"] = 5000 if replicated else 1400
    emb["eviction"] = {"policy": "lru", "spill": str(tmp_path / "spill")}

    _ten_then_resumed(tmp_path, cfg, ref_losses, ref_auc)

    from jctr.checkpoint.manager import read_rows
    from jctr.embedding.spill import SPILLED

    saved = read_rows(str(tmp_path / "ck" / "checkpoints" / "10" / "rows"))["sparse_embedding1"]
    spilled = saved["keys"][saved[SPILLED].astype(bool)]
    assert spilled.size > 200 and np.unique(spilled).size == spilled.size
    assert not np.isin(spilled, saved["keys"][~saved[SPILLED].astype(bool)]).any()


def test_cli_gpu_flag(tmp_path, capsys):
    from jctr.train.cli import main

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(_config(tmp_path, "dlrm", [0])))
    assert main(["--config", str(path), "--gpu", "0,1", "--max-iter", "2"]) == 0
    assert "mesh: 2 devices on 1 process(es)" in capsys.readouterr().err
    assert main(["--config", str(path), "--gpu", "0,x"]) == 2
    assert "--gpu: expected device ids" in capsys.readouterr().err


def test_regularized_tables_train_alike_on_one_and_four_devices(tmp_path):
    """The embeddings' l2_lambda acts on the sharded tables exactly as on one device."""
    losses = {}
    for gpu in ([0], [0, 1, 2, 3]):
        cfg = tiny_config(tmp_path, "deepfm", max_iter=12, display=4, eval_interval=1000,
                          gpu=gpu)
        for layer in cfg["layers"][1:3]:
            layer["sparse_embedding_hparam"]["l2_lambda"] = 0.05
        t = Trainer(load_config(cfg), log=lambda s: None)
        t.fit()
        losses[len(gpu)] = [h["loss"] for h in t.history if h["kind"] == "train"]
    np.testing.assert_allclose(losses[4], losses[1], rtol=1e-5)


def test_the_process_hosting_the_coordinator_ends_with_its_status_and_its_exit_handlers(tmp_path):
    """Process 0 of a cluster ends inside ``end_process`` (its coordination service is never
    destroyed, see there): its exit handlers still run, its output is flushed and the status is
    the command's."""
    marker = tmp_path / "atexit-ran"
    code = f"""
import atexit, socket, sys
import jax
from jctr.sharding import distributed
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
jax.distributed.initialize(f"127.0.0.1:{{port}}", num_processes=1, process_id=0)
distributed._started = True
atexit.register(lambda: open({str(marker)!r}, "w").write("yes"))
print("buffered line", end="")
sys.exit(distributed.end_process(3))
print("not reached")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 3, out.stderr[-2000:]
    assert out.stdout == "buffered line"
    assert marker.read_text() == "yes"
    assert "Check failed" not in out.stderr


@pytest.mark.parametrize("etype", TYPES)
def test_pushed_shows_divide_alike_on_eight_devices(data_dir, etype):
    """SparseAdaGradSGDRule with a show column (streaming's show_click_entry: Paddle divides
    a key's gradient by its pushed shows): the shows reach each key's owner with its gradient,
    so 8 devices (slot-wise and hashed) train the same table as one."""
    from jctr.sharding.rows import export_placed

    tables = []
    for gpu in ([0], list(range(8))):
        cfg = _config(data_dir, "dlrm", gpu, etype)
        cfg["solver"]["max_iter"] = 6
        for layer in cfg["layers"]:
            if "SparseEmbedding" in layer["type"]:
                layer["optimizer"] = {"type": "SparseAdaGradSGDRule", "show": "label[0]"}
        t = Trainer(load_config(cfg), log=lambda s: None)
        t.fit()
        stored = export_placed(t.state.embeddings[0], t.placements[0])
        order = np.argsort(stored["keys"])
        tables.append({k: v[order] for k, v in stored.items()})
    one, eight = tables
    np.testing.assert_array_equal(one["keys"], eight["keys"])
    np.testing.assert_allclose(one["values"], eight["values"], rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(one["g2sum"], eight["g2sum"], rtol=2e-4, atol=1e-7)


@pytest.mark.parametrize("etype", TYPES)
def test_exporting_some_keys_of_a_sharded_table_copies_only_their_rows(data_dir, etype,
                                                                       monkeypatch):
    """export_keys on 8 devices looks the keys up on the devices that own them: the same rows
    as the whole table filtered, and the whole table never reaches the host."""
    import jctr.sharding.rows as rows_mod

    t = Trainer(load_config(_config(data_dir, "dlrm", list(range(8)), etype)),
                log=lambda s: None)
    t.fit(3)
    es, pl = t.state.embeddings[0], t.placements[0]
    whole = rows_mod.export_placed(es, pl)
    rng = np.random.default_rng(0)
    want = np.concatenate([rng.choice(whole["keys"], 300, replace=False),
                           np.array([-5, 1 << 50], np.int64)])  # two keys it lacks
    monkeypatch.setattr(rows_mod, "export_placed", lambda *a, **k: pytest.fail("whole table"))
    got = rows_mod.export_keys(es, want, pl)
    keep = np.isin(whole["keys"], want)
    order_got, order_want = np.argsort(got["keys"]), np.argsort(whole["keys"][keep])
    assert set(got) == set(whole) and got["keys"].size == 300
    for name in whole:
        np.testing.assert_array_equal(got[name][order_got], whole[name][keep][order_want])
    # which of them the table holds, no row leaving a device (the publisher's pruning)
    monkeypatch.setattr(rows_mod, "_rows_of", lambda *a, **k: pytest.fail("rows read"))
    held = rows_mod.export_own_keys(es, want, pl, keys_only=True)
    assert set(held) == {"keys"}
    np.testing.assert_array_equal(np.sort(held["keys"]), np.sort(got["keys"]))
    # every key it holds, keys only (a publisher's record after a resume)
    np.testing.assert_array_equal(np.sort(rows_mod.own_held_keys(es, pl)),
                                  np.sort(whole["keys"]))


@pytest.mark.parametrize("kind", ["DistributedSlotSparseEmbeddingHash",
                                  "LocalizedSlotSparseEmbeddingHash"])
def test_the_shrink_erases_on_every_device_part(tmp_path, kind):
    """Issue 36 point 1 on 8 devices: drop_keys erases the deleted keys in every part of a
    table spread by key hash or by slot (a part skips keys it does not hold); the table then
    holds the same keys, vectors and optimizer rows whether every part's slots are built
    again after it or not, and its rows stay where the steps expect them."""
    import jax.numpy as jnp

    from jctr.config import parse_config
    from jctr.sharding import rows as rows_mod
    from jctr.train.trainer import Trainer
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, "dlrm", max_iter=1, display=1000)
    cfg["solver"]["gpu"] = list(range(8))
    emb = cfg["layers"][1]
    emb["type"] = kind
    emb["sparse_embedding_hparam"].update(replicated=False, max_vocabulary_size_per_gpu=4000)
    emb["optimizer"] = {"type": "Adam", "update_type": "Local"}
    t = Trainer(parse_config(cfg), log=lambda s: None)
    spec, es, pl = t.specs[0], t.state.embeddings[0], t.placements[0]
    assert pl.sharded
    rng = np.random.default_rng(3)
    n = 2000
    keys = rng.choice(10**9, n, replace=False).astype(np.int64)
    stored = {"keys": keys, "values": rng.normal(size=(n, spec.dim)).astype(np.float32),
              "slot": rng.integers(0, spec.slot_num, n).astype(np.int32)}
    stored.update({name: rng.normal(size=(n, *arr.shape[2:])).astype(np.float32)
                   for name, arr in es.slots.items()})  # [parts, rows, ...] on a mesh
    full = rows_mod.put_rows(spec, es, pl, stored, replace=True)
    shardings = jax.tree.map(lambda x: x.sharding, full)
    deleted = keys[rng.random(n) < 0.3]

    def by_key(state):
        out = rows_mod.export_placed(state, pl)
        order = np.argsort(out["keys"])
        return {k: v[order] for k, v in out.items()}

    copy = jax.tree.map(lambda x: jax.device_put(jnp.copy(x), x.sharding), full)
    erased, in_use = rows_mod.drop_keys(spec, copy, pl, deleted)
    assert in_use == n - deleted.size
    assert int(np.sum(np.asarray(erased.table.free_count))) == deleted.size  # not rebuilt
    for a, b in zip(jax.tree.leaves(jax.tree.map(lambda x: x.sharding, erased)),
                    jax.tree.leaves(shardings)):
        assert a.is_equivalent_to(b, 2), (a, b)
    rows_mod.MAX_FILL, saved = 0.0, rows_mod.MAX_FILL
    try:  # every part's slots built again after the erase
        rebuilt, in_use2 = rows_mod.drop_keys(spec, full, pl, deleted)
    finally:
        rows_mod.MAX_FILL = saved
    assert in_use2 == in_use
    assert int(np.sum(np.asarray(rebuilt.table.tombstones))) == 0
    a, b = by_key(erased), by_key(rebuilt)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_sharded_tables_publisher_cuts_its_record_past_twice_the_whole_table(data_dir,
                                                                              monkeypatch):
    """The Kafka publisher's record of sent keys is cut (and the keys the table evicted sent
    as erased) once it passes twice the table's rows: a table spread over 8 devices holds
    ``max_vocabulary_size_per_gpu`` rows on each, so the record was cut at every publish
    once the table held twice one part's rows (an export of every recorded key each time).
    A server that applies what was sent, in order, holds every key the table holds and no
    key outside the record."""
    import jctr.stores.kafka as kafka
    from jctr.sharding.rows import export_placed
    from jctr.train.publisher import KafkaPublisher

    sent = []  # ("rows" | "erase", keys) in order

    class Recorder:  # the sink, without a broker
        def __init__(self, *args, **kwargs):
            self.brokers, self.reachable = "none", True

        def broker_restarted(self):
            return False

        def publish_rows(self, table, step, keys, values):
            sent.append(("rows", keys.copy()))

        def publish_erase(self, table, step, keys):
            sent.append(("erase", keys.copy()))

        def publish_dense(self, step, dense, non_trainable):
            return True

        def flush(self, timeout_s=0.0):
            return 0

        def stats(self):
            return {"sent": 0, "dropped": 0, "failed": 0}

    monkeypatch.setattr(kafka, "KafkaMessageSink", Recorder)
    per_part = 150
    cfg = _config(data_dir, "dlrm", list(range(8)), "DistributedSlotSparseEmbeddingHash",
                  kafka_sink={"model_name": "m", "brokers": "127.0.0.1:1", "every_n_steps": 1})
    cfg["layers"][1]["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = per_part
    cfg["layers"][1]["eviction"] = {"policy": "lru"}
    t = Trainer(load_config(cfg), log=lambda s: None)
    pub = next(h for h in t.hooks if isinstance(h, KafkaPublisher))
    cuts = []
    prune = pub._prune
    monkeypatch.setattr(pub, "_prune", lambda *a: cuts.append(pub._published[0].values().size)
                        or prune(*a))
    t.fit()
    whole = 8 * per_part
    assert cuts and all(size > 2 * whole for size in cuts), cuts
    served: set[int] = set()
    for kind, keys in sent:
        (served.update if kind == "rows" else served.difference_update)(keys.tolist())
    held = export_placed(t.state.embeddings[0], t.placements[0])["keys"]
    assert sum(k.size for kind, k in sent if kind == "erase") == pub.erased > 0
    assert set(held.tolist()) <= served <= set(pub._published[0].values().tolist())
    assert len(served) <= 2 * whole
