"""Host devices for a config's ``solver.gpu`` on the CPU platform.

A HugeCTR config names its GPUs (``"gpu": [0, 1, 2, 3]``, or one list per node). On a machine
without GPUs jctr runs the same placement and all-to-all over that many XLA:CPU devices, which
must be created before JAX starts its backends; :func:`provide_host_devices` does that for the
command-line tools (the user's own ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
stands, whatever it says). It changes a process-wide setting, so the library never calls it
on its own: a notebook calls it first thing.
On a GPU machine the CPU devices are never used for the mesh, and a config naming more GPUs than
exist is an error from :func:`jctr.sharding.mesh.mesh_devices`.

Example::

    from jctr.runtime.devices import provide_host_devices

    cfg = load_config("hugectr/dcn.json")            # "gpu": [0, 1, 2, 3]
    print(provide_host_devices(cfg.solver.gpu))     # before any JAX computation
"""

from __future__ import annotations

import os
import re

_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def host_devices_needed(gpu: tuple[tuple[int, ...], ...], processes: int) -> int:
    """CPU devices one process needs for ``gpu``: the highest index of its list + 1; a list per
    node run by one process needs every node's devices side by side."""
    if processes > 1 or len(gpu) == 1:
        return max(max(host) + 1 for host in gpu)
    return sum(len(host) for host in gpu)


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a JAX without this module
        return True
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else bool(getattr(xla_bridge, "_backends", 1))


def provide_host_devices(gpu: tuple[tuple[int, ...], ...], processes: int = 1) -> str | None:
    """Make the XLA:CPU client hold as many devices as ``gpu`` names for this process; returns
    the line to print when it changed anything, else None. Does nothing once JAX's backends
    run (a notebook that already computed: the mesh then says which device is missing)."""
    if _FLAG.search(os.environ.get("XLA_FLAGS", "")):
        return None  # the user's own count of host devices stands
    need = host_devices_needed(gpu, processes)
    if need <= 1 or _backends_started():
        return None
    import jax

    current = jax.config.jax_num_cpu_devices
    if current is not None and current >= need:
        return None
    jax.config.update("jax_num_cpu_devices", need)
    if len(gpu) > 1 and processes == 1:
        return (f"[jctr] solver.gpu lists {len(gpu)} nodes: on the CPU platform this one "
                f"process runs their devices side by side as {need} XLA:CPU host devices "
                f"(one process per node: scripts/launch_local.sh {len(gpu)} CONFIG)")
    return (f"[jctr] solver.gpu names {need} devices: on the CPU platform this process runs "
            f"them as {need} XLA:CPU host devices")
