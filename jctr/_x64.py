"""64-bit keys need JAX's ``jax_enable_x64``, on before JAX makes its first array. Every jctr
package or module that uses JAX imports this module first; ``import jctr`` alone stays light
(no JAX), so that ``--help`` and ``--version`` answer at once."""

import jax

jax.config.update("jax_enable_x64", True)
