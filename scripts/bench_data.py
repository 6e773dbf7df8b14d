"""Reader throughput per format, next to what DLRM training consumes and a raw read.

For each format the same synthetic samples (26 one-hot slots with Criteo Kaggle cardinalities
capped at 1M, 13 dense) are written once; then the reader's batches/s at batch 8192 (parsing,
validation and batch packing included) are timed, together with a plain sequential read of the
same files' bytes (np.fromfile) in the same run, and the training step's rate (the jctr DLRM
step of scripts/bench_train.py, measured here unless --train-rate is given). Reader and raw read
alternate for --passes passes over files in the page cache; the table gives medians, and
"best/best" the ratio of the fastest raw pass to the fastest reader pass. The raw read's rate
swings by up to 3x between passes and runs (page faults of its fresh destination, depending on
what the heap holds), so "copy/reader" also compares with reading the bytes into one reused
8 MiB buffer: the floor of any read, with no destination to fault in. "batch/file B" is the
bytes of the batch arrays a reader writes per byte of file it reads: multi-hot batches are padded
to ``max_feature_num_per_sample`` keys (int64) with an int32 segment each, 2.4x the bytes of the
file here, and writing them alone costs about as much as the raw read.

    python scripts/bench_data.py --samples 262144
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jctr._x64  # noqa: E402,F401  (64-bit keys)
from jctr.config import parse_config  # noqa: E402
from jctr.data.loader import open_dataset  # noqa: E402
from jctr.data.tools.synthetic import write_dataset, write_format  # noqa: E402
from jctr.runtime.host_memory import reexec_with_malloc_tuning  # noqa: E402
from scripts.make_configs import KAGGLE_CAPPED  # noqa: E402

BATCH = 8192


def data_config(fmt: str, source: str, n: int, hot: int, check: str = "None") -> dict:
    slots = len(KAGGLE_CAPPED)
    layer = {"name": "data", "type": "Data", "format": fmt, "source": source,
             "eval_source": source, "check": check,
             "label": {"top": "label", "label_dim": 1},
             "dense": {"top": "dense", "dense_dim": 13},
             "sparse": [{"top": "data1", "type": "DistributedSlot",
                         "max_feature_num_per_sample": slots * hot, "max_nnz": hot,
                         "slot_num": slots}]}
    if fmt in ("Raw", "Parquet"):
        layer["slot_size_array"] = KAGGLE_CAPPED
    if fmt == "Raw":
        layer.update(num_samples=n, eval_num_samples=n, float_label_dense=True)
    return {"optimizer": {"type": "SGD"}, "layers": [
        layer,
        {"name": "e", "type": "DistributedSlotSparseEmbeddingHash", "bottom": "data1",
         "top": "e", "sparse_embedding_hparam": {"max_vocabulary_size_per_gpu": 10,
                                                 "embedding_vec_size": 4}},
        {"name": "r", "type": "Reshape", "bottom": "e", "top": "r", "leading_dim": slots * 4},
        {"name": "fc", "type": "InnerProduct", "bottom": "r", "top": "fc",
         "fc_param": {"num_output": 1}},
        {"name": "loss", "type": "BinaryCrossEntropyLoss", "bottom": ["fc", "label"],
         "top": "loss"}]}


def reader_pass(cfg_dict: dict, source: str) -> tuple[float, int]:
    """Samples/s of one pass of the reader over the source (batches of BATCH), and the bytes
    of one batch's arrays."""
    cfg = parse_config(cfg_dict, require_solver=False)
    ds = open_dataset(source, cfg.data, "I64")
    t = time.perf_counter()
    n, nbytes = 0, 0
    for b in ds.batches(BATCH, epochs=1):
        n += b.num_valid
        nbytes = sum(x.nbytes for f in b for x in (f if isinstance(f, tuple) else (f,)))
    return n / (time.perf_counter() - t), nbytes


def copy_pass(files: list[str], n: int, buf: np.ndarray) -> float:
    """Samples/s of reading the same bytes into one reused, already faulted buffer: the floor
    of any read (a page-cache copy)."""
    t = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            got = fh.readinto(buf)
            while got:
                got = fh.readinto(buf)
    return n / (time.perf_counter() - t)


def raw_pass(files: list[str], n: int) -> float:
    """Samples/s of reading the same files' bytes into fresh arrays (np.fromfile)."""
    t = time.perf_counter()
    total = sum(np.fromfile(f, np.uint8).size for f in files)
    del total
    return n / (time.perf_counter() - t)


