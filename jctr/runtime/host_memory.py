"""Host memory settings for XLA:CPU (glibc malloc tunables for big, recycled buffers), and
what the machine has left (:func:`room_left`: what a cache kept on the side may take).

XLA's CPU buffers come from malloc. Two costs show up in a training step on CPU:

* TLB misses. Embedding tables and hash-slot arrays are hundreds of MB, read and written at
  random rows every step; with 4 KiB pages nearly every access misses the TLB.
  ``glibc.malloc.hugetlb=1`` (glibc 2.35+) backs malloc'd memory with transparent huge pages.
* Page faults. A step's temporaries (a 10-hot batch gathers 2.1M embedding rows) are freed and
  allocated again every step. glibc returns such blocks to the kernel (``mmap`` for big blocks,
  ``madvise`` when a thread's arena shrinks), so every step faulted them in again, zero-filled.
  Serving every block from one heap that is never trimmed (``mmap_max=0``, ``arena_max=1``, a
  trim threshold of 16 GiB) keeps the pages mapped; the heap keeps its high-water mark while the
  process lives, as PyTorch's caching allocators do.

What each setting gained: ``docs/performance.md``.

Tunables are read when a process starts, so ``python -m jctr.train`` (and the benchmarks)
re-execute themselves once with the settings added, before any work; notebooks set
``GLIBC_TUNABLES`` (see :func:`malloc_tuning_env`) before starting Python.
``JCTR_HOST_MEMORY_TUNING=0`` turns this off; a tunable the user already set is left alone.

Example::

    reexec_with_malloc_tuning(["-m", "jctr.train", *sys.argv[1:]])  # first thing in a CLI
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = (
    ("glibc.malloc.hugetlb", "1"),
    ("glibc.malloc.mmap_max", "0"),
    ("glibc.malloc.arena_max", "1"),
    ("glibc.malloc.trim_threshold", str(16 << 30)),
)


def _names(tunables: str) -> set[str]:
    return {item.split("=", 1)[0] for item in tunables.split(":") if item}


def malloc_tuning_env(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment with :data:`TUNABLES` added to ``GLIBC_TUNABLES`` (those the user did not
    set), or None if there is nothing to change (not Linux/glibc, switched off, all set)."""
    env = dict(os.environ if environ is None else environ)
    if env.get("JCTR_HOST_MEMORY_TUNING", "1") == "0":
        return None
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    current = env.get("GLIBC_TUNABLES", "")
    present = _names(current)
    missing = [f"{name}={value}" for name, value in TUNABLES if name not in present]
    if not missing:
        return None
    env["GLIBC_TUNABLES"] = ":".join(([current] if current else []) + missing)
    return env


def reexec_with_malloc_tuning(args: list[str]) -> None:
    """Replace this process by ``python *args`` with :func:`malloc_tuning_env` (no-op if None).
    Call it before any work: nothing of this process survives."""
    env = malloc_tuning_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], env)


def describe_malloc_tuning() -> str:
    """One line for the run's header: the malloc tunables in effect, or how to set them."""
    current = os.environ.get("GLIBC_TUNABLES", "")
    if malloc_tuning_env() is not None:
        wanted = ":".join(f"{name}={value}" for name, value in TUNABLES)
        return ("[jctr] host memory: default malloc settings; start Python with "
                f"GLIBC_TUNABLES={wanted} for faster embedding steps on CPU")
    return f"[jctr] host memory: GLIBC_TUNABLES={current or '(unset)'}"


def heap_never_trimmed() -> bool:
    """Whether this process runs with the never-trimmed heap (``mmap_max=0``): freed step
    temporaries stay resident for reuse (the memory plan counts a reserve for that)."""
    return "glibc.malloc.mmap_max=0" in os.environ.get("GLIBC_TUNABLES", "")


def give_back_big_blocks() -> bool:
    """From now on serve blocks of 32 MiB and more with ``mmap`` (given back to the kernel
    when freed), undoing ``mmap_max=0`` for this process; True if glibc took it. For steps
    whose temporaries are GiBs: a never-trimmed heap may hold them twice, and faulting them in
    again costs little beside such a step."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold, m_mmap_max = -3, -4  # malloc.h
    return bool(mallopt(m_mmap_max, 65536)) and bool(mallopt(m_mmap_threshold, 32 << 20))


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of this machine's memory, from ``/proc/meminfo``."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    found[name] = int(rest.split()[0]) << 10
    except (OSError, ValueError):
        return None, None
    return found.get("MemTotal"), found.get("MemAvailable")


def address_space_left() -> int | None:
    """Bytes this process may still map under its address-space limit (``ulimit -v``,
    RLIMIT_AS), None when unlimited: allocations past it fail wherever they happen (a thread
    that cannot start, a table half made)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm", encoding="ascii") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError, IndexError):
        return None
    return max(0, soft - mapped)


def available_bytes() -> tuple[int | None, str]:
    """(bytes this process may still take, what bounds them): the machine's available
    memory, or what ``ulimit -v`` leaves where that is less; (None, ...) where neither says."""
    _, available = host_memory()
    left = address_space_left()
    if left is not None and (available is None or left < available):
        return left, "this process's address-space limit (ulimit -v)"
    return available, "the machine"


def headroom_bytes(available: int | None) -> int:
    """Memory left to the system and to estimates' error: 5% of what is available, at least
    512 MiB (a run the kernel kills loses more than one that holds back)."""
    return max(512 << 20, (available or 0) // 20)


def malloc_free_bytes() -> int:
    """Bytes malloc holds free in its heaps (glibc's ``mallinfo2``: ``fordblks``), 0 where it
    cannot be told. With jctr's never-trimmed heap every freed block stays there, counted by
    the process but reused before the system is asked for more."""
    import ctypes

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    try:
        call = ctypes.CDLL(None).mallinfo2  # glibc 2.33+
    except (OSError, AttributeError):
        return 0
    call.restype = _MallInfo2
    return int(call().fordblks)


def room_left(reserve: int = 0) -> int | None:
    """Bytes this process may still take for data it can also do without (a cache): the
    machine's available memory (or what ``ulimit -v`` leaves, if less) and malloc's free heap,
    less :func:`headroom_bytes` and ``reserve`` (what the work under way still takes at its
    peak, e.g. a training step's temporaries). None where the machine does not say.

    Example::

        if (room := room_left(reserve=step_bytes)) is None or need <= room:
            cache[i] = load(i)
    """
    available, _ = available_bytes()
    if available is None:
        return None
    return available + malloc_free_bytes() - headroom_bytes(available) - reserve
