"""What a run shows while it trains: on a terminal a tqdm progress bar (iteration, loss,
samples/s, elapsed, ETA) with the log lines printed above it; elsewhere (CI logs, files) plain
lines only. The first step's time (compilation) is reported apart, and the samples/s of the
display lines count steady training only.

Example::

    progress = Progress(total=1000, start=0, write=print, bar=None)   # bar: a TTY decides
    progress.first_step_done(12.3)
    progress.update(done=100, loss=0.45, rate=30000.0)
    progress.close()
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


def format_seconds(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Progress:
    """Progress of one ``fit`` (see the module docstring). ``total``: the iteration the run
    stops at (``max_iter``, or for an epoch run the epochs times the batches in one), or None
    (no ETA). Early stopping may end a run before it."""

    def __init__(self, total: int | None, start: int, write: Callable[[str], None],
                 bar: bool | None = None):
        self.total = total
        self.start = start
        self._write = write
        self.t0 = time.perf_counter()
        self.steady_t0: float | None = None  # after the first (compiling) step
        self.steady_from = start
        self.compile_s: float | None = None
        if bar is None:
            bar = sys.stderr.isatty()
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="it", dynamic_ncols=True,
                            file=sys.stderr, leave=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} "
                                       "[{elapsed}<{remaining}]{postfix}")

    def write(self, line: str) -> None:
        """A log line, above the bar when there is one."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            self._write(line)

    def first_step_done(self, seconds: float) -> None:
        self.compile_s = seconds
        self.steady_t0 = time.perf_counter()
        self.steady_from = self.start + 1
        if self.bar is not None:
            self.bar.update(1)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def eta(self, done: int) -> float | None:
        if not self.total or self.steady_t0 is None or done <= self.steady_from:
            return None
        per_iter = (time.perf_counter() - self.steady_t0) / (done - self.steady_from)
        return max(0.0, (self.total - done) * per_iter)

    def tick(self, done: int) -> None:
        """One more iteration (the bar only)."""
        if self.bar is not None and done > self.bar.n:
            self.bar.update(done - self.bar.n)

    def suffix(self, done: int) -> str:
        eta = self.eta(done)
        return f"  elapsed {format_seconds(self.elapsed())}" + (
            f"  ETA {format_seconds(eta)}" if eta is not None else "")

    def update(self, done: int, loss: float, rate: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.5f}, {rate:,.0f} samples/s", refresh=False)
            self.tick(done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StepMeter:
    """The clock of one ``fit``: the first step timed apart (it compiles), then samples/s and
    ms/step over the window since the last display line, and the run's totals."""

    def __init__(self, batchsize: int, progress: Progress):
        self.batchsize = batchsize
        self.progress = progress
        self.t0 = time.perf_counter()
        self._window_t, self._window_n = self.t0, 0

    def stepped(self, done: int, metrics) -> None:
        """After dispatching iteration ``done``; the first waits for its step."""
        self._window_n += self.batchsize
        if self.progress.compile_s is not None:
            self.progress.tick(done)
            return
        import jax

        jax.block_until_ready(metrics)
        self.progress.first_step_done(time.perf_counter() - self.t0)
        self.progress.write(f"[jctr] first step (its first batch read and placed) "
                            f"{self.progress.compile_s:.1f} s")
        self._window_t, self._window_n = time.perf_counter(), 0

    def display(self, done: int, max_iter: int | None, loss: float, skipped: int
                ) -> tuple[str, float, float]:
        """The display line of iteration ``done``, with samples/s and ms per step over the
        window since the last one (which starts a new window); the bar shows them too."""
        now = time.perf_counter()
        steps = max(self._window_n // self.batchsize, 1)
        rate = self._window_n / max(now - self._window_t, 1e-9)
        step_ms = 1e3 * (now - self._window_t) / steps
        self._window_t, self._window_n = now, 0
        self.progress.update(done, loss, rate)
        line = (f"[jctr] iter {done}" + (f"/{max_iter}" if max_iter else "")
                + f"  loss {loss:.5f}  {rate:,.0f} samples/s"
                + (f"  ({skipped} non-finite batches skipped)" if skipped else "")
                + self.progress.suffix(done))
        return line, rate, step_ms

    def totals(self, trained: int) -> dict[str, float | None]:
        """The run's rates: over all of it, and after the first step (``steady``)."""
        elapsed = time.perf_counter() - self.t0
        compile_s = self.progress.compile_s
        steady = elapsed - (compile_s or 0.0)
        return {"samples_per_s": trained * self.batchsize / max(elapsed, 1e-9),
                "steady_samples_per_s": (max(trained - 1, 0) * self.batchsize / steady
                                         if steady > 0 else 0.0),
                "compile_s": compile_s, "elapsed_s": elapsed}


def final_line(summary) -> str:
    """The line a ``fit`` ends with (of a :class:`jctr.train.hooks.FitSummary`)."""
    line = (f"[jctr] done: {summary.iterations} iterations in "
            f"{format_seconds(summary.elapsed_s)}"
            + (f" (first step {summary.compile_s:.1f} s)" if summary.compile_s is not None
               else "") + f", {summary.steady_samples_per_s:,.0f} samples/s after it")
    if not summary.validation:
        return line
    label = (f"; restored best (iter {summary.restored_best}): validation "
             if summary.restored_best is not None else "; validation ")
    return line + label + ", ".join(f"{k} {v:.5f}" for k, v in summary.validation.items())
