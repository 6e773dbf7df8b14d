"""``python -m jctr.serve``: see :mod:`jctr.serving.cli`."""

import signal
import sys
import threading

# first, before any import that takes time: a SIGHUP while the server starts is taken once
# it serves (SIGHUP's default would end the process); `load` and `request` go back to the
# default (jctr.serving.cli.main)
HANGUP = threading.Event()
if hasattr(signal, "SIGHUP"):
    signal.signal(signal.SIGHUP, lambda signum, frame: HANGUP.set())

from jctr.serving.cli import main  # noqa: E402 - after the handler

if __name__ == "__main__":
    sys.exit(main(hangup=HANGUP))
