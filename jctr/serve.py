"""``python -m jctr.serve``: see :mod:`jctr.serving.cli`."""

import sys

import jctr  # noqa: F401  (64-bit keys)
from jctr.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
