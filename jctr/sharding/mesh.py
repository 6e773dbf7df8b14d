"""The device mesh from the solver's ``gpu`` field, and moving arrays between host and mesh.

``gpu: [0, 2, 4, 7]`` is one host with those devices; ``[[0, 1], [0, 1]]`` is two hosts (one
list per process, in process order) with two devices each. All chosen devices form one mesh
axis, ``"d"``: the batch is split over it (data parallel) and sharded tables are split over it
(model parallel), as in HugeCTR.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jctr.config import ConfigError

AXIS = "d"


def mesh_devices(gpu: tuple[tuple[int, ...], ...], source: str = "<config>") -> list:
    """The devices the ``gpu`` field names, ordered by process, then as listed."""
    nproc = jax.process_count()
    if nproc == 1 and len(gpu) > 1:
        return _nodes_in_one_process(gpu, source)
    if nproc > 1 and len(gpu) not in (1, nproc):
        raise ConfigError("solver.gpu", f"lists {len(gpu)} hosts but {nproc} processes "
                          "are running; give one device list per process", source)
    if nproc > 1:
        # JAX's multi-host collectives (allgathers of flags and positions) span every local
        # device; a mesh that leaves some out deadlocks or aborts in gloo
        local = jax.local_device_count()
        for p in range(nproc):
            ids = sorted(gpu[p] if len(gpu) > 1 else gpu[0])
            if ids != list(range(local)):
                example = ",".join(map(str, range(local)))
                raise ConfigError(
                    "solver.gpu", f"process {p} uses devices {ids} of its {local}; a "
                    f"multi-process run needs every local device of every process: write "
                    f"{[list(range(local))] * nproc} (or --gpu \"{';'.join([example] * nproc)}\"), "
                    "or give each process fewer devices (XLA_FLAGS="
                    "--xla_force_host_platform_device_count on CPU, CUDA_VISIBLE_DEVICES on GPU)",
                    source)
    devices = []
    for p in range(nproc):
        ids = gpu[p] if len(gpu) > 1 else gpu[0]
        mine = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        for i in ids:
            if i >= len(mine):
                hint = (" (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)"
                        if mine and mine[0].platform == "cpu" else "")
                raise ConfigError("solver.gpu", f"device {i} does not exist: process {p} has "
                                  f"{len(mine)} {mine[0].platform if mine else ''} device(s)"
                                  + hint, source)
            devices.append(mine[i])
    return devices


def _nodes_in_one_process(gpu: tuple[tuple[int, ...], ...], source: str) -> list:
    """A list per node run by one process: on CPU the nodes' devices side by side (node ``h``'s
    ``j``-th listed device is host device ``j`` after the devices of the nodes before it);
    elsewhere an error that gives the launch command."""
    mine = sorted(jax.local_devices(), key=lambda d: d.id)
    launch = (f"start one process per node: scripts/launch_local.sh {len(gpu)} "
              f"{source if source != '<config>' else 'CONFIG'} on one machine, or srun / mpirun "
              f"with {len(gpu)} tasks")
    if not mine or mine[0].platform != "cpu":
        raise ConfigError("solver.gpu", f"lists {len(gpu)} nodes but this is a single process; "
                          + launch, source)
    need = sum(len(host) for host in gpu)
    if need > len(mine):
        raise ConfigError("solver.gpu", f"lists {len(gpu)} nodes, run by this process as "
                          f"{need} host devices, but it has {len(mine)}; {launch}", source)
    return mine[:need]


def build_mesh(gpu: tuple[tuple[int, ...], ...], source: str = "<config>") -> Mesh | None:
    """A one-axis mesh over the named devices, or None for a single device (no sharding)."""
    devices = mesh_devices(gpu, source)
    if len(devices) == 1:
        return None
    return Mesh(np.array(devices), (AXIS,))


def describe_mesh(mesh: Mesh | None) -> str:
    if mesh is None:
        d = jax.devices()[0]
        return f"[jctr] mesh: 1 device ({d.platform}:{d.id})"
    devs = mesh.devices.ravel()
    hosts = sorted({d.process_index for d in devs})
    return (f"[jctr] mesh: {len(devs)} devices on {len(hosts)} process(es), axis '{AXIS}': "
            + " ".join(f"{d.platform}:{d.id}@{d.process_index}" for d in devs))


def sharded(mesh: Mesh) -> NamedSharding:
    """Split along the leading axis (batch, or the device axis of a sharded table)."""
    return NamedSharding(mesh, PartitionSpec(AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def to_host(x) -> np.ndarray:
    """A numpy copy of a (possibly multi-process) array, gathered across processes if needed."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def global_batch(mesh: Mesh, local_tree):
    """Assemble global arrays from every process's equal-sized part (the leading axis is split
    over ``d``; process ``p``'s part comes ``p``-th)."""
    sh = sharded(mesh)

    def put(x):
        x = np.asarray(x)
        shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
        return jax.make_array_from_process_local_data(sh, x, shape)

    return jax.tree.map(put, local_tree)
