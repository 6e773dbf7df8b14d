"""DLRM training throughput of jctr against a plain PyTorch baseline, measured in one run.

Model (the Criteo Kaggle shape): 13 dense features, 26 slots with the Kaggle cardinalities capped
at 1,000,000 rows, embedding dim 16, bottom MLP 512-256-64-16, top MLP 512-256-1, plain SGD
(``--optimizer adam``: Adam on the touched rows, PyTorch's SparseAdam and Adam; ``adagrad``:
AdaGrad on the touched rows, PyTorch's Adagrad).
The baseline is the classic DLRM reference: one nn.EmbeddingBag(sparse=True) per slot, dense
MLPs, dot interaction, torch.optim.SGD. Both train on the same batches, made before the timing and
held in memory (the data pipeline is measured separately); every step takes a batch no earlier
step saw (``--keys power-law`` or ``uniform``), so new keys keep arriving and jctr's table
inserts as it would on real data. On a machine whose JAX runs on a GPU the PyTorch reference runs
on CUDA too (``--torch-device``).

The sparse part of jctr's step is reported as the step time minus that of the same step on
pooled embeddings given up front (no lookup, insertion, pooling or row update; measured in the
same rounds).

Precision: float32 on both sides is the like-for-like comparison. ``bfloat16`` runs jctr with
``compute_dtype: bfloat16`` (bf16 matmuls, float32 weights, embeddings and optimizer) and the
baseline under ``torch.autocast("cpu", torch.bfloat16)`` (the same split). Every variant's
steps are interleaved in rounds (``--block`` steps each), so the machine's slow phases hit all
of them alike; figures are medians over all timed steps, and each ratio also comes per round
(its lowest and highest value printed: how far the machine's drift moved it).

    python scripts/bench_train.py                 # one-hot and 10-hot, float32 and bfloat16
    python scripts/bench_train.py --hot 1 --steps 20 --dtype float32 --keys uniform
    python scripts/bench_train.py --optimizer adam --hot 10 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jctr._x64  # noqa: E402,F401  (64-bit keys)
from jctr.data.batch import Batch  # noqa: E402
from jctr.data.tools.synthetic import power_law_ranks  # noqa: E402
from jctr.runtime.host_memory import reexec_with_malloc_tuning  # noqa: E402
from scripts.make_configs import KAGGLE_CAPPED  # noqa: E402

DENSE, DIM = 13, 16
BOTTOM, TOP = (512, 256, 64, 16), (512, 256, 1)


def make_batches(n: int, batch: int, hot: int, seed: int = 0, keys: str = "power-law"):
    """``n`` distinct batches: per slot ``hot`` keys per sample (ranks drawn per slot from a
    power law, alpha 1.2, or uniformly over the slot's cardinality)."""
    rng = np.random.default_rng(seed)
    out = []

    def draw(c):
        if keys == "uniform":
            return rng.integers(0, c, batch * hot)
        return power_law_ranks(rng, batch * hot, c, 1.2)

    for _ in range(n):
        ranks = np.stack([draw(c).reshape(batch, hot) for c in KAGGLE_CAPPED],
                         axis=1)  # [B, 26, hot]
        dense = np.log1p(rng.exponential(1.0, (batch, DENSE))).astype(np.float32)
        label = (rng.random((batch, 1)) < 0.25).astype(np.float32)
        out.append((ranks, dense, label))
    return out


def jctr_batch(ranks, dense, label) -> Batch:
    b, s, hot = ranks.shape
    offsets = np.concatenate([[0], np.cumsum(KAGGLE_CAPPED)[:-1]])
    keys = (ranks + offsets[None, :, None]).reshape(-1).astype(np.int64)
    segs = np.repeat(np.arange(b * s, dtype=np.int32), hot)
    return Batch(label, dense, (keys,), (segs,), np.ones(b, bool))


# ``--optimizer adam``: HugeCTR's Adam on the touched rows (``update_type: Local``) against
# PyTorch's SparseAdam on the tables and Adam on the MLPs, the same hyperparameters
ADAM = {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7}
# ``--optimizer adagrad``: HugeCTR's AdaGrad on the touched rows against PyTorch's Adagrad
# (sparse gradients on the tables; the same rule, epsilon beside the root)
ADAGRAD = {"learning_rate": 0.01, "initial_accu_value": 0.0, "epsilon": 1e-7}
OPTIMIZERS = {"sgd": {"type": "SGD", "sgd_hparam": {"learning_rate": 0.1}},
              "adam": {"type": "Adam", "update_type": "Local", "adam_hparam": ADAM},
              "adagrad": {"type": "AdaGrad", "update_type": "Local", "adagrad_hparam": ADAGRAD}}


def jctr_config(batch: int, hot: int, optimizer: str = "sgd") -> dict:
    from jctr.config.model_layers import dlrm_layers

    slots = len(KAGGLE_CAPPED)
    return {
        "solver": {"max_iter": 1, "batchsize": batch, "input_key_type": "I64"},
        "optimizer": OPTIMIZERS[optimizer],
        "layers": [
            {"name": "data", "type": "Data", "source": "unused", "eval_source": "unused",
             "label": {"top": "label", "label_dim": 1}, "dense": {"top": "dense",
                                                                  "dense_dim": DENSE},
             "sparse": [{"top": "data1", "type": "DistributedSlot",
                         "max_feature_num_per_sample": slots * hot, "max_nnz": hot,
                         "slot_num": slots}]},
            {"name": "sparse_embedding1", "type": "DistributedSlotSparseEmbeddingHash",
             "bottom": "data1", "top": "sparse_embedding1",
             "sparse_embedding_hparam": {"max_vocabulary_size_per_gpu": sum(KAGGLE_CAPPED),
                                         "embedding_vec_size": DIM, "combiner": 0}},
            *dlrm_layers(DENSE, slots, DIM, BOTTOM, TOP),
        ]}


def jctr_runner(batches, dtype: str, engine=None, l2_rows: str | None = None,
                optimizer: str = "sgd"):
    """A function running one jctr training step on the next batch (compiled here);
    ``engine``: the step's embedding engine (default: the tables on one device); ``l2_rows``:
    the table regularized (``l2_lambda`` 1e-5) on the touched rows or on all of them."""
    import jax

    from jctr.config import parse_config
    from jctr.models.ctr import build_model
    from jctr.runtime.xla_options import step_compiler_options
    from jctr.train.dense_optimizer import dense_optimizer
    from jctr.train.step import make_train_step

    b, _, hot = batches[0][0].shape
    config = jctr_config(b, hot, optimizer)
    config["solver"]["compute_dtype"] = dtype
    if l2_rows is not None:
        config["layers"][1]["sparse_embedding_hparam"].update(l2_lambda=1e-5, l2_rows=l2_rows)
    cfg = parse_config(config)
    step_config, init_model = build_model(cfg)
    tx = dense_optimizer(cfg.optimizer)
    init_state = lambda: init_model(tx)  # noqa: E731
    step = jax.jit(make_train_step(step_config, tx, engine), donate_argnums=0,
                   compiler_options=step_compiler_options(dtype))
    dev = [jax.device_put(jctr_batch(*x)) for x in batches]
    box = {"state": init_state(), "i": 0}

    def run():
        box["state"], m = step(box["state"], dev[box["i"] % len(dev)])
        box["i"] += 1
        jax.block_until_ready(m["loss"])

    return run


def dense_only_runner(batches, dtype: str, optimizer: str = "sgd"):
    """jctr's step with the embedding lookups replaced by pooled vectors given up front (no
    table lookup, insertion, pooling or row update; the dense part's backward into the
    embeddings stays): ``step - this`` is the sparse part of the step."""
    import jax
    import jax.numpy as jnp

    from jctr.embedding.engine import EmbeddingEngine

    b, slots, _ = batches[0][0].shape
    pooled = jax.random.normal(jax.random.PRNGKey(0), (b, slots, DIM), jnp.float32) * 0.01

    class Pregathered(EmbeddingEngine):
        def lookup(self, embs, batch, *, train):
            return embs, None, (pooled,)

        def apply(self, embs, lookups, batch, grads, lrs, count):
            # keep the gradient into the embeddings alive (one cheap reduction)
            table = embs[0].table
            touched = table._replace(overflow=table.overflow
                                     + (jnp.sum(grads[0]) * 0).astype(table.overflow.dtype))
            return (embs[0]._replace(table=touched),)

    return jctr_runner(batches, dtype, Pregathered(), optimizer=optimizer)


def torch_runner(batches, dtype: str, device: str = "cpu", optimizer: str = "sgd"):
    """A function running one step of the PyTorch reference (autocast for bfloat16)."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    def mlp(sizes, last_relu):
        layers = []
        for i in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < len(sizes) - 2 or last_relu:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    class DLRMRef(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.ModuleList(nn.EmbeddingBag(c, DIM, mode="sum", sparse=True)
                                     for c in KAGGLE_CAPPED)
            self.bot = mlp((DENSE, *BOTTOM), True)
            f = len(KAGGLE_CAPPED) + 1
            self.li, self.lj = torch.tril_indices(f, f, offset=-1)
            self.top = mlp((DIM + f * (f - 1) // 2 + 1, *TOP), False)

        def forward(self, dense, idx, offs):
            x = self.bot(dense)
            e = [m(i, o) for m, i, o in zip(self.emb, idx, offs)]
            t = torch.stack([x, *e], dim=1)
            z = torch.bmm(t, t.transpose(1, 2))[:, self.li, self.lj]
            pad = torch.zeros(x.shape[0], 1, device=x.device, dtype=x.dtype)
            return self.top(torch.cat([x, z, pad], dim=1))

    model = DLRMRef().to(device)
    if optimizer == "sgd":
        opts = [torch.optim.SGD(model.parameters(), lr=0.1)]
    elif optimizer == "adagrad":  # sparse gradients on the tables, dense on the MLPs
        opts = [torch.optim.Adagrad(model.parameters(), lr=ADAGRAD["learning_rate"],
                                    eps=ADAGRAD["epsilon"])]
    else:
        hyper = {"lr": ADAM["learning_rate"], "betas": (ADAM["beta1"], ADAM["beta2"]),
                 "eps": ADAM["epsilon"]}
        opts = [torch.optim.SparseAdam(list(model.emb.parameters()), **hyper),
                torch.optim.Adam([*model.bot.parameters(), *model.top.parameters()],
                                 **hyper)]
    loss_fn = nn.BCEWithLogitsLoss()
    prepared = []
    for ranks, dense, label in batches:
        b, s, hot = ranks.shape
        idx = [torch.from_numpy(np.ascontiguousarray(ranks[:, j]).reshape(-1)).to(device)
               for j in range(s)]
        offs = [torch.arange(0, b * hot, hot, device=device) for _ in range(s)]
        prepared.append((torch.from_numpy(dense).to(device), idx, offs,
                         torch.from_numpy(label).to(device)))
    autocast = dtype == "bfloat16"
    box = {"i": 0}
    kind = "cuda" if device.startswith("cuda") else "cpu"

    def run():
        dense, idx, offs, label = prepared[box["i"] % len(prepared)]
        box["i"] += 1
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with torch.autocast(kind, dtype=torch.bfloat16, enabled=autocast):
            out = model(dense, idx, offs)
        loss = loss_fn(out.float(), label)
        loss.backward()
        for opt in opts:
            opt.step()
        if kind == "cuda":
            torch.cuda.synchronize()

    return run


def interleaved(runners: dict, steps: int, warmup: int, block: int) -> dict:
    """Per runner, the seconds of its ``steps`` timed steps, run in rounds of ``block``."""
    for run in runners.values():
        for _ in range(warmup):
            run()
    times = {name: [] for name in runners}
    while any(len(t) < steps for t in times.values()):
        for name, run in runners.items():
            # a pause between variants: the previous one's worker threads (OpenMP, XLA) may
            # still spin for a while and would steal the cores from this one's first step
            time.sleep(0.25)
            for _ in range(min(block, steps - len(times[name]))):
                t = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t)
    return times


def round_ratios(fast: list[float], slow: list[float], block: int) -> list[float]:
    """Speed ratio ``slow / fast`` of the median step time per round (``block`` steps each).

    Rounds of two variants run back to back, so a round's ratio is taken under the same machine
    load; the spread of these ratios shows how much the shared machine's drift moves the result.
    """
    chunks = range(0, min(len(fast), len(slow)), block)
    return [statistics.median(slow[i:i + block]) / statistics.median(fast[i:i + block])
            for i in chunks]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--hot", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--block", type=int, default=5, help="steps per variant and round")
    ap.add_argument("--keys", nargs="+", default=["power-law", "uniform"],
                    choices=["power-law", "uniform"], help="key distributions, each measured")
    ap.add_argument("--torch-device", default=None,
                    help="the PyTorch reference's device (default: cuda where JAX runs on a GPU)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--optimizer", choices=["sgd", "adam", "adagrad"], default="sgd",
                    help="plain SGD (the DLRM reference), or Adam / AdaGrad on the touched "
                    "rows (jctr's update_type Local; PyTorch's SparseAdam and Adam, Adagrad)")
    ap.add_argument("--l2", action="store_true",
                    help="also time the table regularized on its touched rows and on all rows "
                    "(l2_rows), against the plain step")
    args = ap.parse_args()
    # the same host memory setting as `python -m jctr.train` (JCTR_HOST_MEMORY_TUNING=0: off)
    reexec_with_malloc_tuning([os.path.abspath(__file__), *sys.argv[1:]])
    print(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}", flush=True)
    import jax

    torch_device = args.torch_device or ("cuda" if jax.default_backend() == "gpu" else "cpu")
    print(f"jax on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"pytorch on {torch_device}", flush=True)
    results = []
    for hot, keys in [(h, k) for h in args.hot for k in args.keys]:
        # one fresh batch per step of each runner (warm-up included), made before the timing
        batches = make_batches(args.warmup + args.steps, args.batch, hot, keys=keys)
        runners = {}
        for dtype in args.dtype:
            runners["jctr", dtype] = jctr_runner(batches, dtype, optimizer=args.optimizer)
            runners["dense", dtype] = dense_only_runner(batches, dtype, args.optimizer)
            runners["torch", dtype] = torch_runner(batches, dtype, torch_device,
                                                   args.optimizer)
            if args.l2:
                for rows in ("touched", "all"):
                    runners[f"l2 {rows}", dtype] = jctr_runner(batches, dtype, l2_rows=rows)
        times = interleaved(runners, args.steps, args.warmup, args.block)
        rate = {k: args.batch / statistics.median(t) for k, t in times.items()}
        for dtype in args.dtype:
            j, t = rate["jctr", dtype], rate["torch", dtype]
            per_round = round_ratios(times["jctr", dtype], times["torch", dtype], args.block)
            row = {"hot": hot, "keys": keys, "batch": args.batch, "dtype": dtype,
                   "optimizer": args.optimizer,
                   "device": jax.devices()[0].device_kind, "torch_device": torch_device,
                   "jctr_samples_per_s": round(j), "torch_samples_per_s": round(t),
                   "ratio": round(j / t, 3),
                   "round_ratios": [round(r, 3) for r in per_round]}
            line = (f"{hot:>2}-hot {keys:<9} batch {args.batch} {dtype:<8} {args.optimizer}: "
                    f"jctr {j:,.0f} samples/s   "
                    f"pytorch{' (autocast)' if dtype == 'bfloat16' else ''} {t:,.0f} samples/s"
                    f"   ratio {j / t:.2f}x (rounds {min(per_round):.2f}-{max(per_round):.2f})")
            sparse = 1.0 - rate["jctr", dtype] / rate["dense", dtype]
            # per round too: the difference of two medians moves with the machine's drift
            # (28-44% over five runs of one tree on a shared VM: docs/performance.md)
            sparse_rounds = [1.0 - r for r in round_ratios(times["jctr", dtype],
                                                            times["dense", dtype], args.block)]
            row["sparse_share"] = round(sparse, 3)
            row["sparse_share_rounds"] = [round(r, 3) for r in sparse_rounds]
            line += (f"   sparse part {100 * sparse:.0f}% of the step (rounds "
                     f"{100 * min(sparse_rounds):.0f}-{100 * max(sparse_rounds):.0f}%)")
            if dtype != "float32" and ("torch", "float32") in rate:
                row["ratio_to_torch_float32"] = round(j / rate["torch", "float32"], 3)
                cross = round_ratios(times["jctr", dtype], times["torch", "float32"], args.block)
                row["round_ratios_to_torch_float32"] = [round(r, 3) for r in cross]
                line += (f"   (jctr {dtype} / pytorch float32: "
                         f"{row['ratio_to_torch_float32']:.2f}x, rounds "
                         f"{min(cross):.2f}-{max(cross):.2f})")
            if args.l2:
                for rows in ("touched", "all"):
                    row[f"l2_{rows}_ratio"] = round(rate[f"l2 {rows}", dtype] / j, 3)
                line += ("   l2 on touched rows {:.2f}x, on all rows {:.2f}x the plain step"
                         .format(row["l2_touched_ratio"], row["l2_all_ratio"]))
            results.append(row)
            print(line, flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
