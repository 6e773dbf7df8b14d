import sys

from jctr.runtime.host_memory import reexec_with_malloc_tuning

reexec_with_malloc_tuning(["-m", "jctr.train", *sys.argv[1:]])

from jctr.train.cli import end_process, main  # noqa: E402

sys.exit(end_process(main()))
