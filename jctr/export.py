"""``python -m jctr.export --checkpoint DIR --output BUNDLE``: a checkpoint to an inference bundle.
"""

from __future__ import annotations

import argparse
import sys

import jctr  # noqa: F401  (64-bit keys)
from jctr.checkpoint.manager import Checkpointer, CheckpointError
from jctr.config import ConfigError, parse_config
from jctr.errors import run_command


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jctr.export", description=__doc__)
    ap.add_argument("--checkpoint", required=True,
                    help="checkpoint directory (the solver's <snapshot_prefix>checkpoints)")
    ap.add_argument("--output", required=True,
                    help="bundle folder to write: a new or empty folder, or a previous bundle "
                         "(replaced once the new one is complete)")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks with errors")
    args = ap.parse_args(argv)
    return run_command(lambda: _export(args), debug=args.debug)


def _export(args: argparse.Namespace) -> None:
    from jctr.checkpoint.bundle import check_bundle_target, export_bundle
    from jctr.train.trainer import Trainer

    check_bundle_target(args.output)  # before the (slow) restore
    ckpt = Checkpointer(args.checkpoint)
    meta = ckpt.read_meta(args.step)
    if not meta.get("config"):
        raise CheckpointError(f"{args.checkpoint}: the checkpoint carries no config")
    try:
        cfg = parse_config(meta["config"], require_solver=False)
    except ConfigError as e:
        raise CheckpointError(f"{args.checkpoint}: the config stored in the checkpoint does "
                              f"not parse ({e})") from None
    # the stored config's devices may not exist here: the tables load by key on one device
    cfg = cfg.with_solver(gpu=[[0]])
    trainer = Trainer(cfg, generate_data=False)
    trainer.restore_checkpoint(args.step, directory=args.checkpoint)
    print(export_bundle(trainer, args.output))


if __name__ == "__main__":
    sys.exit(main())
