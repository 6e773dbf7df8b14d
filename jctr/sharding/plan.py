"""Placement plans: which device holds which embedding rows, and what that costs in memory.

Each embedding gets a :class:`Placement` from its type, as in HugeCTR:

* ``LocalizedSlot*`` -> ``localized``: every slot lives whole on one device. Slots are balanced
  by size when ``slot_size_array`` gives the sizes (largest first onto the least loaded device),
  otherwise dealt round-robin ("each slot in each GPU in turn").
* ``DistributedSlot*`` -> ``distributed``: the rows of every slot are spread over all devices by
  key hash.
* ``replicated``: a full copy on every device (data parallel), for small tables: chosen per
  embedding with ``sparse_embedding_hparam.replicated``, or by the planner for tables of at most
  ``solver.replicate_table_bytes`` bytes.

``max_vocabulary_size_per_gpu`` is the row capacity of one device's part, as in HugeCTR. The plan
is checked against each device's memory before anything is allocated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from jctr.config.schema import ModelConfig
from jctr.config.slots import localized_slot_owners
from jctr.embedding.hash_table import num_slots_for
from jctr.embedding.row_optimizers import init_slots
from jctr.embedding.sparse_embedding import EmbeddingSpec
from jctr.errors import UserError
from jctr.runtime.host_memory import available_bytes, headroom_bytes


class PlanError(UserError, ValueError):
    """The tables do not fit the devices; the message names the table and the shortfall."""


@dataclass(frozen=True)
class Placement:
    """Where one embedding's rows live (static, hashable).

    Example::

        Placement("localized", num_shards=4, slot_owner=(0, 1, 2, 3, 0, 1))
    """

    kind: str
    num_shards: int = 1
    slot_owner: tuple[int, ...] = ()  # localized: the device of each slot

    @property
    def sharded(self) -> bool:
        """Rows are split over devices (state arrays carry a leading device axis)."""
        return self.kind in ("localized", "distributed")


@dataclass(frozen=True)
class TablePlan:
    name: str
    placement: Placement
    rows_per_device: tuple[int, ...]  # row capacity allocated on each device
    bytes_per_device: tuple[int, ...]


@dataclass(frozen=True)
class ShardingPlan:
    num_devices: int
    tables: tuple[TablePlan, ...]
    dense_bytes: int  # dense parameters and their optimizer state, on every device
    device_memory: int | None
    shared_memory: bool = False  # CPU: the devices share device_memory

    @property
    def placements(self) -> tuple[Placement, ...]:
        return tuple(t.placement for t in self.tables)

    def device_totals(self) -> list[int]:
        return [self.dense_bytes + sum(t.bytes_per_device[d] for t in self.tables)
                for d in range(self.num_devices)]

    def describe(self) -> str:
        """A table of the plan, one line per embedding plus the per-device totals."""
        lines = [f"[jctr] placement plan over {self.num_devices} device(s)"
                 + (f", {format_bytes(self.device_memory)} each" if self.device_memory
                    and not self.shared_memory else "")
                 + (f" sharing {format_bytes(self.device_memory)}" if self.device_memory
                    and self.shared_memory else "")]
        for t in self.tables:
            p = t.placement
            where = {"single": "device 0", "distributed": "rows by key hash on every device",
                     "replicated": "a copy on every device"}.get(p.kind)
            if p.kind == "localized":
                per = [sum(1 for o in p.slot_owner if o == d) for d in range(self.num_devices)]
                where = "slots per device " + "/".join(map(str, per))
            rows = sorted(set(t.rows_per_device))
            lines.append(f"[jctr]   {t.name}: {p.kind} ({where}); rows/device "
                         f"{'/'.join(f'{r:,}' for r in rows)}; "
                         f"{format_bytes(max(t.bytes_per_device))} max/device "
                         "(values + optimizer state + hash keys)")
        totals = self.device_totals()
        lines.append(f"[jctr]   dense: {format_bytes(self.dense_bytes)} per device; total per "
                     "device "
                     + " ".join(format_bytes(b) for b in totals))
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    """``n`` bytes for people: "1.07 MiB"."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def table_bytes(spec: EmbeddingSpec, capacity: int) -> int:
    """Bytes of one table part of ``capacity`` rows: values, optimizer rows, row slots, the
    free list of rows, and the hash slot array (int64 key, int32 row, int32 scratch per slot;
    with eviction the keys' scores beside them)."""
    slots = init_slots(spec.optimizer, 1, spec.dim)  # shapes of one row
    per_row = 4 * spec.dim + sum(int(np.prod(a.shape)) * a.dtype.itemsize
                                 for a in slots.values()) + 4 + 4
    per_slot = 16 + (4 * spec.eviction.score_columns if spec.eviction is not None else 0)
    return capacity * per_row + num_slots_for(capacity, spec.eviction) * per_slot


