"""The memory plan of a run's whole step, made before any table is allocated.

The train and evaluation steps are compiled for the state and batches they will get (as
shapes), and XLA's own figures for them (:func:`jctr.sharding.plan.memory_plan`) with the
reader's queue and this process make the plan; a run that will not fit is refused with them.
The first real call reuses the compiled executables. On CPU the plan also decides whether
the never-trimmed malloc heap (:mod:`jctr.runtime.host_memory`) may keep a second set of
temporaries, or big blocks go back to the system after each step.

Example::

    plan = plan_step_memory(placed, cfg, train_step, eval_step, init_state, print)
    plan.steps_in_flight    # 1: each step completes before the next is dispatched
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax

from jctr.config import ModelConfig
from jctr.data.batch import batch_bytes
from jctr.runtime.host_memory import give_back_big_blocks, heap_never_trimmed
from jctr.sharding.placed_model import PlacedModel
from jctr.sharding.plan import MemoryPlan, device_memory_bytes, memory_plan

_ADVICE = ("; lower solver.batchsize (the step's temporaries grow with the batch and its keys) "
           "or the tables' max_vocabulary_size_per_gpu, or use more devices")


def plan_step_memory(placed: PlacedModel, cfg: ModelConfig, train_step, eval_step,
                     init_state: Callable, say: Callable[[str], None]) -> MemoryPlan:
    """Compile ``train_step`` and ``eval_step`` (jitted for ``placed``), print the plan
    through ``say`` and return it; raises :class:`jctr.sharding.plan.PlanError` when the step
    will not fit."""
    s = cfg.solver
    state = placed.abstract_state(init_state)
    t0 = time.perf_counter()
    steps = [train_step.lower(state, placed.abstract_batch(s.batchsize)).compile(),
             eval_step.lower(state, placed.abstract_batch(s.batchsize_eval)).compile()]
    say(f"[jctr] train and evaluation steps compiled in {time.perf_counter() - t0:.1f} s "
        "(before any table exists)")
    # the reader's queue: two batches ahead, one in transfer, one being assembled
    reader = 4 * batch_bytes(cfg.data, s.batchsize // jax.process_count())
    plan = memory_plan(steps, placed.state_bytes_per_device(state), placed.local_devices(),
                       reader, device_memory_bytes(placed.device), jax.default_backend(),
                       heap_reserve=heap_never_trimmed())
    if plan.reserve and not plan.fits() and \
            dataclasses.replace(plan, heap_reserve=False).fits() and give_back_big_blocks():
        plan = dataclasses.replace(plan, heap_reserve=False)
        say("[jctr] host memory: blocks of 32 MiB and more go back to the system when freed "
            "(a never-trimmed heap could hold this step's temporaries twice, which does not "
            "fit)")
    say(plan.describe())
    plan.check(_ADVICE)
    return plan
