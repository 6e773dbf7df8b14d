"""``python -m jctr.online --config online.yaml``: see :mod:`jctr.online.runner`."""

import sys

from jctr.online.cli import main
from jctr.train.cli import end_process

if __name__ == "__main__":
    sys.exit(end_process(main()))
