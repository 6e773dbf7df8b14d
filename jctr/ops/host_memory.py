"""Host memory settings for XLA:CPU: transparent huge pages for glibc's malloc.

Embedding tables and hash-slot arrays are hundreds of MB, read and written at random rows every
step; with 4 KiB pages nearly every access misses the TLB. glibc (2.35+) backs malloc'd memory
with transparent huge pages when the process starts with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
(XLA's CPU buffers come from malloc). Measured with ``scripts/bench_train.py``: jctr 38.9k ->
48.0k samples/s one-hot and 25.4k -> 31.5k 10-hot on the 2-core machine.

Tunables are read when a process starts, so ``python -m jctr.train`` (and the benchmarks)
re-execute themselves once with the setting added, before any work; notebooks set it before
starting Python. ``JCTR_HOST_MEMORY_TUNING=0`` turns this off; an explicit
``glibc.malloc.hugetlb`` in ``GLIBC_TUNABLES`` is left alone.

Example::

    reexec_with_huge_pages(["-m", "jctr.train", *sys.argv[1:]])  # first thing in a CLI
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"


def huge_page_env(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment with huge pages for malloc, or None if there is nothing to change
    (not Linux/glibc, switched off, or already set)."""
    env = dict(os.environ if environ is None else environ)
    if env.get("JCTR_HOST_MEMORY_TUNING", "1") == "0":
        return None
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    current = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return None
    env["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    return env


def reexec_with_huge_pages(args: list[str]) -> None:
    """Replace this process by ``python *args`` with :func:`huge_page_env` (no-op if None).
    Call it before any work: nothing of this process survives."""
    env = huge_page_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], env)


def describe_huge_pages() -> str:
    """One line for the run's header: whether malloc uses huge pages, and how to turn them on."""
    if "glibc.malloc.hugetlb=1" in os.environ.get("GLIBC_TUNABLES", ""):
        return "[jctr] host memory: huge pages for malloc (GLIBC_TUNABLES=glibc.malloc.hugetlb=1)"
    if huge_page_env() is None:
        return "[jctr] host memory: default malloc pages"
    return ("[jctr] host memory: 4 KiB malloc pages; start Python with "
            "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 for faster embedding lookups on CPU")
