"""``python -m jctr.serve``: see :mod:`jctr.serving.cli`."""

import sys

# importing jctr.serving runs jctr/__init__ (64-bit keys)
from jctr.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