def device_memory_bytes(device) -> int | None:
    """Memory a device may use: the allocator's limit on accelerators; on CPU the host's
    memory, which all CPU devices share (:func:`plan_embeddings` checks their sum)."""
    stats = _memory_stats(device)
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def _memory_stats(device) -> dict:
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        return {}


def device_room_bytes(device) -> int | None:
    """Memory a device has left: its allocator's limit less what it holds, on accelerators;
    on CPU what the host has left (:func:`jctr.runtime.host_memory.room_left`). None where
    it does not say."""
    stats = _memory_stats(device)
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        from jctr.runtime.host_memory import room_left

        return room_left()
    return None


def _slot_sizes(cfg: ModelConfig, emb, spec: EmbeddingSpec) -> list[int] | None:
    if emb.slot_size_array:  # the embedding's own sizes (HugeCTR's LocalizedSlot* hparam)
        return list(emb.slot_size_array)
    sizes = cfg.data.slot_size_array
    first = sum(s.slot_num for s in cfg.data.sparse[:spec.input_index])
    if len(sizes) >= first + spec.slot_num:
        return list(sizes[first:first + spec.slot_num])
    return None


def plan_embeddings(cfg: ModelConfig, specs: tuple[EmbeddingSpec, ...], num_devices: int, *,
                    dense_bytes: int = 0, device_memory: int | None = None,
                    shared_memory: bool = False) -> ShardingPlan:
    """The placement of every embedding on ``num_devices`` devices; raises :class:`PlanError`
    when a device would need more than ``device_memory`` bytes (``shared_memory``, CPU
    devices of one host: when all of them together would).

    Example::

        plan = plan_embeddings(cfg, specs, 8, device_memory=16 << 30)
        print(plan.describe())
    """
    tables = []
    for spec, emb in zip(specs, cfg.embeddings):
        cap = spec.capacity
        one = table_bytes(spec, cap)
        if num_devices == 1:
            p = Placement("single")
        elif emb.replicated or (emb.replicated is None and not emb.slot_size_array
                                and one <= cfg.solver.replicate_table_bytes):
            p = Placement("replicated", num_devices)
        elif emb.type.startswith("LocalizedSlot"):
            p = Placement("localized", num_devices,
                          localized_slot_owners(_slot_sizes(cfg, emb, spec), spec.slot_num,
                                                num_devices))
        else:
            p = Placement("distributed", num_devices)
        tables.append(TablePlan(spec.name, p, (cap,) * num_devices, (one,) * num_devices))
    plan = ShardingPlan(num_devices, tuple(tables), dense_bytes, device_memory, shared_memory)
    if device_memory and shared_memory:
        need = sum(plan.device_totals())
        if need > device_memory:
            biggest = max(tables, key=lambda t: sum(t.bytes_per_device))
            raise PlanError(
                f"the embedding tables do not fit: the {num_devices} host device(s) need "
                f"{format_bytes(need)} in all but the machine has {format_bytes(device_memory)} "
                f"(short by {format_bytes(need - device_memory)}); the largest is embedding "
                f"\"{biggest.name}\" with {format_bytes(sum(biggest.bytes_per_device))} "
                f"({'/'.join(f'{r:,}' for r in sorted(set(biggest.rows_per_device)))} rows per "
                "device); lower max_vocabulary_size_per_gpu (or the sizes that set it), or "
                "fewer devices for tables whose slots differ much in size")
    elif device_memory:
        totals = plan.device_totals()
        worst = int(np.argmax(totals))
        if totals[worst] > device_memory:
            biggest = max(tables, key=lambda t: t.bytes_per_device[worst])
            raise PlanError(
                f"the embedding tables do not fit: device {worst} needs "
                f"{format_bytes(totals[worst])} but has {format_bytes(device_memory)} (short by "
                f"{format_bytes(totals[worst] - device_memory)}); "
                f"the largest part is embedding \"{biggest.name}\" with "
                f"{format_bytes(biggest.bytes_per_device[worst])} "
                f"({biggest.rows_per_device[worst]:,} rows of max_vocabulary_size_per_gpu); "
                "lower max_vocabulary_size_per_gpu or use more devices")
    return plan


