"""XLA compiler options for the train and eval steps, per platform and compute dtype.

On XLA:CPU the YNNPACK fusions (on by default in jaxlib 0.10) run this project's float32 MLP
matmuls slower than XLA's own Eigen dots (``docs/performance.md``). For float32 (and float16)
steps they are
switched off for the jitted steps only (not process-wide), unless the user's ``XLA_FLAGS``
already say something about them or ``JCTR_XLA_DEFAULTS=0``. bfloat16 steps keep them: their
AVX512-BF16 matmuls are what makes bfloat16 fast on CPU (the layers choose row-major
formulations for them, :mod:`jctr.ops.linear`). A jaxlib that no longer knows the option gets
none.

Example::

    step = jax.jit(train_step, donate_argnums=0,
                   compiler_options=step_compiler_options("float32"))
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)

_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def step_compiler_options(compute_dtype: str = "float32") -> dict[str, str]:
    """Compiler options for jctr's jitted steps on the default backend (may be empty)."""
    if (os.environ.get("JCTR_XLA_DEFAULTS", "1") == "0" or jax.default_backend() != "cpu"
            or compute_dtype == "bfloat16"):
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    options = {k: v for k, v in _CPU_OPTIONS.items() if k not in flags}
    if not options:
        return {}
    try:  # probe: an option this jaxlib does not know is a compile error, not a crash
        jax.jit(lambda x: x + 1, compiler_options=options)(jnp.zeros(()))
    except Exception:  # noqa: BLE001 - any failure means: compile without the options
        return {}
    return options
