"""``python -m jctr.online --config online.yaml``: streaming training as PaddlePaddle does it.

For each day from ``start_day`` to ``end_day`` and each pass of the day, waits for the pass's
done-files, trains one epoch of its files, scores the validation set and prints one line per
pass (also in ``<save_model_path>/passes.jsonl``); saves checkpoints, the daily base model and
delta models, and resumes after the last checkpoint when started again
(:mod:`jctr.online.runner`, docs/streaming.md). JAX starts only once the config is read.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    import argparse

    from jctr.errors import run_command

    ap = argparse.ArgumentParser(prog="python -m jctr.online", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="streaming config (YAML or JSON)")
    ap.add_argument("--force", action="store_true",
                    help="take over a sparse_store another run owns (its rows are erased)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks with errors")
    args = ap.parse_args(argv)

    def go() -> None:
        from jctr.config.online import load_online_config
        from jctr.config.parser import load_config
        from jctr.online.runner import OnlineRun
        from jctr.runtime.devices import provide_host_devices
        from jctr.sharding.distributed import initialize_distributed, planned_process_count

        cfg = load_online_config(args.config)
        # the model's solver.gpu as host devices on CPU, before JAX starts its backends
        note = provide_host_devices(load_config(cfg.model).solver.gpu, planned_process_count())
        initialize_distributed()  # the cluster the environment describes, if any
        if note:
            import sys

            print(note, file=sys.stderr, flush=True)
        OnlineRun(cfg, force=args.force).run()

    return run_command(go, debug=args.debug)


def console_main(argv: list[str] | None = None) -> int:
    """``jctr online``: like ``python -m jctr.online`` it first re-executes itself with malloc
    tuned for XLA:CPU (:mod:`jctr.runtime.host_memory`), as the training command does."""
    from jctr.train.cli import run_tuned

    return run_tuned("jctr.online", main, argv)
