"""``python -m jctr.export --checkpoint DIR --output BUNDLE``: a checkpoint to an inference
bundle, without a trainer, a mesh or a training step. A checkpoint written on any number of
devices or processes exports on one device (tables are stored by key)."""

from __future__ import annotations

import argparse
import sys

from jctr.errors import run_command


def export_checkpoint(checkpoint: str, output: str, step: int | None = None,
                      report=None) -> str:
    """Write the bundle of checkpoint ``step`` of the directory ``checkpoint`` into
    ``output``; returns the bundle's path. ``step`` None: the best evaluation's snapshot where
    early stopping restored one (``best.json``), else the latest; ``report`` (a print
    function) is told which.

    Example::

        export_checkpoint("runs/checkpoints", "bundles/dlrm")
    """
    # here, not at the top: `python -m jctr.export --help` answers without starting JAX
    import jax

    from jctr.checkpoint.manager import Checkpointer, CheckpointError
    from jctr.config import ConfigError, parse_config
    from jctr.embedding.sparse_embedding import EmbeddingSpec
    from jctr.models.ctr import build_model
    from jctr.serving.bundle import check_bundle_target, export_bundle

    check_bundle_target(output)  # before the (slow) restore
    ckpt = Checkpointer(checkpoint)
    if step is None:
        best = ckpt.best()
        if best is not None and best["step"] in ckpt.steps():
            step = best["step"]
            why = (f"early stopping's best, validation {best.get('metric')} "
                   f"{best.get('value')}; --step for another")
        else:
            step = ckpt.latest_step()
            why = "the latest"
    else:
        why = "as asked"
    meta = ckpt.read_meta(step)
    if report is not None:
        report(f"[jctr] exporting the checkpoint of iter {step} ({why})")
    if not meta.get("config"):
        raise CheckpointError(f"{ckpt.directory}: the checkpoint carries no config")
    try:
        cfg = parse_config(meta["config"], require_solver=False)
    except ConfigError as e:
        raise CheckpointError(f"{ckpt.directory}: the config stored in the checkpoint does not "
                              f"parse ({e})") from None
    # a table sharded over devices may hold more keys than one device's share of it
    # (max_vocabulary_size_per_gpu): the one device here takes every stored row
    stored = {name: int(t.get("rows", 0)) for name, t in meta.get("tables", {}).items()}
    larger = {e.name: stored[e.name] for e in cfg.embeddings
              if stored.get(e.name, 0) > EmbeddingSpec.from_config(cfg, e).capacity}
    step_config, init_state = build_model(cfg, larger)
    with jax.default_device(jax.local_devices()[0]):
        fresh = init_state()  # no optimizer state: the model alone, on one device
    state, _ = ckpt.restore(fresh, step_config.specs, step)
    return export_bundle(cfg, state, output)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jctr.export", description=__doc__)
    ap.add_argument("--checkpoint", required=True,
                    help="checkpoint directory (the solver's <snapshot_prefix>checkpoints)")
    ap.add_argument("--output", required=True,
                    help="bundle folder to write: a new or empty folder, or a previous bundle "
                         "(replaced once the new one is complete)")
    ap.add_argument("--step", type=int, help="checkpoint step (default: early stopping's "
                                             "best where best.json names one, else the latest)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks with errors")
    args = ap.parse_args(argv)
    def report(line: str) -> None:
        print(line, file=sys.stderr)

    return run_command(lambda: print(export_checkpoint(args.checkpoint, args.output, args.step,
                                                       report=report)), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
