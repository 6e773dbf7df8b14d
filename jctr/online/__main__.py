"""``python -m jctr.online --config online.yaml``: see :mod:`jctr.online.runner`."""

import sys

from jctr.runtime.host_memory import reexec_with_malloc_tuning

if __name__ == "__main__":  # malloc tuned for XLA:CPU, as python -m jctr.train
    reexec_with_malloc_tuning(["-m", "jctr.online", *sys.argv[1:]])

from jctr.online.cli import main  # noqa: E402
from jctr.train.cli import end_process  # noqa: E402

if __name__ == "__main__":
    sys.exit(end_process(main()))
