"""Streaming training, pass by pass: ``python -m jctr.online --config online.yaml``.

For each day from ``start_day`` to ``end_day`` and each pass of the day (``split_per_pass``
folders of ``split_interval`` minutes), the runner waits for every folder's ``data_donefile``,
lists the pass's data files (any format the model's Data layer reads; a ``jax.distributed``
run's processes each read their share, as the core trainer's readers do), trains one epoch of
them with the model's :class:`jctr.train.trainer.Trainer` (one compiled step for the whole run),
scores the model's validation set, and prints one line per pass: day, pass, samples, samples/s,
mean loss, validation AUC. Every ``checkpoint_per_pass`` passes (and after a day's last pass) it
writes a checkpoint to ``<save_model_path>/<day>/<pass>/`` and then ``progress.json`` naming
it; a run started again resumes at the pass after that checkpoint.

Example::

    run = OnlineRun(load_online_config("online.yaml"))
    run.run()          # until end_day's last pass
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable

from jctr.config.online import OnlineConfig
from jctr.config.reader import ConfigError
from jctr.data.records import DataError, write_file_list
from jctr.online.schedule import data_files, days, pass_folders, wait_ready

PROGRESS = "progress.json"


class OnlineRun:
    """One streaming-training run (see the module docstring)."""

    def __init__(self, cfg: OnlineConfig, *, log: Callable[[str], None] | None = None,
                 stop: threading.Event | None = None):
        self.cfg = cfg
        self.log = log or (lambda s: print(s, flush=True))
        self.stop = stop or threading.Event()
        try:
            self.passes = pass_folders(cfg.split_interval, cfg.split_per_pass)
            self.days = days(cfg.start_day, cfg.end_day)
        except DataError as e:
            raise ConfigError("schedule", str(e), cfg.source) from None
        self.trainer = None
        self.passes_trained = 0

    # -- where a run stands ---------------------------------------------------------------
    def progress(self) -> dict | None:
        """The last checkpoint's record (day, pass, step, checkpoint), or None."""
        path = os.path.join(self.cfg.save_model_path, PROGRESS)
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
            return {"day": str(record["day"]), "pass": int(record["pass"]),
                    "step": int(record["step"]), "checkpoint": str(record["checkpoint"])}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: unreadable progress record ({e}); move it away to start "
                            "over") from None

    def _write_progress(self, day: str, n: int, step: int, checkpoint: str) -> None:
        path = os.path.join(self.cfg.save_model_path, PROGRESS)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"day": day, "pass": n, "step": step, "checkpoint": checkpoint}, f)
        os.replace(tmp, path)

    def _todo(self, done: dict | None) -> list[tuple[str, int]]:
        """(day, pass number) still to train, in order."""
        todo = [(d, n) for d in self.days for n in range(1, len(self.passes) + 1)]
        if done is not None:
            todo = [(d, n) for d, n in todo if (d, n) > (done["day"], done["pass"])]
        return todo

    # -- training -------------------------------------------------------------------------
    def _trainer(self, first_list: str):
        import dataclasses

        from jctr.config.parser import load_config
        from jctr.train.trainer import Trainer

        model = load_config(self.cfg.model)
        # one epoch of each pass's files; the first pass's list stands for the source
        solver = dataclasses.replace(model.solver, max_iter=None, num_epochs=1, snapshot=0)
        model = dataclasses.replace(model, solver=solver,
                                    data=dataclasses.replace(model.data, source=first_list))
        return Trainer(model, log=self.log, generate_data=False)

    def run(self) -> int:
        """Train every pass still to do; returns the number trained now."""
        os.makedirs(self.cfg.save_model_path, exist_ok=True)
        done = self.progress()
        todo = self._todo(done)
        if done is not None:
            self.log(f"[jctr] resuming after day {done['day']} pass {done['pass']} (iter "
                     f"{done['step']}, {done['checkpoint']})")
        if not todo:
            self.log(f"[jctr] nothing to train: every pass up to {self.cfg.end_day} is done")
            return 0
        lists = os.path.join(self.cfg.save_model_path, "_passes")
        os.makedirs(lists, exist_ok=True)
        for day, n in todo:
            folders = [os.path.join(self.cfg.train_data_dir, day, f)
                       for f in self.passes[n - 1]]
            wait_ready(folders, self.cfg.data_donefile, sleep_s=self.cfg.data_sleep_second,
                       stop=self.stop, report=self.log)
            files = data_files(folders, self.cfg.data_donefile)
            if not files:
                raise DataError(f"{', '.join(folders)}: no data files in the pass's folders")
            file_list = os.path.join(lists, f"{day}_{n:04d}.txt")
            write_file_list(file_list, files)
            if self.trainer is None:
                self.trainer = self._trainer(file_list)
                if done is not None:
                    self.trainer.restore_checkpoint(directory=os.path.dirname(
                        done["checkpoint"]))
            else:
                self.trainer.use_training_data(file_list)
            self._train_pass(day, n, len(files))
        return self.passes_trained

    def _train_pass(self, day: str, n: int, num_files: int) -> None:
        t = self.trainer
        before = len(t.history)
        t.fit()
        records = t.history[before:]
        train = [r["loss"] for r in records if r["kind"] == "train"]
        summary = next((r for r in records if r["kind"] == "summary"), {})
        evals = [r for r in records if r["kind"] == "eval"]
        first = next((r["iter"] for r in records if r["kind"] == "start"), 0)
        iters = int(summary.get("iters", 0))
        metric = ", ".join(f"{k} {v:.5f}" for k, v in (evals[-1] if evals else {}).items()
                           if isinstance(v, float) and k not in ("time", "lr"))
        self.log(f"[jctr] day {day} pass {n}/{len(self.passes)}: {num_files} file(s), {iters} "
                 f"iterations, {summary.get('samples_per_s', 0.0):,.0f} samples/s"
                 + (f", loss {train[-1]:.5f}" if train else "")
                 + (f"; validation {metric}" if metric else ""))
        self.passes_trained += 1
        last_of_day = n == len(self.passes)
        if n % self.cfg.checkpoint_per_pass == 0 or last_of_day:
            path = t.save_checkpoint_to(os.path.join(self.cfg.save_model_path, day, str(n)))
            import jax

            if jax.process_index() == 0:
                self._write_progress(day, n, first + iters, path)
            self.log(f"[jctr] checkpoint of day {day} pass {n} -> {path}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from jctr.errors import run_command

    ap = argparse.ArgumentParser(prog="python -m jctr.online", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="streaming config (YAML or JSON)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks with errors")
    args = ap.parse_args(argv)

    def go() -> None:
        from jctr.config.online import load_online_config

        OnlineRun(load_online_config(args.config)).run()

    return run_command(go, debug=args.debug)
