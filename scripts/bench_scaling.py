"""DLRM training on 1, 2, 4 and 8 devices at a fixed global batch, and what routing costs.

On a CPU-only machine the devices are forced host devices that share the same cores, so the
figure to read is the overhead ratio (step time on D devices over the 1-device step, same run),
not a speed-up. Batches whose keys do not fit the send buffers sized by
``solver.all2all_capacity_factor`` take the full-buffer step, as in the trainer (counted in
the output). The all-to-all time per step is measured by running exactly the step's
collectives (keys and segment ids to their owners, partial sums back, segment gradients
gathered) with the step's buffer shapes in a jitted ``shard_map`` of their own.

    python scripts/bench_scaling.py                  # one-hot, batch 8192
    python scripts/bench_scaling.py --hot 10 --batch 4096 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jctr._x64  # noqa: E402,F401  (64-bit keys)
from jctr.runtime.host_memory import reexec_with_malloc_tuning  # noqa: E402
from scripts.bench_train import jctr_batch, jctr_config, make_batches  # noqa: E402
from scripts.make_configs import KAGGLE_CAPPED  # noqa: E402


def _median_ms(fn, steps: int, warmup: int) -> float:
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        jax.block_until_ready(fn(i))
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[warmup:])


def bench_devices(devices: int, batches, steps: int, warmup: int, etype: str) -> dict:
    from jctr.config import parse_config
    from jctr.train.trainer import Trainer

    b, _, hot = batches[0][0].shape
    raw = jctr_config(b, hot)
    raw["solver"]["gpu"] = list(range(devices))
    emb = raw["layers"][1]
    emb["type"] = etype
    # per-device capacity, as a HugeCTR user would size max_vocabulary_size_per_gpu
    total = sum(KAGGLE_CAPPED)
    emb["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = (
        total if devices == 1 else int(total / devices * 1.3))
    if etype.startswith("Localized"):  # whole slots per device: the largest slot bounds it
        emb["sparse_embedding_hparam"]["max_vocabulary_size_per_gpu"] = max(
            int(total / devices * 1.3), max(KAGGLE_CAPPED) * 2)
    trainer = Trainer(parse_config(raw), log=lambda s: None, generate_data=False)
    host = [jctr_batch(*x) for x in batches]
    dev = [trainer.placed.to_devices(x, False) for x in host]
    fits = [trainer.placed.routing_fits(x) for x in host]  # as the trainer's loop decides
    state = [trainer.state]

    def one(i):
        step = trainer.train_step if fits[i % len(dev)] else trainer.train_step_full
        state[0], m = step(state[0], dev[i % len(dev)])
        return m["loss"]

    step_ms = _median_ms(one, steps, warmup)
    a2a_ms = 0.0
    if devices > 1:
        rows = trainer.placed.engine.buffer_rows(b * 26 * hot // devices)
        a2a_ms = _median_ms(_exchange_fn(trainer.mesh, devices, rows, b * 26), steps, warmup)
    return {"devices": devices, "step_ms": step_ms, "samples_per_s": b / step_ms * 1000,
            "all_to_all_ms": a2a_ms, "full_buffer_batches": fits.count(False)}


def _exchange_fn(mesh, d: int, n: int, global_segments: int):
    """The step's collectives alone, with its buffer shapes: [d, n] int64 keys and int32 segment
    ids to the owners (n: send buffer rows per destination), [d, nseg, 16] float32 partial sums
    back (all-to-all), and the [nseg, 16] segment gradients gathered by every device."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jctr.sharding.mesh import AXIS

    nseg = global_segments // d

    def local(keys, segs, partial):
        ex = lambda x: jax.lax.all_to_all(x, AXIS, 0, 0, tiled=False)
        k, s = ex(keys[0]), ex(segs[0])
        # data dependencies keep the collectives in order and alive
        p = ex(partial[0] + (k[:, :1, None] + s[:, :1, None]).astype(jnp.float32))
        g = jax.lax.all_gather(p.sum(0), AXIS, tiled=True)
        return g[None]

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS)),
                               out_specs=P(AXIS)))
    sh = NamedSharding(mesh, P(AXIS))
    keys = jax.device_put(np.arange(d * d * n, dtype=np.int64).reshape(d, d, n), sh)
    segs = jax.device_put(np.zeros((d, d, n), np.int32), sh)
    partial = jax.device_put(np.ones((d, d, nseg, 16), np.float32), sh)
    return lambda i: fn(keys, segs, partial)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8192, help="global batch size")
    ap.add_argument("--hot", type=int, default=1, help="keys per slot per sample")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--devices", default="1,2,4,8")
    ap.add_argument("--type", default="DistributedSlotSparseEmbeddingHash",
                    choices=("DistributedSlotSparseEmbeddingHash",
                             "LocalizedSlotSparseEmbeddingHash"))
    args = ap.parse_args()
    # the same host memory setting as `python -m jctr.train` (JCTR_HOST_MEMORY_TUNING=0: off)
    reexec_with_malloc_tuning([os.path.abspath(__file__), *sys.argv[1:]])
    print(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}", flush=True)
    batches = make_batches(4, args.batch, args.hot)
    print(f"DLRM (Kaggle shape, {args.hot}-hot, {args.type}), global batch {args.batch}, "
          f"{jax.device_count()} {jax.devices()[0].platform} devices available; "
          f"{os.cpu_count()} cores")
    rows = []
    for d in (int(x) for x in args.devices.split(",")):
        r = bench_devices(d, batches, args.steps, args.warmup, args.type)
        rows.append(r)
        base = rows[0]["step_ms"]
        share = r["all_to_all_ms"] / r["step_ms"] if r["step_ms"] else 0.0
        print(f"  {d} device(s): {r['step_ms']:8.1f} ms/step  {r['samples_per_s']:9,.0f} "
              f"samples/s  all-to-all {r['all_to_all_ms']:6.1f} ms/step ({share:5.1%})  "
              f"overhead vs 1 device {r['step_ms'] / base:5.2f}x  "
              f"(full-buffer batches {r['full_buffer_batches']})", flush=True)
    print(json.dumps({"bench": "scaling", "batch": args.batch, "hot": args.hot,
                      "type": args.type, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
