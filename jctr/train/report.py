"""``report.html`` of a run: matplotlib plots of its ``metrics.jsonl`` (loss, validation
metrics, throughput over time, table fill) with the run's summary and config.

Written into the run's ``log_dir`` at the end of every run, and on demand with
``python -m jctr.report RUN_DIR`` (``jctr report RUN_DIR``). The PNGs go to
``report_files/`` beside it. A ``report.html`` that jctr did not write is never replaced.

Example::

    path = write_report("runs/logs")      # -> "runs/logs/report.html"
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
import time

from jctr.errors import UserError, run_command
from jctr.runtime.direct_io import replace_file

MARKER = '<meta name="generator" content="jctr report">'
WIDTH, HEIGHT, DPI = 800, 360, 100


class ReportError(UserError, ValueError):
    """The run folder has no readable log, or its report cannot be written."""


def read_records(log_dir: str) -> list[dict]:
    path = os.path.join(log_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ReportError(f"{path}: no such file (a run writes it when solver.log_dir is set)")
    records = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise ReportError(f"{path}: line {n}: byte {e.start + 1} is not UTF-8 text (a "
                                  "damaged log; remove the line or the file)") from None
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ReportError(f"{path}: line {n} is not JSON ({e.msg})") from None
            if isinstance(rec, dict):
                records.append(rec)
    return records


def as_trained(records: list[dict]) -> list[dict]:
    """The records of the iterations the model went through: a resumed run starts again at
    its checkpoint's iteration, and what the interrupted run logged after that iteration was
    trained again, so its records are dropped (else the plots draw those iterations twice)."""
    out: list[dict] = []
    top = None  # the highest iteration among out's records
    for r in records:
        start = r.get("iter") if r.get("kind") == "start" else None
        # only a start below what was logged drops records: a streaming run starts every
        # pass where the last one ended, and a pass over all records at each start made a
        # months-old run's report take minutes every pass
        if isinstance(start, int) and top is not None and top > start:
            out = [o for o in out if not (_iteration(o) is not None and o["iter"] > start)]
            top = max((o["iter"] for o in out if _iteration(o) is not None), default=None)
        out.append(r)
        if _iteration(r) is not None and (top is None or r["iter"] > top):
            top = r["iter"]
    return out


def _iteration(record: dict) -> int | float | None:
    it = record.get("iter")
    return it if isinstance(it, (int, float)) else None


def _series(records, kind, key, x="iter"):
    pts = [(r[x], r[key]) for r in records if r.get("kind") == kind
           and isinstance(r.get(key), (int, float)) and isinstance(r.get(x), (int, float))]
    return _thinned([p[0] for p in pts], [p[1] for p in pts])


POINTS = 4000  # a line's points at most: a plot 860 pixels wide shows no more


def _thinned(x: list, y: list) -> tuple[list, list]:
    """Every k-th point of a long series (a months-long run logs millions), the last kept."""
    k = -(-len(x) // POINTS)
    if k <= 1:
        return x, y
    keep = list(range(0, len(x), k))
    if keep[-1] != len(x) - 1:
        keep.append(len(x) - 1)
    return [x[i] for i in keep], [y[i] for i in keep]


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
    ax.grid(alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _plots(records: list[dict], out: str) -> list[tuple[str, str]]:
    """(file name, caption) of every plot drawn."""
    plots = []
    x, y = _series(records, "train", "loss")
    ex, ey = _series(records, "epoch", "train_loss")
    if x or ex:
        plt, fig, ax = _figure()
        if x:
            ax.plot(x, y, label="training loss (display windows)", lw=1)
        if ex:
            ax.plot(ex, ey, "o-", label="mean training loss per epoch")
        ax.set_xlabel("iteration")
        ax.set_ylabel("loss")
        ax.legend()
        _save(plt, fig, os.path.join(out, "loss.png"))
        plots.append(("loss.png", "Training loss"))
    evals = [r for r in records if r.get("kind") == "eval"]
    metrics = sorted({k for r in evals for k, v in r.items()
                      if isinstance(v, (int, float)) and k not in ("iter", "time", "epoch", "lr")})
    if metrics:
        plt, fig, ax = _figure()
        for m in metrics:
            mx, my = _series(records, "eval", m)
            ax.plot(mx, my, "o-", label=m)
        ax.set_xlabel("iteration")
        ax.set_ylabel("validation")
        ax.legend()
        _save(plt, fig, os.path.join(out, "validation.png"))
        plots.append(("validation.png", "Validation metrics"))
    trains = [r for r in records if r.get("kind") == "train" and "samples_per_s" in r]
    if trains:
        t0 = trains[0]["time"]
        plt, fig, ax = _figure()
        ax.plot(*_thinned([r["time"] - t0 for r in trains],
                          [r["samples_per_s"] for r in trains]), lw=1)
        ax.set_xlabel("seconds since the first display")
        ax.set_ylabel("samples/s")
        _save(plt, fig, os.path.join(out, "throughput.png"))
        plots.append(("throughput.png", "Training throughput over time"))
    tables = sorted({name for r in evals for name in (r.get("embedding_norms") or {})})
    if tables:
        plt, fig, ax = _figure()
        use_fill = all("fill" in (r.get("embedding_norms") or {}).get(t, {})
                       for r in evals for t in tables)
        key = "fill" if use_fill else "rows"
        for t in tables:
            pts = [(r["iter"], r["embedding_norms"][t][key]) for r in evals
                   if t in (r.get("embedding_norms") or {})]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=t)
        ax.set_xlabel("iteration")
        ax.set_ylabel("rows in use / capacity" if use_fill else "rows in use")
        ax.legend()
        _save(plt, fig, os.path.join(out, "tables.png"))
        plots.append(("tables.png", "Hash-table fill per table"))
    return plots


def _summary_rows(records: list[dict]) -> list[tuple[str, str]]:
    rows = []
    summaries = [r for r in records if r.get("kind") == "summary"]
    if summaries:
        s = summaries[-1]
        rows.append(("iterations trained (last run)", f"{s.get('iters', '?'):,}"))
        if isinstance(s.get("samples_per_s"), (int, float)):
            rows.append(("mean samples/s (last run)", f"{s['samples_per_s']:,.0f}"))
        if isinstance(s.get("compile_s"), (int, float)):
            rows.append(("first step (compilation)", f"{s['compile_s']:.1f} s"))
        if isinstance(s.get("elapsed_s"), (int, float)):
            rows.append(("training time", f"{s['elapsed_s']:.1f} s"))
    evals = [r for r in records if r.get("kind") == "eval"]
    if evals:
        last = evals[-1]
        rows.append(("last validation", ", ".join(
            f"{k} {v:.5f}" for k, v in last.items() if isinstance(v, float)
            and k not in ("time", "lr")) + f" (iter {last.get('iter')})"))
        if any("AUC" in r for r in evals):
            best = max((r for r in evals if "AUC" in r), key=lambda r: r["AUC"])
            rows.append(("best validation AUC", f"{best['AUC']:.5f} (iter {best.get('iter')})"))
    for r in records:
        if r.get("kind") == "test":
            rows.append((f"test set {r.get('set')}", ", ".join(
                f"{k} {v:.5f}" for k, v in r.items() if isinstance(v, float) and k != "time")))
        if r.get("kind") == "early_stop":
            rows.append(("early stopping", f"at iter {r.get('iter')}; best iter "
                                           f"{r.get('best_iter')}"))
    return rows


def write_report(log_dir: str) -> str:
    """Write ``<log_dir>/report.html`` (and its PNGs) from the run's ``metrics.jsonl``;
    returns the path."""
    from jctr.version import __version__

    records = as_trained(read_records(log_dir))
    path = os.path.join(log_dir, "report.html")
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            if MARKER not in f.read(4096):
                raise ReportError(f"{path}: exists and was not written by jctr; not replaced")
    out = os.path.join(log_dir, "report_files")
    os.makedirs(out, exist_ok=True)
    plots = _plots(records, out)
    starts = [r for r in records if r.get("kind") == "start"]
    config = starts[-1].get("config") if starts else None
    esc = html.escape
    parts = [
        "<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">", MARKER,
        f"<title>jctr run report: {esc(os.path.abspath(log_dir))}</title>",
        "<style>body{font-family:sans-serif;max-width:860px;margin:2em auto}"
        "table{border-collapse:collapse}td{padding:2px 12px 2px 0}"
        "pre{background:#f4f4f4;padding:8px;overflow:auto;font-size:12px}</style>",
        "</head><body>",
        f"<h1>Run report</h1><p>{esc(os.path.abspath(log_dir))}<br>jctr {esc(__version__)}, "
        f"written {esc(time.strftime('%Y-%m-%d %H:%M:%S'))}, {len(records)} log records</p>",
        "<h2>Summary</h2><table>",
        *[f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in _summary_rows(records)],
        "</table>",
    ]
    for name, caption in plots:
        parts.append(f"<h2>{esc(caption)}</h2><img src=\"report_files/{name}\" "
                     f"width=\"{WIDTH}\" height=\"{HEIGHT}\" alt=\"{esc(caption)}\" "
                     "onload=\"this.dataset.rendered=this.naturalWidth+'x'+this.naturalHeight\">")
    if config is not None:
        parts.append("<h2>Config</h2><pre>" + esc(json.dumps(config, indent=1), quote=False)
                     + "</pre>")
    parts.append("</body></html>")
    replace_file(path, "\n".join(parts).encode("utf-8"))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jctr.report",
                                 description="Write report.html (plots of loss, validation "
                                             "metrics, throughput, table fill; summary; config) "
                                             "of a run's log folder.")
    ap.add_argument("run_dir", help="the run's solver.log_dir (holding metrics.jsonl)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks with errors")
    args = ap.parse_args(argv)
    return run_command(lambda: print(write_report(args.run_dir)), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
