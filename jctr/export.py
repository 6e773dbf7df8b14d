"""``python -m jctr.export``: see :mod:`jctr.serving.export`."""

import sys

import jctr  # noqa: F401  (64-bit keys)
from jctr.serving.export import main

if __name__ == "__main__":
    sys.exit(main())
