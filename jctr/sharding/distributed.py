"""Multi-host start-up: ``jax.distributed.initialize`` from the environment.

Recognised, in this order:

* ``JCTR_COORDINATOR`` (``host:port`` of process 0), ``JCTR_NUM_PROCESSES``, ``JCTR_PROCESS_ID``
  (what ``scripts/launch_local.sh`` sets; use them with any launcher);
* SLURM (``SLURM_JOB_ID`` with ``SLURM_NTASKS`` > 1) and Open MPI (``OMPI_COMM_WORLD_SIZE`` > 1):
  JAX's own cluster detection finds the coordinator, process count and id (``JCTR_COORDINATOR``
  may still name the coordinator).

Without any of these the run is a single process. Call this before anything else touches JAX
devices (the CLI does).
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import jax
import numpy as np

from jctr.errors import UserError

_started = False
_SERVICE_LINGER_S = 0.5


def _int_env(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}: expected an integer, got "
                         f"{value!r}") from None


def cluster_from_env() -> dict | None:
    """The ``jax.distributed.initialize`` arguments the environment asks for, or None."""
    if os.environ.get("JCTR_NUM_PROCESSES"):
        n = _int_env("JCTR_NUM_PROCESSES")
        if n <= 1:
            return None
        coord = os.environ.get("JCTR_COORDINATOR")
        if not coord:
            raise UserError("JCTR_NUM_PROCESSES is set but JCTR_COORDINATOR (host:port of "
                             "process 0) is not")
        pid = _int_env("JCTR_PROCESS_ID")
        if not 0 <= pid < n:
            raise UserError(f"JCTR_PROCESS_ID {pid} is outside [0, {n})")
        return {"coordinator_address": coord, "num_processes": n, "process_id": pid}
    slurm = os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1
    ompi = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    if slurm or ompi:
        coord = os.environ.get("JCTR_COORDINATOR")
        return {"coordinator_address": coord} if coord else {}
    return None


def initialize_distributed(timeout_s: int = 300) -> bool:
    """Join the cluster the environment describes; returns True when running multi-process.

    Example (two processes on one machine; ``scripts/launch_local.sh`` does this)::

        JCTR_COORDINATOR=127.0.0.1:12345 JCTR_NUM_PROCESSES=2 JCTR_PROCESS_ID=0 \\
            python -m jctr.train --config cfg.json &
        JCTR_COORDINATOR=127.0.0.1:12345 JCTR_NUM_PROCESSES=2 JCTR_PROCESS_ID=1 \\
            python -m jctr.train --config cfg.json
    """
    global _started
    if _started:
        return jax.process_count() > 1
    args = cluster_from_env()
    if args is None:
        return False
    # CPU devices of different processes talk through gloo (the default has no collectives)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(initialization_timeout=timeout_s, **args)
    _started = True
    return True


def planned_process_count() -> int:
    """The processes of this run, known before JAX starts its backends: those of the cluster
    joined, else those the environment describes, else 1."""
    if _started:
        return jax.process_count()
    if os.environ.get("JCTR_NUM_PROCESSES"):
        return max(1, _int_env("JCTR_NUM_PROCESSES"))
    for name in ("OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name, "").isdigit():
            return max(1, int(os.environ[name]))
    return 1


def end_process(status: int) -> int:
    """``status``, for the entry point's ``sys.exit``; process 0 of a multi-process run (which
    hosts the coordination service) instead ends here, with ``status``.

    Every process leaves the cluster through JAX's shutdown barrier at exit. Process 0 then ends
    without destroying the service: XLA aborts a process whose gRPC server is destroyed while
    another process's last calls still arrive (``server.cc: Check failed: queue.Pop() ==
    nullptr``), which turned a clean exit status into 134 now and then.
    """
    if not _started:
        return status
    try:
        from jax._src.distributed import global_state
    except ImportError:  # a JAX that moved it: the usual shutdown
        return status
    service = getattr(global_state, "service", None)
    if service is None:  # not process 0
        return status
    # detached (but referenced, so not destroyed): JAX's own exit handler, run with the others
    # here, then leaves the cluster on the client side only
    global_state.service = None
    try:
        atexit._run_exitfuncs()
        # the barrier's replies to the other processes left with this one's: a moment for them
        # to be delivered before the service's process is gone
        time.sleep(_SERVICE_LINGER_S)
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(status)


def all_processes(action, what: str):
    """Run ``action`` on every process and agree on the outcome: when it fails on any
    process, every process raises (the failing one its own error), so no process waits forever
    in a collective the failed one never reaches. Single-process: just ``action()``."""
    if jax.process_count() == 1:
        return action()
    from jax.experimental import multihost_utils

    error: BaseException | None = None
    result = None
    try:
        result = action()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others heard of it
        error = e
    flags = np.asarray(multihost_utils.process_allgather(np.array([error is None])))
    if error is not None:
        raise error
    if not flags.all():
        failed = [int(i) for i in np.nonzero(~flags.ravel())[0]]
        raise UserError(f"process(es) {failed} could not {what}; see their messages")
    return result


def gather_rows(arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Every process's ``arrays`` (equal length along axis 0 within a process, any length
    across processes, the same trailing shape), in process order; single-process:
    ``[arrays]``.

    Example::

        parts = gather_rows({"keys": keys, "show": show})   # one dict per process
    """
    if jax.process_count() == 1:
        return [arrays]
    from jax.experimental import multihost_utils

    n = len(next(iter(arrays.values())))
    sizes = np.asarray(multihost_utils.process_allgather(np.array([n], np.int64))).ravel()
    width = max(int(sizes.max()), 1)
    out: list[dict[str, np.ndarray]] = [{} for _ in sizes]
    for name, a in arrays.items():
        padded = np.zeros((width, *a.shape[1:]), a.dtype)
        padded[:n] = a
        every = np.asarray(multihost_utils.process_allgather(padded)).reshape(
            len(sizes), width, *a.shape[1:])
        for p, size in enumerate(sizes):
            out[p][name] = every[p, :int(size)]
    return out


def process_owns(keys: np.ndarray) -> np.ndarray | None:
    """Which of ``keys`` this process keeps when every process keeps a part of some keyed
    data (a row database): by key hash, each key in exactly one process. None for one process
    (it keeps every key)."""
    if jax.process_count() == 1:
        return None
    from jctr.ops import owner_shards_host

    return owner_shards_host(keys, jax.process_count()) == jax.process_index()
