"""Synthetic CTR data with power-law (long-tail) keys and a planted signal.

Each slot draws key ranks from a truncated power law ``P(rank = k) ~ k^-alpha`` over its
vocabulary. Every key carries a hidden weight derived from a hash of the key, dense features carry
fixed hidden weights, and the label is a Bernoulli draw from the sigmoid of their sum, so a model
that learns the embeddings reaches a measurable AUC.

Command line (writes Norm files and their file lists)::

    python -m jctr.data.tools.synthetic --config configs/dlrm_synthetic.json
    python -m jctr.data.tools.synthetic --out data/synth --samples 100000 --slots 26 --dense 13
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys

import numpy as np

from jctr.data.norm import write_norm_file
from jctr.data.outputs import describe_contents, folder_contents
from jctr.data.records import DataError, RecordBlock, write_file_list
from jctr.ops import mix64

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def power_law_ranks(rng: np.random.Generator, n: int, vocab: int, alpha: float) -> np.ndarray:
    """n ranks in [0, vocab) with P(k) ~ (k+1)^-alpha (inverse CDF of the continuous law)."""
    u = rng.random(n)
    if abs(alpha - 1.0) < 1e-9:
        x = np.power(float(vocab) + 1.0, u)
    else:
        a = 1.0 - alpha
        x = np.power((np.power(vocab + 1.0, a) - 1.0) * u + 1.0, 1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, vocab - 1).clip(0)


def slot_keys(slot: int, ranks: np.ndarray, vocab_offsets: np.ndarray, key_type: str):
    """Distinct keys per slot: offsets (I32, as a vocabulary would give) or 63-bit hashes (I64)."""
    if key_type == "I32":
        return vocab_offsets[slot] + ranks
    with np.errstate(over="ignore"):
        h = mix64(ranks.astype(np.uint64) + np.uint64(slot + 1) * _GOLDEN)
    return (h >> np.uint64(1)).astype(np.int64)


def key_weights(keys: np.ndarray, seed: int) -> np.ndarray:
    """Hidden weight of every key, uniform in [-1, 1), from a hash (no table needed)."""
    with np.errstate(over="ignore"):
        h = mix64(keys.astype(np.uint64) ^ (np.uint64(seed) * _GOLDEN))
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53) * 2.0 - 1.0


def generate_block(num_samples: int, *, slot_nnz: list[int], vocab: list[int], dense_dim: int,
                   label_dim: int = 1, alpha: float = 1.2, key_type: str = "I64",
                   seed: int = 0, signal: float = 1.0, stream: int = 0,
                   rank_shift: int = 0) -> RecordBlock:
    """One block of samples. ``slot_nnz[s]`` is the most keys slot s holds (1 = one-hot;
    multi-hot slots draw 1..max keys per sample). ``rank_shift`` moves which keys are popular
    (rank k draws the key of rank ``k + rank_shift``, modulo the vocabulary): streams whose
    head drifts from day to day."""
    rng = np.random.default_rng([seed, stream])
    r = num_samples
    slots = len(slot_nnz)
    offsets = np.concatenate([[0], np.cumsum(vocab)[:-1]]).astype(np.int64)
    nnz = np.empty((r, slots), np.int32)
    for s, m in enumerate(slot_nnz):
        nnz[:, s] = 1 if m == 1 else rng.integers(1, m + 1, size=r)
    logit = np.full(r, -1.0)
    key_parts = []
    slot_of_key = np.tile(np.arange(slots), r).repeat(nnz.ravel())
    sample_of_key = np.repeat(np.arange(r), nnz.sum(axis=1))
    total = int(nnz.sum())
    ranks = np.empty(total, np.int64)
    keys = np.empty(total, np.int64)
    for s in range(slots):
        sel = slot_of_key == s
        ranks[sel] = (power_law_ranks(rng, int(sel.sum()), vocab[s], alpha)
                      + rank_shift) % vocab[s]
        keys[sel] = slot_keys(s, ranks[sel], offsets, key_type)
    del key_parts
    # slot contribution: mean hidden weight of its keys, head keys weigh more so a few steps
    # of training already find signal
    w = key_weights(keys, seed) * signal * 3.0 / np.sqrt(slots)
    per_slot = np.zeros(r * slots)
    np.add.at(per_slot, sample_of_key * slots + slot_of_key, w)
    per_slot /= np.maximum(nnz.ravel(), 1)
    logit += per_slot.reshape(r, slots).sum(axis=1)
    dense = rng.exponential(1.0, size=(r, dense_dim))
    dense = np.log1p(dense * 10.0).astype(np.float32)
    beta = np.random.default_rng([seed, 7919]).normal(0, 0.5, size=dense_dim)
    logit += (dense - dense.mean(axis=0, keepdims=True)) @ beta * signal
    p = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random((r, label_dim)) < p[:, None]).astype(np.float32)
    return RecordBlock(labels, dense, nnz, keys)


def write_dataset(out_dir: str, num_samples: int, *, num_files: int = 4, stream: int = 0,
                  key_type: str = "I64", check: str = "None", **kw) -> str:
    """Write ``num_files`` Norm files and ``_file_list.txt`` under ``out_dir``; returns the list."""
    os.makedirs(out_dir, exist_ok=True)
    per_file = np.full(num_files, num_samples // num_files)
    per_file[: num_samples % num_files] += 1
    files = []
    for i, n in enumerate(per_file):
        block = generate_block(int(n), key_type=key_type, stream=stream * 10_000 + i, **kw)
        path = os.path.join(out_dir, f"part_{i:04d}.data")
        write_norm_file(path, block, key_type=key_type, check=check)
        files.append(path)
    file_list = os.path.join(out_dir, "_file_list.txt")
    write_file_list(file_list, files)
    return file_list


def write_format(fmt: str, path: str, n: int, *, eval_n: int = 0, num_files: int = 4,
                 stream: int = 0, **kw) -> None:
    """Write synthetic one-hot data in Raw, Parquet or FeatureSpec form at ``path`` (the Raw
    file, the Parquet file list, or the feature-spec YAML with ``train`` and ``test``)."""
    import yaml

    from jctr.data.feature_spec import split_binary_spec, write_split_binary
    from jctr.data.parquet import write_parquet_dataset
    from jctr.data.raw import write_raw_file
    from jctr.data.records import slot_offsets

    vocab = kw["vocab"]
    offsets = slot_offsets(vocab)

    def part(count, strm):
        b = generate_block(count, key_type="I32", stream=strm, **kw)
        return b.label, b.dense, b.keys.reshape(count, -1) - offsets[None, :]

    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    if fmt == "Raw":
        label, dense, keys = part(n, stream)
        write_raw_file(path, label, dense, keys, float_label_dense=True)
    elif fmt == "Parquet":
        sizes = np.full(num_files, n // num_files)
        sizes[: n % num_files] += 1
        lst = write_parquet_dataset(folder, [part(int(c), stream * 10_000 + i)
                                             for i, c in enumerate(sizes) if c])
        if os.path.abspath(lst) != os.path.abspath(path):
            os.replace(lst, path)
    elif fmt == "FeatureSpec":
        chunks = {}
        for mapping, count, strm in (("train", n, stream), ("test", eval_n or n, stream + 1)):
            label, dense, keys = part(count, strm)
            chunks[mapping] = write_split_binary(folder, mapping, label, dense, keys, vocab)
        spec = split_binary_spec(kw.get("label_dim", 1), kw["dense_dim"], vocab, chunks)
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(spec, f, sort_keys=False)
    else:
        raise ValueError(f"unknown format {fmt!r}")


def layout_from_config(cfg) -> dict:
    """Slot layout (``slot_nnz``, ``vocab``, dims) of a parsed config's Data layer."""
    data = cfg.data
    syn = data.synthetic
    slot_nnz: list[int] = []
    for sp in data.sparse:
        m = 1 if sp.one_hot else min(sp.max_nnz, max(1, sp.max_feature_num_per_sample
                                                      // sp.slot_num))
        slot_nnz += [m] * sp.slot_num
    vocab = list(data.slot_size_array) or [syn.vocabulary_size if syn else 100_000] * len(slot_nnz)
    return dict(slot_nnz=slot_nnz, vocab=vocab, dense_dim=data.dense_dim,
                label_dim=data.label_dim)


def generation_targets(cfg, *, force: bool = False,
                       sets: tuple[str, ...] = ("source", "eval_source")
                       ) -> list[tuple[str, int, int]]:
    """``(path, samples, stream)`` of each set the config's ``synthetic`` clause would write now.

    A set is generated only where its path does not exist (``force``: always), and only into a
    folder that is new or empty, so that generation never overwrites files it did not write:
    a typo in a path next to real data is an error, not a silent replacement. The training and
    evaluation sets need folders of their own (their part files share names). ``sets``: which
    of the Data layer's ``source`` and ``eval_source`` to consider. Raises :class:`DataError`
    naming the path and what to do.
    """
    data, syn = cfg.data, cfg.data.synthetic
    if syn is None:
        return []
    candidates = [(data.source, syn.num_samples, 0, "source")]
    if data.format != "FeatureSpec":  # a feature specification holds both of its mappings
        candidates.append((data.eval_source, syn.eval_num_samples, 1, "eval_source"))
    todo = [(path, n, stream, field) for path, n, stream, field in candidates
            if field in sets and (force or not os.path.exists(path))]
    folders = [os.path.dirname(os.path.abspath(path)) for path, *_ in todo]
    if len(todo) == 2 and folders[0] == folders[1]:
        raise DataError(f"{folders[0]}: the Data layer's source and eval_source are both to be "
                        "generated into this folder, where their part files would overwrite "
                        "each other; give them folders of their own (e.g. .../train/ and "
                        ".../eval/)")
    for (path, _, _, field), folder in zip(todo, folders):
        if force or not os.path.isdir(folder):
            continue
        present = folder_contents(folder)
        if present:
            raise DataError(
                f"{path}: the Data layer's {field} does not exist, and its folder holds "
                f"{describe_contents(present)}; jctr generates synthetic data only "
                "into a new or empty folder. Fix the path, or drop the \"synthetic\" clause "
                "(--no-generate) to read existing data")
    return [(path, n, stream) for path, n, stream, _ in todo]


def generate_for_config(cfg, *, force: bool = False,
                        sets: tuple[str, ...] = ("source", "eval_source")) -> bool:
    """Write the config's synthetic train and eval sets (``sets``) where their paths are
    missing, under the rules of :func:`generation_targets`. A generation that fails part-way
    removes what it wrote. Returns True if anything was written.
    """
    todo = generation_targets(cfg, force=force, sets=sets)
    if not todo:
        return False
    syn, fmt = cfg.data.synthetic, cfg.data.format
    common = dict(alpha=syn.alpha, seed=syn.seed, signal=syn.signal, **layout_from_config(cfg))
    for path, n, stream in todo:
        with _own_folder(os.path.dirname(os.path.abspath(path)), keep_existing=force):
            if fmt == "Norm":
                out_dir = os.path.dirname(path) or "."
                print(f"[jctr] generating {n} synthetic samples into {out_dir}", file=sys.stderr)
                lst = write_dataset(out_dir, n, num_files=syn.num_files, stream=stream,
                                    key_type=cfg.solver.input_key_type, check=cfg.data.check,
                                    **common)
                if os.path.abspath(lst) != os.path.abspath(path):
                    os.replace(lst, path)
            else:
                print(f"[jctr] generating {n} synthetic {fmt} samples at {path}",
                      file=sys.stderr)
                write_format(fmt, path, n, eval_n=syn.eval_num_samples,
                             num_files=syn.num_files, stream=stream, **common)
    return True


class _own_folder:
    """Context for writing into a new or empty folder: on an error (or Ctrl-C) everything
    written there is removed again, so that a half-generated set never looks like data."""

    def __init__(self, folder: str, *, keep_existing: bool):
        self.folder = folder
        self.existed = os.path.isdir(folder)
        self.before = set(os.listdir(folder)) if self.existed else set()
        self.keep_existing = keep_existing

    def __enter__(self):
        os.makedirs(self.folder, exist_ok=True)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            return False
        for name in set(os.listdir(self.folder)) - self.before:
            full = os.path.join(self.folder, name)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(full)
        if not self.existed:
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jctr.data.tools.synthetic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="generate the Data layer's `synthetic` sets of this config")
    ap.add_argument("--force", action="store_true",
                    help="regenerate even if the lists exist, or write into a non-empty --out "
                         "folder, replacing files of the same names")
    ap.add_argument("--out", help="output folder (without --config)")
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--slots", type=int, default=26)
    ap.add_argument("--nnz", type=int, default=1, help="max keys per slot (1 = one-hot)")
    ap.add_argument("--dense", type=int, default=13)
    ap.add_argument("--vocab", type=int, default=100_000, help="distinct keys per slot")
    ap.add_argument("--alpha", type=float, default=1.2, help="power-law exponent")
    ap.add_argument("--key-type", choices=("I32", "I64"), default="I64")
    ap.add_argument("--format", choices=("Norm", "Raw", "Parquet", "FeatureSpec"),
                    default="Norm", help="Raw / Parquet / FeatureSpec are one-hot")
    ap.add_argument("--check", choices=("None", "Sum"), default="None")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.config:
        from jctr.config import load_config
        from jctr.errors import run_command

        return run_command(lambda: generate_for_config(load_config(args.config),
                                                       force=args.force) and None)
    if not args.out:
        ap.error("give --config or --out")
    from jctr.data.outputs import require_empty_folder
    from jctr.errors import run_command

    status = run_command(lambda: require_empty_folder(args.out, force=args.force))
    if status:
        return status
    if args.format != "Norm":
        if args.nnz != 1:
            ap.error(f"--format {args.format} is one-hot (--nnz 1)")
        name = {"Raw": "data.bin", "Parquet": "_file_list.txt",
                "FeatureSpec": "feature_spec.yaml"}[args.format]
        path = os.path.join(args.out, name)
        write_format(args.format, path, args.samples, num_files=args.files,
                     slot_nnz=[1] * args.slots, vocab=[args.vocab] * args.slots,
                     dense_dim=args.dense, alpha=args.alpha, seed=args.seed)
        print(path)
        return 0
    lst = write_dataset(args.out, args.samples, num_files=args.files, key_type=args.key_type,
                        check=args.check, slot_nnz=[args.nnz] * args.slots,
                        vocab=[args.vocab] * args.slots, dense_dim=args.dense,
                        alpha=args.alpha, seed=args.seed)
    print(lst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