def train_rate(hot: int = 1) -> float:
    """The fastest training rate (bfloat16 compute) the readers have to keep up with."""
    from scripts.bench_train import interleaved, jctr_runner, make_batches

    run = jctr_runner(make_batches(2, BATCH, hot), "bfloat16")
    times = interleaved({"jctr": run}, steps=5, warmup=2, block=5)["jctr"]
    return BATCH / float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=262_144)
    ap.add_argument("--train-rate", type=float, help="samples/s training consumes one-hot "
                    "(skip measuring it)")
    ap.add_argument("--train-rate-10hot", type=float, help="the same for 10-hot batches")
    ap.add_argument("--dir", help="where to write the data (default: a temporary folder)")
    ap.add_argument("--passes", type=int, default=5, help="passes of reader and raw read")
    args = ap.parse_args()
    # the same host memory setting as `python -m jctr.train` (JCTR_HOST_MEMORY_TUNING=0: off)
    reexec_with_malloc_tuning([os.path.abspath(__file__), *sys.argv[1:]])
    print(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}", flush=True)
    n = args.samples
    root = args.dir or tempfile.mkdtemp(prefix="jctr_bench_data_")
    try:
        kw = dict(vocab=KAGGLE_CAPPED, dense_dim=13, seed=0)
        one_hot = dict(slot_nnz=[1] * len(KAGGLE_CAPPED), **kw)
        cases = []
        norm = write_dataset(os.path.join(root, "norm"), n, num_files=4, key_type="I64", **one_hot)
        cases.append(("Norm one-hot", "Norm", norm, 1,
                      glob.glob(os.path.join(root, "norm", "*.data"))))
        norm_check = write_dataset(os.path.join(root, "norm_sum"), n, num_files=4, key_type="I64",
                                   check="Sum", **one_hot)
        cases.append(("Norm one-hot, check Sum", "Norm", norm_check, 1,
                      glob.glob(os.path.join(root, "norm_sum", "*.data"))))
        multi = write_dataset(os.path.join(root, "norm10"), n // 4, num_files=4, key_type="I64",
                              slot_nnz=[10] * len(KAGGLE_CAPPED), **kw)
        cases.append(("Norm multi-hot (1-10 keys)", "Norm", multi, 10,
                      glob.glob(os.path.join(root, "norm10", "*.data"))))
        raw = os.path.join(root, "raw", "data.bin")
        write_format("Raw", raw, n, **one_hot)
        cases.append(("Raw", "Raw", raw, 1, [raw]))
        pq = os.path.join(root, "parquet", "_file_list.txt")
        write_format("Parquet", pq, n, num_files=4, **one_hot)
        cases.append(("Parquet", "Parquet", pq, 1,
                      glob.glob(os.path.join(root, "parquet", "*.parquet"))))
        spec = os.path.join(root, "spec", "feature_spec.yaml")
        write_format("FeatureSpec", spec, n, eval_n=BATCH, **one_hot)
        cases.append(("FeatureSpec split binary", "FeatureSpec", spec, 1,
                      glob.glob(os.path.join(root, "spec", "train", "*.bin"))))
        consume = {1: args.train_rate or train_rate(1),
                   10: args.train_rate_10hot or train_rate(10)}
        print(f"training consumes {consume[1]:,.0f} samples/s one-hot and {consume[10]:,.0f} "
              f"10-hot (DLRM, batch {BATCH}); multi-hot data is compared with the 10-hot step")
        print(f"{'format':<28}{'reader samples/s':>17}{'x training':>11}{'raw read':>12}"
              f"{'raw/reader':>11}{'best/best':>10}{'copy/reader':>12}{'batch/file B':>13}")
        buf = np.ones(8 << 20, np.uint8)
        for name, fmt, source, hot, files in cases:
            samples = n // 4 if hot > 1 else n
            cfg = data_config(fmt, source, samples, hot, "Sum" if "Sum" in name else "None")
            rates, bases, copies = [], [], []
            file_bytes = sum(os.path.getsize(f) for f in files) / samples
            for _ in range(args.passes):  # interleaved, so all see the same machine state
                rate, batch_bytes = reader_pass(copy.deepcopy(cfg), source)
                rates.append(rate)
                bases.append(raw_pass(files, samples))
                copies.append(copy_pass(files, samples, buf))
            rate, base = float(np.median(rates)), float(np.median(bases))
            print(f"{name:<28}{rate:>17,.0f}{rate / consume[hot]:>11.1f}{base:>12,.0f}"
                  f"{base / rate:>11.1f}{max(bases) / max(rates):>10.1f}"
                  f"{float(np.median(copies)) / rate:>12.1f}"
                  f"{batch_bytes / BATCH / file_bytes:>13.1f}", flush=True)
    finally:
        if not args.dir:  # the folder it made (its data: several GB at the default size)
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
