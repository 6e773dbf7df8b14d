"""Sets of int64 keys on the host: numpy's ``np.unique`` / ``union1d`` / ``isin`` against
:mod:`jctr.ops.host_sort`'s sorted ``unique`` / ``isin`` / ``first_repeat``, in one run.

numpy 2.3 and later find a plain ``np.unique``'s values with a hash set (and so do
``union1d``, ``intersect1d``, ``setdiff1d`` and ``isin``, which call it); jctr sorts. Each
round draws fresh keys (uniform or power law, alpha 1.2, over ``--vocab`` ranks, spread over
62 bits as hashed keys are) for the sets jctr meets:

1. a step's distinct keys (the Kafka publisher's ``on_batch``): ``--batch`` keys;
2. a publish: the keys published so far (``--published``) joined with ten steps' keys;
3. which of a table's ``--table`` keys are among ``--batch`` wanted keys (a multi-process
   delta export);
4. a sparse model file's duplicate check (the HPS load): ``--model`` distinct keys.

Prints milliseconds per call (median of the rounds) and numpy's time over jctr's.

    python scripts/bench_key_sets.py
    python scripts/bench_key_sets.py --rounds 3 --model 40000000
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jctr.data.tools.synthetic import power_law_ranks  # noqa: E402
from jctr.ops.host_sort import first_repeat, isin, union_sorted, unique  # noqa: E402
from scripts.bench_hps import cpu_name  # noqa: E402


def draw(rng: np.random.Generator, kind: str, n: int, vocab: int) -> np.ndarray:
    ranks = rng.integers(0, vocab, n) if kind == "uniform" else power_law_ranks(rng, n, vocab,
                                                                                 1.2)
    return (ranks.astype(np.int64) * 2654435761 + 17) % (1 << 62)


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8192 * 26)
    ap.add_argument("--published", type=int, default=2_000_000)
    ap.add_argument("--table", type=int, default=2_000_000)
    ap.add_argument("--model", type=int, default=4_000_000)
    ap.add_argument("--vocab", type=int, default=10_000_000)
    args = ap.parse_args(argv)
    print(f"# {cpu_name()}, numpy {np.__version__}; median of {args.rounds} rounds, fresh "
          "keys each")
    rng = np.random.default_rng(0)
    for kind in ("uniform", "power-law"):
        cases = {
            "a step's distinct keys": (
                lambda kind=kind: (draw(rng, kind, args.batch, args.vocab),),
                np.unique, unique),
            "a publish's union": (
                lambda kind=kind: (unique(draw(rng, "uniform", args.published, 1 << 40)),
                                   np.concatenate([draw(rng, kind, args.batch, args.vocab)
                                                   for _ in range(10)])),
                lambda a, b: np.union1d(a, np.unique(b)),
                lambda a, b: union_sorted(a, unique(b))),
            "a table's keys among the wanted": (
                lambda kind=kind: (draw(rng, "uniform", args.table, 1 << 40),
                                   draw(rng, kind, args.batch, args.vocab)),
                np.isin, isin),
            "a model file's duplicate check": (
                lambda: (rng.permutation(unique(draw(rng, "uniform", args.model, 1 << 40))),),
                lambda k: np.unique(k).size != k.size, first_repeat),
        }
        for name, (make, theirs, ours) in cases.items():
            t_np, t_jctr = [], []
            for _ in range(args.rounds):
                data = make()  # made before the timing
                t_np.append(timed(theirs, *data))
                t_jctr.append(timed(ours, *data))
            a, b = float(np.median(t_np)), float(np.median(t_jctr))
            print(f"{kind:9s} {name:34s} numpy {a * 1e3:9.1f} ms   jctr {b * 1e3:8.1f} ms   "
                  f"ratio {a / b:6.1f}x")


if __name__ == "__main__":
    main()
