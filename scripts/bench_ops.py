"""Throughput of each op: the jnp reference, the implementation the dispatch picks on this
platform, and (on GPU) the Pallas kernel, next to the machine's limit for the same bytes measured
in the same run (numpy gather / copy of the same rows).

    python scripts/bench_ops.py            # DLRM Kaggle shape: 8192 x 26 keys, dim 16
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jctr._x64  # noqa: F401  (64-bit keys)
from jctr.ops import bag as bag_ref
from jctr.ops import dispatch, hashing, interaction


def timeit(fn, *args, repeats: int = 7) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def np_time(fn, repeats: int = 7) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--slots", type=int, default=26)
    ap.add_argument("--hot", type=int, default=1)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--rows", type=int, default=5_600_000)
    args = ap.parse_args()
    platform = jax.default_backend()
    on_gpu = platform == "gpu"
    rng = np.random.default_rng(0)
    b, s, hot, d = args.batch, args.slots, args.hot, args.dim
    n = b * s * hot
    nseg = b * s
    values_np = rng.random((args.rows, d), dtype=np.float32)
    rows_np = rng.integers(0, args.rows, n).astype(np.int32)
    segs_np = np.repeat(np.arange(nseg, dtype=np.int32), hot)
    values, rows, segs = (jnp.asarray(x) for x in (values_np, rows_np, segs_np))
    rep = jnp.arange(n, dtype=jnp.int32)
    limit_gather = np_time(lambda: np.take(values_np, rows_np, axis=0))
    limit_copy = np_time(lambda: values_np[:n].copy())
    print(f"platform {platform}; {n:,} keys, dim {d}, table {args.rows:,} rows")
    print(f"machine limit: numpy gather {n / limit_gather / 1e6:,.1f} M rows/s "
          f"({n * d * 4 / limit_gather / 1e9:.2f} GB/s), numpy copy "
          f"{n * d * 4 / limit_copy / 1e9:.2f} GB/s")
    print(f"{'op':<34}{'impl':<12}{'M rows/s':>10}{'GB/s':>8}{'x gather limit':>16}")

    def report(op, impl, seconds, bytes_moved):
        print(f"{op:<34}{impl:<12}{n / seconds / 1e6:>10.1f}{bytes_moved / seconds / 1e9:>8.2f}"
              f"{limit_gather / seconds:>16.2f}", flush=True)

    moved = n * d * 4
    one_hot = hot == 1
    f_ref = jax.jit(lambda v, r, sg: bag_ref.embedding_bag_forward_reference(v, r, sg, nseg))
    f_dis = jax.jit(lambda v, r, sg: dispatch.embedding_bag_forward(v, r, sg, nseg,
                                                                    one_hot=one_hot))
    report("bag forward (gather + reduce)", "reference", timeit(f_ref, values, rows, segs), moved)
    report("bag forward (gather + reduce)", "dispatched", timeit(f_dis, values, rows, segs),
           moved)
    grad = jnp.ones((nseg, d), jnp.float32)
    g_ref = jax.jit(lambda g, sg, r: bag_ref.embedding_bag_backward_reference(g, sg, r, nseg))
    g_dis = jax.jit(lambda g, sg, r: dispatch.embedding_bag_backward(g, sg, r, nseg))
    report("bag backward (per-row sums)", "reference", timeit(g_ref, grad, segs, rep), moved)
    report("bag backward (per-row sums)", "dispatched", timeit(g_dis, grad, segs, rep), moved)
    if on_gpu:
        from jctr.ops import pallas_bag

        k = jax.jit(lambda v, r, sg: pallas_bag.bag_forward(v, r, sg, num_segments=nseg))
        report("bag forward (gather + reduce)", "pallas", timeit(k, values, rows, segs), moved)
        k = jax.jit(lambda g, sg, r: pallas_bag.bag_backward(g, sg, r, num_segments=nseg))
        report("bag backward (per-row sums)", "pallas", timeit(k, grad, segs, rep), moved)
    table_slots = 1 << int(2 * args.rows - 1).bit_length()
    keys = jnp.asarray(rng.integers(0, 2**62, args.rows), jnp.int64)
    slot_keys, _ = jax.jit(lambda t, k: hashing.find_slots(t, k, jnp.ones(k.shape, bool),
                                                           insert=True))(
        jnp.full((table_slots,), hashing.EMPTY_KEY), keys)
    q = keys[jnp.asarray(rows_np)]
    valid = jnp.ones(q.shape, bool)
    look_ref = jax.jit(lambda t, k, v: hashing.find_slots(t, k, v, insert=False)[1])
    look_dis = jax.jit(lambda t, k, v: dispatch.find_slots(t, k, v, insert=False)[1])
    report("hash lookup (64-bit keys)", "reference", timeit(look_ref, slot_keys, q, valid), n * 8)
    report("hash lookup (64-bit keys)", "dispatched", timeit(look_dis, slot_keys, q, valid), n * 8)
    # find-or-insert of a training batch: known keys plus ~10% new ones each call, into a
    # donated table as in the train step (otherwise copying the table dominates)
    step = jnp.arange(0, n, 10)
    batches = [q.at[step].set(jnp.asarray(rng.integers(2**62, 2**63 - 1, step.size),
                                          jnp.int64)) for _ in range(16)]
    table = [jnp.array(slot_keys)]
    for impl, fns in (("reference", hashing), ("dispatched", dispatch)):
        ins = jax.jit(lambda t, k, v, f=fns.find_slots: f(t, k, v, insert=True),
                      donate_argnums=0)
        it = iter(batches[:8] if impl == "reference" else batches[8:])

        def one(ins=ins, it=it):
            table[0], slots = ins(table[0], next(it), valid)
            return slots

        report("hash find-or-insert (10% new)", impl, timeit(one, repeats=6), n * 8)
    dense = jnp.asarray(rng.random((b, d), dtype=np.float32))
    emb = jnp.asarray(rng.random((b, s, d), dtype=np.float32))
    w = jnp.ones((b, interaction.interaction_output_dim(d, s)), jnp.float32)

    def fb(fn):  # w is an argument: a closed-over constant would be folded at compile time
        return jax.jit(jax.grad(lambda x, y, w: jnp.sum(fn(x, y) * w), argnums=(0, 1)))

    imoved = b * (s + 1) * d * 4
    t_ref = timeit(fb(interaction.dot_interaction_reference), dense, emb, w)
    t_dis = timeit(fb(dispatch.dot_interaction), dense, emb, w)
    print(f"{'interaction fwd+bwd':<34}{'reference':<12}{b / t_ref / 1e6:>10.2f}M samples/s "
          f"{imoved / t_ref / 1e9:.2f} GB/s")
    if not on_gpu:  # the XLA formulation the CPU used before the native kernel

        def xla_interaction(x, y):
            feats = jnp.concatenate([x[:, None, :], y], axis=1)
            return interaction.assemble(x, interaction.pair_dots_xla(feats))

        t_xla = timeit(fb(xla_interaction), dense, emb, w)
        print(f"{'interaction fwd+bwd':<34}{'xla':<12}{b / t_xla / 1e6:>10.2f}M samples/s "
              f"{imoved / t_xla / 1e9:.2f} GB/s  ({t_ref / t_xla:.2f}x the reference)")
    print(f"{'interaction fwd+bwd':<34}{'dispatched':<12}{b / t_dis / 1e6:>10.2f}M samples/s "
          f"{imoved / t_dis / 1e9:.2f} GB/s  ({t_ref / t_dis:.2f}x the reference)")
    if not on_gpu:
        print("Pallas kernels run only in interpret mode on CPU (a correctness tool, not timed).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
