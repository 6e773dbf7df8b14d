"""``python -m jctr.train --config FILE.json``: train from a HugeCTR-style JSON config."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from jctr.config import ConfigError, load_config, override_optimizer, override_solver
from jctr.errors import run_command


def _iterations_or_epoch(text: str) -> int | str:
    if text == "epoch":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of iterations or \"epoch\", got "
                                         f"{text!r}") from None


_OVERRIDES = (
    # flag, solver field, type, help
    ("--max-iter", "max_iter", int, "training iterations (replaces num_epochs)"),
    ("--num-epochs", "num_epochs", int, "epochs over the training file list"),
    ("--batchsize", "batchsize", int, "training batch size"),
    ("--batchsize-eval", "batchsize_eval", int, "evaluation batch size"),
    ("--display", "display", int, "print progress every N iterations"),
    ("--eval-interval", "eval_interval", _iterations_or_epoch,
     "evaluate every N iterations, or \"epoch\""),
    ("--eval-batches", "eval_batches", int, "batches per evaluation"),
    ("--seed", "seed", int, "random seed of initialisation and dropout"),
    ("--log-dir", "log_dir", str, "folder for metrics.jsonl (machine-readable progress)"),
    ("--compute-dtype", "compute_dtype", str, "float32, bfloat16 or float16"),
    ("--snapshot", "snapshot", int, "save a checkpoint every N iterations (0: never)"),
    ("--snapshot-prefix", "snapshot_prefix", str, "checkpoints go to <prefix>checkpoints"),
    ("--nan-policy", "nan_policy", str, "stop (default) or skip a batch whose loss is not "
                                        "finite"),
    ("--snapshot-keep", "snapshot_keep", int, "checkpoints kept (the oldest go first)"),
    ("--eval-metrics", "eval_metrics", lambda t: [m for m in t.split(",") if m],
     "comma-separated metrics, e.g. AUC,LogLoss (AUC:0.8025 stops at that AUC)"),
    ("--input-key-type", "input_key_type", str, "I32 or I64: the key width of the data files"),
)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other jctr error
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _ArgumentParser(
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
    ap.add_argument("--force", action="store_true",
                    help="start afresh in a snapshot prefix that holds another run's checkpoints "
                         "(they are deleted once this run's first snapshot is written)")
    ap.add_argument("--debug", action="store_true",
                    help="show tracebacks and library logs with errors")
    for flag, _, typ, hlp in _OVERRIDES:
        ap.add_argument(flag, type=typ, help=f"override solver: {hlp}")
    ap.add_argument("--lr", type=float,
                    help="override the optimizer's learning_rate (in its <type>_hparam object; "
                         "embeddings with an optimizer of their own keep theirs)")
    ap.add_argument("--gpu", help="override solver: devices, e.g. 0,1,2,3 (one host) or "
                                  "0,1;0,1 (two hosts); on CPU force devices with "
                                  "XLA_FLAGS=--xla_force_host_platform_device_count=N")
    return ap


def _parse_gpu_flag(text: str) -> list[list[int]]:
    try:
        return [[int(x) for x in h.split(",")] for h in text.split(";")]
    except ValueError:
        raise ConfigError("--gpu", f"expected device ids like 0,1,2,3 (hosts separated by ;), "
                          f"got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: _train(args), debug=args.debug)


def apply_flags(cfg, args: argparse.Namespace):
    """``cfg`` with the solver and optimizer fields the command line overrides (validated like
    the file; an error names the flag)."""
    overrides, flags = {}, {}
    for flag, field, _, _ in _OVERRIDES:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            overrides[field], flags[field] = value, flag
    if args.gpu is not None:
        overrides["gpu"], flags["gpu"] = _parse_gpu_flag(args.gpu), "--gpu"
    if args.lr is not None:
        cfg = override_optimizer(cfg, {"learning_rate": args.lr}, names={"learning_rate": "--lr"})
    return override_solver(cfg, overrides, names=flags)


def _train(args: argparse.Namespace) -> None:
    # before anything touches a device: join the cluster the environment describes
    from jctr.runtime.devices import provide_host_devices  # JAX: not for --help
    from jctr.sharding.distributed import initialize_distributed, planned_process_count

    cfg = apply_flags(load_config(args.config), args)
    # before JAX starts its backends: the host devices solver.gpu names (CPU platform)
    note = provide_host_devices(cfg.solver.gpu, planned_process_count())
    initialize_distributed()
    import jax

    if note and jax.default_backend() == "cpu" and jax.process_index() == 0:
        print(note, file=sys.stderr, flush=True)
    from jctr.train.hooks import end_run
    from jctr.train.trainer import Trainer

    trainer = Trainer(cfg, generate_data=not args.no_generate, force=args.force)
    if args.resume:
        trainer.restore_checkpoint()
    trainer.fit()
    end_run(trainer.hooks)  # e.g. the Kafka sink's last delivery


def console_main(argv: list[str] | None = None) -> int:
    """The ``jctr-train`` command (and ``jctr train``): like ``python -m jctr.train`` it first
    re-executes itself with malloc tuned for XLA:CPU (:mod:`jctr.runtime.host_memory`)."""
    return run_tuned("jctr.train", main, argv)


def run_tuned(module: str, command: Callable[[list[str]], int],
              argv: list[str] | None = None) -> int:
    """A console command that is ``python -m <module>``: re-executed as that with malloc tuned
    for XLA:CPU (:mod:`jctr.runtime.host_memory`), then ``command(argv)``'s exit status."""
    from jctr.runtime.host_memory import reexec_with_malloc_tuning

    argv = sys.argv[1:] if argv is None else argv
    reexec_with_malloc_tuning(["-m", module, *argv])
    return end_process(command(argv))


def end_process(status: int) -> int:
    """``status`` for ``sys.exit`` at the end of a training command; in a multi-process run
    process 0 ends inside (:func:`jctr.sharding.distributed.end_process`)."""
    distributed = sys.modules.get("jctr.sharding.distributed")  # not loaded for --help (JAX)
    return status if distributed is None else distributed.end_process(status)


if __name__ == "__main__":
    sys.exit(end_process(main()))
