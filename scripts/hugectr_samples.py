"""Train HugeCTR's own JSON configs unchanged, as a HugeCTR user would on their first day.

For every ``*.json`` in DIR (HugeCTR's ``samples/`` configs, 3.x configs, your own), this writes
data of the shape the config's Data layer declares at the paths it names, runs
``python -m jctr.train --config <it>`` for a few iterations in a folder of its own
(``DIR/_runs/<name>/``: relative paths resolve there, as they do for HugeCTR from the folder it
was started in), and prints one line per config: ran (loss of the last iteration) or refused
(jctr's one-line reason), the peak resident memory of the run against the memory plan jctr
printed before training, and the wall time.

    python scripts/hugectr_samples.py path/to/HugeCTR/samples/configs --iters 3
    python scripts/hugectr_samples.py DIR --only 'dlrm*' --json results.jsonl

Data: Norm configs get ``--samples`` records (default 4,096) in file lists at ``source`` /
``eval_source`` (with the ``check`` and ``input_key_type`` they name); Parquet configs a file
list, the files and ``_metadata.json``; Raw configs a file of exactly ``num_samples`` records
whose first ``--samples`` are generated and the rest a sparse hole (zeros that take no disk),
since HugeCTR reads ``num_samples`` records from it. Keys follow a power law over
``slot_size_array`` (per slot, Raw and Parquet) or the embedding's vocabulary. Files this script
wrote carry a ``.jctr-samples`` marker next to them; anything else at a named path is never
overwritten (an absolute path that exists is used as it is).

A run is stopped when the machine's free memory would run out (``--mem-limit``), reported as
killed with the figure reached, instead of letting the kernel kill it.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from jctr.data.norm import write_norm_file  # noqa: E402
from jctr.data.parquet import write_parquet_dataset  # noqa: E402
from jctr.data.raw import write_raw_file  # noqa: E402
from jctr.data.records import write_file_list  # noqa: E402
from jctr.data.tools.synthetic import generate_block  # noqa: E402

MARKER = ".jctr-samples"
PLAN_RE = re.compile(r"\[jctr\] memory plan: .*?([0-9.]+) (GiB|MiB|KiB|B) in all")
LOSS_RE = re.compile(r"iter\s+(\d+).*?loss\s+([0-9.eE+-]+|nan|inf)")
UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}


# ---- the shape a config declares ------------------------------------------------------------


def _data_layer(cfg: dict) -> dict:
    layers = cfg.get("layers") or []
    if not layers or not isinstance(layers[0], dict) or layers[0].get("type") != "Data":
        raise ValueError("layers[0] is not a Data layer")
    return layers[0]


def _sparse_inputs(data: dict) -> list[dict]:
    """The sparse inputs in 2.x (``sparse``) and 3.x (``sparse`` with ``nnz_per_slot``) form."""
    return [s for s in data.get("sparse", []) if isinstance(s, dict)]


def _slot_nnz(sp: dict) -> list[int]:
    slots = int(sp.get("slot_num", 1))
    per_slot = sp.get("nnz_per_slot")
    if isinstance(per_slot, list):
        return [max(1, int(v)) for v in per_slot]
    if isinstance(per_slot, int):
        return [max(1, per_slot)] * slots
    max_feat = int(sp.get("max_feature_num_per_sample", slots))
    max_nnz = int(sp.get("max_nnz", max_feat))
    return [max(1, min(max_nnz, max_feat // slots))] * slots


def _vocabularies(cfg: dict, data: dict, slots: int) -> list[int]:
    """Distinct keys per slot: the Data layer's or an embedding's ``slot_size_array``, else an
    even share of the embeddings' vocabulary (at most 100,000 a slot: a few thousand samples
    meet only so many keys anyway)."""
    sizes = data.get("slot_size_array")
    if isinstance(sizes, list) and len(sizes) == slots:
        return [int(v) for v in sizes]
    embs = [lay for lay in cfg.get("layers", [])[1:] if isinstance(lay, dict)
            and "sparse_embedding_hparam" in lay]
    per = []
    for e in embs:
        h = e["sparse_embedding_hparam"]
        if isinstance(h.get("slot_size_array"), list):
            per += [int(v) for v in h["slot_size_array"]]
    if len(per) == slots:
        return per
    return [100_000] * slots


def _count_devices(gpu) -> int:
    if isinstance(gpu, list) and gpu and all(isinstance(g, list) for g in gpu):
        return sum(len(g) for g in gpu)
    return len(gpu) if isinstance(gpu, list) else 1


# ---- writing data -----------------------------------------------------------------------------


def _owned(path: str) -> bool:
    return os.path.exists(path + MARKER)


def _claim(path: str, shape: dict) -> bool:
    """Whether to write ``path``: absent, or written earlier by this script for another shape
    (a file of someone else is used as it is)."""
    if not os.path.exists(path):
        return True
    if not _owned(path):
        return False
    with open(path + MARKER, encoding="utf-8") as f:
        return json.load(f) != shape


def _mark(path: str, shape: dict) -> None:
    with open(path + MARKER, "w", encoding="utf-8") as f:
        json.dump(shape, f)


def write_data(cfg: dict, samples: int, seed: int = 0) -> list[str]:
    """Write the train and eval data the config's Data layer names (cwd: the run folder);
    returns what was written."""
    data = _data_layer(cfg)
    solver = cfg.get("solver", {})
    fmt = data.get("format", "Norm")
    inputs = _sparse_inputs(data)
    slot_nnz = [n for sp in inputs for n in _slot_nnz(sp)]
    vocab = _vocabularies(cfg, data, len(slot_nnz))
    label_dim = int(data["label"].get("label_dim", 1)) if isinstance(data.get("label"),
                                                                     dict) else 1
    dense = data.get("dense", {})
    dense_dim = int(dense.get("dense_dim", 0)) if isinstance(dense, dict) else 0
    if isinstance(data.get("label"), list) or isinstance(dense, list):
        raise ValueError("label/dense given as lists: not generated by this script")
    key_type = solver.get("input_key_type", "I32")
    if fmt != "Norm":
        slot_nnz = [1] * len(slot_nnz)
    written = []
    sets = [("source", data.get("source"), data.get("num_samples"), 0),
            ("eval_source", data.get("eval_source"), data.get("eval_num_samples"), 1)]
    for _field, path, declared, stream in sets:
        if isinstance(path, list):
            path = path[0]
        if not isinstance(path, str):
            continue
        shape = {"format": fmt, "slot_nnz": slot_nnz, "vocab": vocab, "dense": dense_dim,
                 "label": label_dim, "key_type": key_type, "check": data.get("check", "None"),
                 "samples": samples, "declared": declared}
        if not _claim(path, shape):
            continue
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        n = samples if fmt != "Raw" else min(samples, int(declared))
        kw = dict(slot_nnz=slot_nnz, vocab=vocab, dense_dim=dense_dim, label_dim=label_dim,
                  alpha=1.2, seed=seed, signal=1.0)
        if fmt == "Norm":
            parts = os.path.join(folder, os.path.basename(path) + ".parts")
            os.makedirs(parts, exist_ok=True)
            files = []
            for i in range(4):
                block = generate_block(n // 4 + (i < n % 4), key_type=key_type,
                                       stream=stream * 100 + i, **kw)
                f = os.path.join(parts, f"part_{i}.data")
                write_norm_file(f, block, key_type=key_type, check=data.get("check", "None"))
                files.append(f)
            write_file_list(path, files)
        else:
            # per-slot ids where the Data layer gives slot_size_array, else global keys
            offsets = (np.concatenate([[0], np.cumsum(vocab)[:-1]]).astype(np.int64)
                       if isinstance(data.get("slot_size_array"), list)
                       else np.zeros(len(vocab), np.int64))

            def part(count, strm, offsets=offsets, kw=kw):
                b = generate_block(count, key_type="I32", stream=strm, **kw)
                return b.label, b.dense, b.keys.reshape(count, -1) - offsets[None, :]

            if fmt == "Raw":
                label, dn, keys = part(n, stream)
                write_raw_file(path, label, dn, keys,
                               float_label_dense=bool(data.get("float_label_dense", False)))
                record = 4 * (label_dim + dense_dim + len(slot_nnz))
                os.truncate(path, int(declared) * record)  # the rest: a hole of zeros
            else:
                lst = write_parquet_dataset(folder, [part(n // 2, stream * 100),
                                                     part(n - n // 2, stream * 100 + 1)])
                if os.path.abspath(lst) != os.path.abspath(path):
                    os.replace(lst, path)
        _mark(path, shape)
        written.append(path)
    return written


# ---- running one config ----------------------------------------------------------------------


def _rss_tree(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) << 10
            with open(f"/proc/{p}/task/{p}/children", encoding="ascii") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return total


def run_config(config: str, run_dir: str, iters: int, timeout: float, mem_limit: int,
               extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "jctr.train", "--config", os.path.abspath(config),
           "--max-iter", str(iters), "--display", "1", "--eval-interval", str(iters),
           "--eval-batches", "1", "--force", *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)  # jctr makes the devices a config names itself
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    peak, killed, status, usage = 0, None, None, None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # (Popen.poll would reap it)
        if pid:
            break
        rss = _rss_tree(proc.pid)
        peak = max(peak, rss)
        if rss > mem_limit:
            killed = f"stopped at {rss / 2**30:.1f} GiB resident (limit {mem_limit / 2**30:.1f})"
        elif time.time() - t0 > timeout:
            killed = f"stopped after {timeout:.0f} s"
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.1)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(5)
    peak = max(peak, usage.ru_maxrss << 10)
    text = "".join(out)
    plan = PLAN_RE.findall(text)
    plan_bytes = int(float(plan[-1][0]) * UNITS[plan[-1][1]]) if plan else None
    losses = LOSS_RE.findall(text)
    code = os.waitstatus_to_exitcode(status)
    if killed:
        outcome, reason = "killed", killed
    elif code == 0:
        outcome = "ran"
        reason = f"loss {losses[-1][1]} at iteration {losses[-1][0]}" if losses else ""
    else:
        outcome = "refused"
        errs = [ln for ln in text.splitlines() if ln.startswith("error")]
        reason = errs[-1] if errs else (text.strip().splitlines() or [f"exit {code}"])[-1]
    return {"config": os.path.basename(config), "outcome": outcome, "reason": reason,
            "exit": code, "peak_bytes": peak, "plan_bytes": plan_bytes,
            "seconds": round(time.time() - t0, 1), "output": text[-4000:]}


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="a folder of HugeCTR JSON configs")
    ap.add_argument("--iters", type=int, default=3, help="training iterations per config")
    ap.add_argument("--samples", type=int, default=4096, help="records written per data set")
    ap.add_argument("--only", default="*", help="glob of config file names to run")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per config")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ap.add_argument("--mem-limit", type=float, default=total * 0.85 / 2**30,
                    help="GiB resident at which a run is stopped (default 85%% of memory)")
    ap.add_argument("--json", help="append one JSON record per config to this file")
    ap.add_argument("--verbose", action="store_true", help="print each run's output")
    ap.add_argument("--train-args", default="",
                    help='more arguments for python -m jctr.train, e.g. "--gpu 0"')
    args = ap.parse_args(argv)
    configs = sorted(c for c in glob.glob(os.path.join(args.dir, "*.json"))
                     if fnmatch.fnmatch(os.path.basename(c), args.only))
    if not configs:
        ap.error(f"no *.json matching {args.only!r} in {args.dir}")
    print(f"{'config':36} {'outcome':8} {'peak GiB':>8} {'plan GiB':>8} {'ratio':>6} "
          f"{'s':>6}  detail", flush=True)
    results = []
    for config in configs:
        name = os.path.splitext(os.path.basename(config))[0]
        run_dir = os.path.join(args.dir, "_runs", name)
        os.makedirs(run_dir, exist_ok=True)
        with open(config, encoding="utf-8") as f:
            cfg = json.load(f)
        cwd = os.getcwd()
        try:
            os.chdir(run_dir)
            write_data(cfg, args.samples)
        except (ValueError, KeyError, TypeError) as e:
            res = {"config": os.path.basename(config), "outcome": "no-data", "reason": str(e),
                   "peak_bytes": 0, "plan_bytes": None, "seconds": 0.0}
        else:
            os.chdir(cwd)
            shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
            res = run_config(config, run_dir, args.iters, args.timeout,
                             int(args.mem_limit * 2**30), shlex.split(args.train_args))
        finally:
            os.chdir(cwd)
        res["devices"] = _count_devices(cfg.get("solver", {}).get("gpu", [0]))
        ratio = (f"{res['peak_bytes'] / res['plan_bytes']:.2f}"
                 if res.get("plan_bytes") else "-")
        print(f"{res['config']:36} {res['outcome']:8} {_gib(res['peak_bytes']):>8} "
              f"{_gib(res['plan_bytes']):>8} {ratio:>6} {res['seconds']:>6}  "
              f"{res['reason'][:200]}", flush=True)
        if args.verbose and "output" in res:
            print(res["output"])
        results.append(res)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(res) + "\n")
    ran = sum(r["outcome"] == "ran" for r in results)
    print(f"{ran} of {len(results)} configs ran")
    return 0 if ran == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
