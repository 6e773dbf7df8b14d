"""``python -m jctr.report RUN_DIR``: see :mod:`jctr.train.report`."""

import sys

from jctr.train.report import main

if __name__ == "__main__":
    sys.exit(main())
