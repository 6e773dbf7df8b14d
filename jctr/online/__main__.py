"""``python -m jctr.online --config online.yaml``: see :mod:`jctr.online.runner`."""

import sys

from jctr.online.runner import main

if __name__ == "__main__":
    sys.exit(main())
