"""``python -m jctr.export --checkpoint DIR --output BUNDLE``: a checkpoint to an inference bundle.
"""

from __future__ import annotations

import argparse
import sys

import jctr  # noqa: F401  (64-bit keys)
from jctr.checkpoint.manager import Checkpointer, CheckpointError
from jctr.checkpoint.model_files import ModelFileError
from jctr.config import ConfigError, parse_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jctr.export", description=__doc__)
    ap.add_argument("--checkpoint", required=True,
                    help="checkpoint directory (the solver's <snapshot_prefix>checkpoints)")
    ap.add_argument("--output", required=True, help="bundle folder to write")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    args = ap.parse_args(argv)
    try:
        from jctr.checkpoint.bundle import export_bundle
        from jctr.train.trainer import Trainer

        ckpt = Checkpointer(args.checkpoint)
        meta = ckpt.read_meta(args.step)
        if not meta.get("config"):
            raise CheckpointError(f"{args.checkpoint}: the checkpoint carries no config")
        cfg = parse_config(meta["config"], require_solver=False)
        trainer = Trainer(cfg, generate_data=False)
        trainer.restore_checkpoint(args.step, directory=args.checkpoint)
        path = export_bundle(trainer, args.output)
        print(path)
    except (CheckpointError, ModelFileError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
