import sys

import jctr  # noqa: F401  (enables 64-bit keys before anything else touches JAX)
from jctr.train.cli import main

sys.exit(main())
