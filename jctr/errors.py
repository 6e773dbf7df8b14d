"""Errors a user can fix, and how every jctr command reports them.

Every error a user can trigger (a bad config value, a data file that breaks its format, a
damaged checkpoint, a folder jctr will not write into) derives from :class:`UserError` and names
the file, field or JSON path and what was expected. Commands run their work through
:func:`run_command`: a user error is one line on stderr and exit status 2, never a traceback.

Example::

    def main(argv=None) -> int:
        args = parser.parse_args(argv)
        return run_command(lambda: train(args), debug=args.debug)
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from collections.abc import Callable

EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 1
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

# optional packages -> the pyproject extra that brings them
OPTIONAL_MODULES = {"redis": "serving", "hiredis": "serving", "rocksdict": "serving",
                    "starlette": "serving", "uvicorn": "serving",
                    "prometheus_client": "serving", "tritonclient": "dev",
                    "mkdocs": "docs", "torch": "bench"}


class UserError(Exception):
    """Something the user can fix; the message is complete on one line (file, field, what was
    expected)."""


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C, so that snapshots in flight finish or are removed."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "(no message)"


def run_command(action: Callable[[], int | None], *, debug: bool = False) -> int:
    """Run a command's work; map every way it can end to one stderr line and an exit status.

    ``0`` (or ``action``'s own status), ``2`` for a :class:`UserError` or an operating-system
    error naming its file (disk full, permission denied), ``130`` for Ctrl-C, ``143`` for SIGTERM
    and ``1`` for an internal error (``debug`` prints its traceback)."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    if not debug:
        _quiet_library_logs()
    try:
        status = action()
        return 0 if status is None else int(status)
    except UserError as e:
        _report(debug, f"error: {_one_line(e)}")
        return EXIT_USER_ERROR
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        _report(debug, f"error: {where}{_one_line(e.strerror or e)}")
        return EXIT_USER_ERROR
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        extra = OPTIONAL_MODULES.get(top)
        if extra is None:
            _report(debug, f"error: internal error (ModuleNotFoundError: {_one_line(e)}); "
                           "rerun with --debug for the traceback and please report it")
            return EXIT_INTERNAL_ERROR
        _report(debug, f"error: this command needs the Python package {top!r}, which comes "
                       f"with jctr's \"{extra}\" extra: pip install \"jctr[{extra}]\" (from a "
                       f"checkout: pip install -e \".[{extra}]\")")
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        _report(debug, "interrupted")
        return EXIT_INTERRUPTED
    except Terminated:
        _report(debug, "terminated (SIGTERM)")
        return EXIT_TERMINATED
    except Exception as e:  # noqa: BLE001 - the last line of defence of a command
        _report(debug, f"error: internal error ({type(e).__name__}: {_one_line(e)[:400]}); "
                       "rerun with --debug for the traceback and please report it")
        return EXIT_INTERNAL_ERROR
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _report(debug: bool, line: str) -> None:
    if debug and sys.exc_info()[0] is not None:
        traceback.print_exc()
    print(line, file=sys.stderr, flush=True)


def _quiet_library_logs() -> None:
    """Orbax and TensorStore log through absl, errors of background saves with tracebacks;
    jctr reports those itself in one line (``--debug`` shows the library's logs)."""
    import logging

    logging.getLogger("absl").setLevel(logging.CRITICAL)
    # the write tasks of a failed asynchronous save end with errors nobody retrieves (disk full)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    # TensorStore writes still finishing after a failed asynchronous save (disk full) call back
    # into Orbax's closed event loop; Python would print each as a traceback
    if not getattr(sys.excepthook, "jctr_filtered", False):  # once per process
        sys.excepthook = _unless_closed_loop(sys.excepthook)
        sys.unraisablehook = _unless_closed_loop(sys.unraisablehook, unraisable=True)
        threading.excepthook = _unless_closed_loop(threading.excepthook, thread=True)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.FATAL)
    except ImportError:  # pragma: no cover - absl comes with orbax
        pass


def _unless_closed_loop(hook, *, unraisable: bool = False, thread: bool = False):
    def filtered(*args):
        if unraisable or thread:
            value = args[0].exc_value
        else:
            value = args[1]
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            hook(*args)
    filtered.jctr_filtered = True
    return filtered
