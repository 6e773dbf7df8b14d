"""``python -m jctr``: the ``jctr`` command (:mod:`jctr.cli`)."""

import sys

from jctr.cli import main

sys.exit(main())
