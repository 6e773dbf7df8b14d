"""Time-sliced training data (PaddlePaddle's streaming layout): ``<train_data_dir>/<YYYYMMDD>/
<HHMM>/`` folders of ``split_interval`` minutes, ``split_per_pass`` of them per pass, a folder
ready once its ``data_donefile`` exists.

Example::

    for day in days("20190720", "20190721"):
        for n, folders in enumerate(pass_folders(5, 2), 1):      # [["0000", "0005"], ...]
            paths = [os.path.join("data", day, f) for f in folders]
            wait_ready(paths, "to.hadoop.done", sleep_s=10)
            files = shard(data_files(paths, "to.hadoop.done"), rank, world)
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable

from jctr.data.records import DataError

MINUTES_PER_DAY = 24 * 60


def pass_folders(split_interval: int, split_per_pass: int, *, hourly: bool = False
                 ) -> list[list[str]]:
    """The folders (``HHMM``; ``hourly``: ``HH``, Paddle's ``is_data_hourly_placed``) of each
    pass of a day, in order: the day cut into slices of ``split_interval`` minutes,
    ``split_per_pass`` consecutive slices per pass (a last incomplete group is left out, as
    PaddlePaddle's ``get_online_pass_interval`` does). Hourly folders need slices of whole
    hours: Paddle would name several slices of one hour by the same folder and read it as
    often."""
    for name, v in (("split_interval", split_interval), ("split_per_pass", split_per_pass)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DataError(f"{name}: expected a positive integer, got {v!r}")
    if split_interval > MINUTES_PER_DAY or MINUTES_PER_DAY % split_interval:
        raise DataError(f"split_interval: {split_interval} minutes do not divide a day "
                        f"({MINUTES_PER_DAY} minutes) into equal slices")
    if hourly and split_interval % 60:
        raise DataError(f"split_interval: {split_interval} minutes, but hourly folders "
                        "(is_data_hourly_placed) hold whole hours: use a multiple of 60")
    starts = range(0, MINUTES_PER_DAY, split_interval)
    names = [f"{m // 60:02d}" if hourly else f"{m // 60:02d}{m % 60:02d}" for m in starts]
    passes = len(names) // split_per_pass
    if passes == 0:
        raise DataError(f"split_per_pass: {split_per_pass} slices of {split_interval} minutes "
                        "are more than a day holds")
    return [names[i * split_per_pass:(i + 1) * split_per_pass] for i in range(passes)]


def days(start_day: str, end_day: str) -> list[str]:
    """``YYYYMMDD`` days from ``start_day`` to ``end_day``, both included."""
    parsed = []
    for name, v in (("start_day", start_day), ("end_day", end_day)):
        try:
            parsed.append(datetime.datetime.strptime(str(v), "%Y%m%d").date())
        except ValueError:
            raise DataError(f"{name}: expected a date as YYYYMMDD, got {v!r}") from None
    first, last = parsed
    if last < first:
        raise DataError(f"end_day {end_day} is before start_day {start_day}")
    return [(first + datetime.timedelta(days=i)).strftime("%Y%m%d")
            for i in range((last - first).days + 1)]


def next_day(day: str, by: int = 1) -> str:
    """The ``YYYYMMDD`` day ``by`` days after ``day`` (before it where ``by`` < 0)."""
    d = datetime.datetime.strptime(day, "%Y%m%d").date() + datetime.timedelta(days=by)
    return d.strftime("%Y%m%d")


def wait_ready(folders: list[str], donefile: str | None, *, sleep_s: float,
               stop: threading.Event | None = None,
               report: Callable[[str], None] | None = None) -> None:
    """Return once every folder holds ``donefile`` (no ``donefile``: at once), checking again
    every ``sleep_s`` seconds and saying once which folder it waits for. ``stop`` (set from
    another thread) ends the wait with :class:`InterruptedError`."""
    if not donefile:
        return
    told = set()
    for folder in folders:
        path = os.path.join(folder, donefile)
        while not os.path.isfile(path):
            if report is not None and folder not in told:
                report(f"[jctr] waiting for {path} (checking every {sleep_s:g} s)")
                told.add(folder)
            if stop is not None:
                if stop.wait(sleep_s):
                    raise InterruptedError(f"stopped while waiting for {path}")
            else:
                time.sleep(sleep_s)


def data_files(folders: list[str], donefile: str | None = None) -> list[str]:
    """The data files of the folders (sorted within each folder; hidden files, sub-folders
    and the done-file left out). A folder that does not exist is an error naming it."""
    out = []
    for folder in folders:
        if not os.path.isdir(folder):
            raise DataError(f"{folder}: no such data folder")
        names = sorted(n for n in os.listdir(folder)
                       if not n.startswith((".", "_")) and n != donefile
                       and os.path.isfile(os.path.join(folder, n)))
        out += [os.path.join(folder, n) for n in names]
    return out


def shard(files: list[str], index: int, count: int) -> list[str]:
    """This process's share of a pass's files: every ``count``-th file from ``index`` (each
    file read by exactly one process; the shares differ by one file at most)."""
    if not 0 <= index < count:
        raise ValueError(f"process index {index} outside 0..{count - 1}")
    return files[index::count]
