"""A synthetic streaming-data tree: ``<out>/<YYYYMMDD>/<HHMM>/part-<i>.data`` Norm files with
power-law keys whose popular keys drift from day to day (new keys keep arriving), and a
done-file in each slice folder, for tests and ``scripts/bench_online.py``.

Example::

    write_stream(cfg, "data/stream", ["20190720", "20190721"], split_interval=360,
                 files_per_slice=2, samples_per_file=4096)
"""

from __future__ import annotations

import os

from jctr.config.schema import ModelConfig
from jctr.data.norm import write_norm_file
from jctr.data.tools.synthetic import generate_block, layout_from_config
from jctr.online.schedule import pass_folders


def write_stream(cfg: ModelConfig, out: str, days: list[str], *, split_interval: int,
                 files_per_slice: int, samples_per_file: int, drift: float = 0.05,
                 donefile: str = "DONE", alpha: float = 1.2, seed: int = 0,
                 vocab: list[int] | None = None, hourly: bool = False) -> list[str]:
    """Write every slice of ``days`` (one folder per ``split_interval`` minutes) with the
    config's slot layout (``vocab``: keys per slot, default the config's); day ``d``'s popular
    keys are those of day 0 moved ``d * drift`` of each slot's vocabulary down the ranks.
    Returns the slice folders in order."""
    layout = layout_from_config(cfg)
    if vocab is not None:
        layout["vocab"] = list(vocab)
    vocab = layout["vocab"]
    key_type, check = cfg.solver.input_key_type, cfg.data.check
    syn = cfg.data.synthetic
    signal = syn.signal if syn else 1.0
    folders = []
    slices = [name for group in pass_folders(split_interval, 1, hourly=hourly)
              for name in group]
    for d, day in enumerate(days):
        for s, hhmm in enumerate(slices):
            folder = os.path.join(out, day, hhmm)
            os.makedirs(folder, exist_ok=True)
            for i in range(files_per_slice):
                block = generate_block(
                    samples_per_file, **layout, key_type=key_type, alpha=alpha, seed=seed,
                    signal=signal, stream=(d * len(slices) + s) * 1000 + i,
                    rank_shift=int(d * drift * min(vocab)))
                write_norm_file(os.path.join(folder, f"part-{i}.data"), block,
                                key_type=key_type, check=check)
            if donefile:
                open(os.path.join(folder, donefile), "w").close()
            folders.append(folder)
    return folders


def main(argv: list[str] | None = None) -> int:
    """``python -m jctr.online.synthetic_stream --config online.yaml``: the streaming config's
    days as a synthetic stream under its ``train_data_dir`` (done-files included), and the
    model's validation set where its Data layer generates one."""
    import argparse

    from jctr.errors import run_command

    ap = argparse.ArgumentParser(prog="python -m jctr.online.synthetic_stream",
                                 description=main.__doc__)
    ap.add_argument("--config", required=True, help="streaming config (YAML or JSON)")
    ap.add_argument("--files-per-slice", type=int, default=1)
    ap.add_argument("--samples-per-file", type=int, default=4096)
    ap.add_argument("--drift", type=float, default=0.05,
                    help="share of each slot's keys the popular ones move per day")
    ap.add_argument("--force", action="store_true",
                    help="write into day folders that hold files already")
    args = ap.parse_args(argv)

    def go() -> None:
        from jctr.config.online import load_online_config
        from jctr.config.parser import load_config
        from jctr.data.records import DataError
        from jctr.data.tools.synthetic import generate_for_config
        from jctr.online.schedule import days

        cfg = load_online_config(args.config)
        model = load_config(cfg.model)
        todo = days(cfg.start_day, cfg.end_day)
        for day in todo:
            folder = os.path.join(cfg.train_data_dir, day)
            if not args.force and os.path.isdir(folder) and os.listdir(folder):
                raise DataError(f"{folder}: holds files already; give another train_data_dir "
                                "or --force to write over them")
        written = write_stream(model, cfg.train_data_dir, todo,
                               split_interval=cfg.split_interval,
                               files_per_slice=args.files_per_slice,
                               samples_per_file=args.samples_per_file, drift=args.drift,
                               donefile=cfg.data_donefile or None,
                               hourly=cfg.is_data_hourly_placed)
        generate_for_config(model, sets=("eval_source",))
        print(f"[jctr] {len(written)} slice folder(s) of {args.files_per_slice} x "
              f"{args.samples_per_file:,} samples for {len(todo)} day(s) under "
              f"{cfg.train_data_dir}")

    return run_command(go)


if __name__ == "__main__":
    import sys

    sys.exit(main())
