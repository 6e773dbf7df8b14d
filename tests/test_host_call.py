"""Python called from a jitted step (:func:`jctr.ops.host_callback`; on CPU
:mod:`jctr.ops.host_call`, an XLA FFI handler reading the step's buffers in place)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jctr.ops import host_callback

cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU handler")


def test_a_host_callback_sees_the_operands_and_returns_arrays():
    seen = []

    def fn(x, flags):
        seen.append((x.copy(), flags.copy(), x.flags.writeable))
        return [x.sum(dtype=np.int64), (x * 2).astype(np.float32)[flags]]

    @jax.jit
    def step(x, flags):
        total, doubled = host_callback(fn, [jax.ShapeDtypeStruct((), jnp.int64),
                                            jax.ShapeDtypeStruct((3,), jnp.float32)],
                                       x + 1, flags)
        return total + 1, doubled

    x = jnp.arange(6, dtype=jnp.int32)
    flags = jnp.array([True, False, True, False, True, False])
    total, doubled = step(x, flags)
    assert int(total) == 22 and doubled.tolist() == [2.0, 6.0, 10.0]
    got_x, got_flags, writeable = seen[0]
    assert got_x.tolist() == [1, 2, 3, 4, 5, 6] and got_flags.tolist() == flags.tolist()
    assert not writeable or jax.default_backend() != "cpu"  # views of the step's own buffers
    step(x, flags)
    assert len(seen) == 2  # once per execution, not once per trace


@cpu_only
@pytest.mark.parametrize("bad,message", [
    (lambda x: 1 / 0, "ZeroDivisionError: division by zero"),
    (lambda x: [x, x], "returned 2 values, expected 1"),
    (lambda x: [x.astype(np.float64)], "result 0 is float64[4], expected float32[4]"),
])
def test_a_failing_host_callback_fails_the_step_with_its_error(bad, message):
    step = jax.jit(lambda x: host_callback(bad, [jax.ShapeDtypeStruct((4,), jnp.float32)],
                                           x)[0])
    with pytest.raises(Exception, match="jctr host call failed.*" + re.escape(message)):
        jax.block_until_ready(step(jnp.ones(4, jnp.float32)))


@cpu_only
def test_host_callbacks_inside_shard_map_before_a_collective_finish_on_eight_cpu_devices():
    """``io_callback`` copies its operands onto CPU device 0 before calling; on eight CPU
    devices of one process, a step whose devices each call back with 800 KB and then
    all-reduce waited forever for that copy (seen with jax 0.10.2: the same program with
    ``io_callback`` never finished). The host call reads the buffers in place: 20 steps end,
    with the right values. In a subprocess (its own eight devices, a hang bounded)."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        import jctr  # noqa: F401
        from jax.sharding import Mesh, PartitionSpec as P
        from jctr.ops import host_callback
        mesh = Mesh(np.array(jax.devices()), ("d",))
        n = 200_000
        def total(x):
            return [np.int32(x.astype(np.int64).sum() % 7)]
        def local(x):
            g = jax.lax.all_gather(x, "d", tiled=True)
            t = host_callback(total, [jax.ShapeDtypeStruct((), jnp.int32)], g * 2)[0]
            return x + jax.lax.psum(t, "d")
        step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        x = jnp.arange(8 * n, dtype=jnp.int32)
        want = np.arange(8 * n, dtype=np.int64)
        for _ in range(20):
            x = jax.block_until_ready(step(x) % 1000)
            want = (want + 8 * (int((want * 2).sum()) % 7)) % 1000
        assert np.array_equal(np.asarray(x), want), "wrong values"
        print("finished", len(jax.devices()))
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["finished", "8"]
