"""``python -m jctr.train --config FILE.json``: train from a HugeCTR-style JSON config."""

from __future__ import annotations

import argparse
import sys

from jctr.checkpoint.manager import CheckpointError
from jctr.checkpoint.model_files import ModelFileError
from jctr.config import ConfigError, load_config
from jctr.data.norm import DataError
from jctr.embedding.hash_table import TableFullError
from jctr.sharding.distributed import initialize_distributed
from jctr.sharding.plan import PlanError

_OVERRIDES = (
    # flag, solver field, type, help
    ("--max-iter", "max_iter", int, "training iterations (replaces num_epochs)"),
    ("--num-epochs", "num_epochs", int, "epochs over the training file list"),
    ("--batchsize", "batchsize", int, "training batch size"),
    ("--batchsize-eval", "batchsize_eval", int, "evaluation batch size"),
    ("--display", "display", int, "print progress every N iterations"),
    ("--eval-interval", "eval_interval", int, "evaluate every N iterations"),
    ("--eval-batches", "eval_batches", int, "batches per evaluation"),
    ("--seed", "seed", int, "random seed of initialisation and dropout"),
    ("--log-dir", "log_dir", str, "folder for metrics.jsonl (machine-readable progress)"),
    ("--compute-dtype", "compute_dtype", str, "float32, bfloat16 or float16"),
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m jctr.train",
        description="Train a CTR model from a HugeCTR-style JSON config (solver, optimizer, "
                    "layers). Progress goes to the terminal; --log-dir adds JSON lines.",
        epilog="Example: python -m jctr.train --config configs/dlrm_synthetic.json --max-iter 500")
    ap.add_argument("--config", required=True, help="JSON config file")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the latest checkpoint under the solver's "
                         "snapshot_prefix (state, RNG, schedule and data position)")
    ap.add_argument("--no-generate", action="store_true",
                    help="do not generate missing synthetic data (the Data layer's `synthetic`)")
    for flag, _, typ, hlp in _OVERRIDES:
        ap.add_argument(flag, type=typ, help=f"override solver: {hlp}")
    ap.add_argument("--gpu", help="override solver: devices, e.g. 0,1,2,3 (one host) or "
                                  "0,1;0,1 (two hosts); on CPU force devices with "
                                  "XLA_FLAGS=--xla_force_host_platform_device_count=N")
    return ap


def _parse_gpu_flag(text: str) -> tuple[tuple[int, ...], ...]:
    try:
        hosts = tuple(tuple(int(x) for x in h.split(",")) for h in text.split(";"))
    except ValueError:
        raise ConfigError("--gpu", f"expected device ids like 0,1,2,3 (hosts separated by ;), "
                          f"got {text!r}") from None
    if any(not h or min(h) < 0 for h in hosts):
        raise ConfigError("--gpu", f"expected non-negative device ids, got {text!r}")
    return hosts


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # before anything touches a device: join the cluster the environment describes
        initialize_distributed()
        cfg = load_config(args.config)
        overrides = {field: getattr(args, flag[2:].replace("-", "_"))
                     for flag, field, _, _ in _OVERRIDES
                     if getattr(args, flag[2:].replace("-", "_")) is not None}
        if "max_iter" in overrides:
            overrides.setdefault("num_epochs", None)
        if "num_epochs" in overrides and "max_iter" not in overrides:
            overrides["max_iter"] = None
        if args.gpu is not None:
            overrides["gpu"] = _parse_gpu_flag(args.gpu)
        if overrides.get("compute_dtype") not in (None, "float32", "float16", "bfloat16"):
            raise ConfigError("--compute-dtype", "expected float32, bfloat16 or float16")
        cfg = cfg.with_solver(**overrides)
        if cfg.solver.max_iter is None and cfg.solver.num_epochs is None:
            raise ConfigError("solver", "set max_iter or num_epochs (or --max-iter)", cfg.source)
        from jctr.train.trainer import Trainer

        trainer = Trainer(cfg, generate_data=not args.no_generate)
        if args.resume:
            trainer.restore_checkpoint()
        trainer.fit()
    except (ConfigError, DataError, TableFullError, CheckpointError, ModelFileError,
            PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def console_main() -> int:
    """The ``jctr-train`` command: like ``python -m jctr.train`` it first re-executes itself
    with malloc tuned for XLA:CPU (:mod:`jctr.ops.host_memory`)."""
    from jctr.ops.host_memory import reexec_with_malloc_tuning

    reexec_with_malloc_tuning(["-m", "jctr.train", *sys.argv[1:]])
    return main()


if __name__ == "__main__":
    sys.exit(main())
