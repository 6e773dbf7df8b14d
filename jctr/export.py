"""``python -m jctr.export``: see :mod:`jctr.serving.export`."""

import sys

# importing jctr.serving runs jctr/__init__ (64-bit keys)
from jctr.serving.export import main

if __name__ == "__main__":
    sys.exit(main())
