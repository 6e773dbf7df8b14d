"""Streaming training, pass by pass: ``python -m jctr.online --config online.yaml``.

For each day from ``start_day`` to ``end_day`` and each pass of the day (``split_per_pass``
folders of ``split_interval`` minutes), the runner waits for every folder's ``data_donefile``,
lists the pass's data files (any format the model's Data layer reads), trains one epoch of them
with the model's :class:`jctr.train.trainer.Trainer` (one compiled step for the whole run),
scores the model's validation set, and prints one line per pass: day, pass, files, iterations,
samples/s, loss, validation metrics. (One process: the statistics below are not yet gathered
across a ``jax.distributed`` run, which is refused.) Every key's show and click are counted as
the batches are read (:mod:`jctr.online.feature_stats`, ``table_parameters``); at the end of
each day the shrink decays them and deletes keys from the statistics and the tables, freeing
their rows. Every ``checkpoint_per_pass`` passes (and after a day's last pass) it writes a
checkpoint to ``<save_model_path>/<day>/<pass>/`` with ``feature_stats.npz`` beside it, then
``progress.json`` naming it; a run started again resumes at the pass after that checkpoint.

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
from jctr.online.feature_stats import FeatureStats, ScoreRule, ShrinkRule
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
        tp = cfg.table_parameters
        self._score = ScoreRule(nonclk_coeff=tp.nonclk_coeff, click_coeff=tp.click_coeff)
        self._shrink = ShrinkRule(show_click_decay_rate=tp.show_click_decay_rate,
                                  delete_threshold=tp.delete_threshold,
                                  delete_after_unseen_days=tp.delete_after_unseen_days)
        self.stats: list[FeatureStats] = []  # per embedding table, once the trainer exists

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
                self._start_statistics()
                if done is not None:
                    self.trainer.restore_checkpoint(directory=os.path.dirname(
                        done["checkpoint"]))
                    self._load_statistics(os.path.dirname(done["checkpoint"]))
            else:
                self.trainer.use_training_data(file_list)
            self._train_pass(day, n, len(files))
        return self.passes_trained

    # -- feature statistics and the daily shrink -------------------------------------------
    def _start_statistics(self) -> None:
        import jax

        if jax.process_count() > 1:
            raise ConfigError("table_parameters", "feature statistics and the daily shrink run "
                              "in one process in this version (each process would decide on "
                              "its own share of the data)", self.cfg.source)
        t = self.trainer
        self.stats = [FeatureStats(self._score) for _ in t.specs]
        label_dim = t.cfg.data.label_dim

        def observe(batch) -> None:  # one show per key of a sample, a click per label 1
            b = batch.label.shape[0]
            for spec, stats in zip(t.specs, self.stats):
                keys = batch.keys[spec.input_index]
                segs = batch.segments[spec.input_index]
                valid = segs < b * spec.slot_num
                sample = segs[valid] // spec.slot_num
                real = batch.mask[sample]
                click = (batch.label.reshape(b, label_dim)[sample, 0] > 0.5)[real]
                stats.observe(keys[valid][real], 1.0, click.astype(float))

        t.batch_hooks.append(observe)

    def _save_statistics(self, folder: str) -> None:
        import numpy as np

        arrays = {f"{i}/{k}": v for i, st in enumerate(self.stats)
                  for k, v in st.state_dict().items()}
        tmp = os.path.join(folder, "feature_stats.tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, os.path.join(folder, "feature_stats.npz"))

    def _load_statistics(self, folder: str) -> None:
        import numpy as np

        path = os.path.join(folder, "feature_stats.npz")
        try:
            with np.load(path, allow_pickle=False) as f:
                for i, st in enumerate(self.stats):
                    st.load_state_dict({k: f[f"{i}/{k}"] for k in
                                        ("keys", "show", "click", "unseen_days",
                                         "since_delta")})
        except (OSError, KeyError, ValueError) as e:
            raise DataError(f"{path}: feature statistics unreadable ({e})") from None

    def _shrink_day(self, day: str) -> None:
        """The end of a day: statistics age and decay; deleted keys leave the tables."""
        t = self.trainer
        for i, (spec, stats) in enumerate(zip(t.specs, self.stats)):
            deleted = stats.shrink(self._shrink)
            rows = t.drop_keys(i, deleted) if deleted.size else None
            self.log(f"[jctr] shrink at the end of day {day}: {spec.name}: {deleted.size:,} "
                     f"key(s) deleted, {len(stats):,} with statistics"
                     + (f", {rows:,} rows in use of {spec.capacity:,}" if rows is not None
                        else ""))

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
        if last_of_day:
            self._shrink_day(day)
        if n % self.cfg.checkpoint_per_pass == 0 or last_of_day:
            folder = os.path.join(self.cfg.save_model_path, day, str(n))
            path = t.save_checkpoint_to(folder)
            import jax

            if jax.process_index() == 0:
                self._save_statistics(folder)
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
