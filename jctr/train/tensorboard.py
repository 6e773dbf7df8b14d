"""TensorBoard event files of a run, written by tensorboardX beside ``metrics.jsonl``.

Every record the trainer logs becomes scalars under ``<log_dir>/tensorboard``:
``train/loss``, ``train/samples_per_s``, ``train/step_time_ms``, ``train/lr``,
``train/epoch_loss``, ``validation/<metric>`` (AUC, LogLoss, ...), ``test/<set>/<metric>``,
``tables/<name>/rows``, ``tables/<name>/fill`` (rows / capacity) and ``tables/<name>/mean_norm``
(and ``evicted``, ``refused`` for a table that evicts).
``tensorboard --logdir <log_dir>`` shows them.

Example::

    board = TensorBoardLog("runs/logs")
    board.write({"kind": "train", "iter": 100, "loss": 0.45, "samples_per_s": 30000.0})
"""

from __future__ import annotations

import os
import sys


def _summary_writer_class():
    """tensorboardX's ``SummaryWriter``, imported without torch where torch is not loaded yet.

    tensorboardX imports torch whenever it is installed, only to accept torch tensors (3-4 s
    of a process's start on a 2-core machine); jctr hands it Python floats. A ``None`` entry in
    ``sys.modules`` makes that ``import torch`` fail the way it does where torch is absent
    (which tensorboardX handles), for the length of this import only.
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class TensorBoardLog:
    """Scalars of a run's records (see the module docstring)."""

    def __init__(self, log_dir: str):
        SummaryWriter = _summary_writer_class()  # noqa: N806 (a class)
        self.path = os.path.join(log_dir, "tensorboard")
        self.writer = SummaryWriter(self.path, flush_secs=10)

    def _scalar(self, tag: str, value, step) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and step is not None:
            self.writer.add_scalar(tag, float(value), int(step))

    def write(self, entry: dict) -> None:
        kind, step = entry.get("kind"), entry.get("iter")
        if kind == "train":
            for key in ("loss", "samples_per_s", "step_time_ms", "lr"):
                self._scalar(f"train/{key}", entry.get(key), step)
        elif kind == "epoch":
            self._scalar("train/epoch_loss", entry.get("train_loss"), step)
        elif kind in ("eval", "test"):
            prefix = "validation" if kind == "eval" else f"test/{entry.get('set', 'test')}"
            for key, value in entry.items():
                if key not in ("kind", "time", "iter", "set", "epoch", "lr",
                               "embedding_norms"):
                    self._scalar(f"{prefix}/{key}", value, step)
            self._scalar("train/lr", entry.get("lr"), step)
            for name, t in (entry.get("embedding_norms") or {}).items():
                for key in ("rows", "fill", "mean_norm", "evicted", "refused"):
                    self._scalar(f"tables/{name}/{key}", t.get(key), step)
        elif kind == "lr":
            self._scalar("train/lr", entry.get("lr"), step)
        else:
            return
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
