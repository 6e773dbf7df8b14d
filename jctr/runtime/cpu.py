"""Facts about the host CPU that change which settings are fast."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_bf16_matmul() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16); without it XLA
    emulates bfloat16 and it is slower than float32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def describe_cpu_setup(compute_dtype: str) -> list[str]:
    """Lines a run on CPU prints before training: the malloc settings, and a warning where
    ``compute_dtype`` is slow on this CPU."""
    from jctr.runtime.host_memory import describe_malloc_tuning

    lines = [describe_malloc_tuning()]
    if compute_dtype == "bfloat16" and not has_bf16_matmul():
        lines.append("[jctr] warning: compute_dtype bfloat16 on a CPU without AVX512-BF16 or "
                     "AMX: XLA emulates bfloat16 here, slower than float32 "
                     "(docs/performance.md); use float32 on this machine")
    return lines