def process_resident_bytes() -> int:
    """This process's resident memory now (Python, JAX, compiled code, data read so far)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class MemoryPlan:
    """A training step's whole memory, from XLA's own figures for the compiled steps.

    Per device: the state (tables with their optimizer state and hash slots, the dense
    parameters and theirs), the step's input batch, and the step's temporaries (activations,
    gradients, all-to-all buffers, gathered rows; the larger of the train and evaluation
    steps). On the CPU platform the local devices share the host's memory, which also holds
    the reader's queue of batches and the process itself.

    Example::

        plan = MemoryPlan(devices=2, state=600 << 20, batch=40 << 20, temp=2 << 30,
                          reader=160 << 20, process=500 << 20, platform="cpu")
        print(plan.describe()); plan.check()
    """

    devices: int
    state: int
    batch: int
    temp: int
    reader: int
    process: int
    platform: str
    device_limit: int | None = None  # accelerators: each device's own memory
    available: int | None = None  # CPU: the host's available memory before the tables
    bound: str = "the machine"  # what ``available`` is: the machine's, or ulimit -v's
    heap_reserve: bool = False  # CPU: freed temporaries stay in a never-trimmed heap

    @property
    def steps_in_flight(self) -> int:
        """Steps the loop may queue on the devices: a queued step holds its own batch and
        temporaries while the one before runs, worth it for small steps only (their dispatch
        time would show); a step with a GiB of temporaries waits for the one before."""
        return 1 if self.devices * self.temp >= (1 << 30) else 2

    @property
    def per_device(self) -> int:
        return self.state + self.steps_in_flight * (self.batch + self.temp)

    @property
    def transient(self) -> int:
        """Host memory a step takes at its peak beyond the state and the process: the reader's
        queue and, on CPU, every device's steps in flight and the heap reserve (what data
        kept in memory on the side must leave room for)."""
        if self.platform != "cpu":
            return self.reader
        return self.total - self.devices * self.state - self.process

    @property
    def total(self) -> int:
        """Everything this process holds at the step's peak, on CPU (host memory)."""
        if self.platform != "cpu":
            return self.reader + self.process
        return self.devices * self.per_device + self.reserve + self.reader + self.process

    @property
    def reserve(self) -> int:
        """CPU with jctr's never-trimmed malloc heap (:mod:`jctr.runtime.host_memory`): host
        allocations made between two steps split the freed blocks of temporaries, and the next
        step may take new ones (measured: from one device's up to every device's again)."""
        return self.devices * self.temp if self.heap_reserve and self.platform == "cpu" else 0

    def fits(self) -> bool:
        """Whether :meth:`check` passes."""
        try:
            self.check()
        except PlanError:
            return False
        return True

    def describe(self) -> str:
        parts = (f"state {format_bytes(self.state)} + batch {format_bytes(self.batch)} + "
                 f"step temporaries {format_bytes(self.temp)}")
        if self.steps_in_flight > 1:
            parts = (f"state {format_bytes(self.state)} + {self.steps_in_flight} steps in "
                     f"flight x (batch {format_bytes(self.batch)} + temporaries "
                     f"{format_bytes(self.temp)})")
        if self.platform != "cpu":
            limit = f" of {format_bytes(self.device_limit)}" if self.device_limit else ""
            return (f"[jctr] memory plan: per device {parts} = "
                    f"{format_bytes(self.per_device)}{limit}; host: reader queue "
                    f"{format_bytes(self.reader)} + process {format_bytes(self.process)}; "
                    f"{format_bytes(self.per_device)} in all per device")
        where = "host memory" if self.bound == "the machine" else "ulimit -v leaves"
        avail = (f" ({where} available {format_bytes(self.available + self.process)})"
                 if self.available is not None else "")
        return (f"[jctr] memory plan: per device {parts} = {format_bytes(self.per_device)}; "
                f"x {self.devices} device(s) + "
                + (f"heap reserve {format_bytes(self.reserve)} + " if self.reserve else "")
                + f"reader queue {format_bytes(self.reader)} + "
                f"process {format_bytes(self.process)} = {format_bytes(self.total)} in all"
                + avail)

    def check(self, advice: str = "") -> None:
        """Raise :class:`PlanError` with the figures when the step will not fit."""
        if self.platform != "cpu":
            if self.device_limit and self.per_device > self.device_limit:
                raise PlanError(f"the training step does not fit: each device needs "
                                f"{format_bytes(self.per_device)} ({self._parts()}) but has "
                                f"{format_bytes(self.device_limit)}{advice}")
            return
        if self.available is not None and \
                self.total - self.process > self.available - self.headroom:
            raise PlanError(f"the training step does not fit: it needs "
                            f"{format_bytes(self.total)} in all ({self.devices} device(s) x "
                            f"{format_bytes(self.per_device)}: {self._parts()}; reader queue "
                            f"{format_bytes(self.reader)}; this process "
                            f"{format_bytes(self.process)}) but {self.bound} has "
                            f"{format_bytes(self.available + self.process)} available, of "
                            f"which {format_bytes(self.headroom)} stay free for the system"
                            + advice)

    @property
    def headroom(self) -> int:
        """Memory left to the system and the plan's error: 5% of what is available, at
        least 512 MiB (the measured peaks stay within a few percent of most plans, but a run
        the kernel kills loses more than one refused)."""
        return headroom_bytes(self.available)

    def _parts(self) -> str:
        return (f"state {format_bytes(self.state)}, batch {format_bytes(self.batch)}, step "
                f"temporaries {format_bytes(self.temp)}")


def memory_plan(steps: list, state_bytes: int, devices: int, reader_bytes: int,
                device_memory: int | None, platform: str,
                heap_reserve: bool = False) -> MemoryPlan:
    """The :class:`MemoryPlan` of compiled steps (``jax.stages.Compiled``, the train step
    first) whose state holds ``state_bytes`` per device."""
    temp, batch = 0, 0
    for compiled in steps:
        m = compiled.memory_analysis()
        if m is None:  # a backend without the analysis: no temporaries known
            continue
        # outputs that do not reuse a donated input come on top of the inputs
        temp = max(temp, int(m.temp_size_in_bytes)
                   + max(0, int(m.output_size_in_bytes) - int(m.alias_size_in_bytes)))
        batch = max(batch, int(m.argument_size_in_bytes) - state_bytes)
    available, bound = available_bytes() if platform == "cpu" else (None, "the machine")
    return MemoryPlan(devices=devices, state=state_bytes, batch=max(batch, 0), temp=temp,
                      reader=reader_bytes, process=process_resident_bytes(), platform=platform,
                      device_limit=device_memory if platform != "cpu" else None,
                      available=available, heap_reserve=heap_reserve, bound=bound)
