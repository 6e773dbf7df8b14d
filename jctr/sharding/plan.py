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
from jctr.embedding.hash_table import num_slots_for
from jctr.embedding.row_optimizers import init_slots
from jctr.embedding.sparse_embedding import EmbeddingSpec
from jctr.errors import UserError

KINDS = ("single", "localized", "distributed", "replicated")


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

    @property
    def placements(self) -> tuple[Placement, ...]:
        return tuple(t.placement for t in self.tables)

    def device_totals(self) -> list[int]:
        return [self.dense_bytes + sum(t.bytes_per_device[d] for t in self.tables)
                for d in range(self.num_devices)]

    def describe(self) -> str:
        """A table of the plan, one line per embedding plus the per-device totals."""
        lines = [f"[jctr] placement plan over {self.num_devices} device(s)"
                 + (f", {format_bytes(self.device_memory)} each" if self.device_memory else "")]
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
    """Bytes of one table part of ``capacity`` rows: values, optimizer rows, row slots and the
    hash slot array (int64 key, int32 row, int32 scratch per slot)."""
    slots = init_slots(spec.optimizer, 1, spec.dim)  # shapes of one row
    per_row = 4 * spec.dim + sum(int(np.prod(a.shape)) * a.dtype.itemsize
                                 for a in slots.values()) + 4
    return capacity * per_row + num_slots_for(capacity) * 16


def device_memory_bytes(device) -> int | None:
    """Memory a device may use: the allocator's limit on accelerators; on CPU the host's
    memory shared by the local CPU devices."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
        import jax

        return total // max(1, len([d for d in jax.local_devices() if d.platform == "cpu"]))
    return None


def _slot_sizes(cfg: ModelConfig, spec: EmbeddingSpec) -> list[int] | None:
    sizes = cfg.data.slot_size_array
    first = sum(s.slot_num for s in cfg.data.sparse[:spec.input_index])
    if len(sizes) >= first + spec.slot_num:
        return list(sizes[first:first + spec.slot_num])
    return None


def _balance_slots(sizes: list[int] | None, slot_num: int, devices: int) -> tuple[int, ...]:
    if not sizes:
        return tuple(s % devices for s in range(slot_num))
    load = [0] * devices
    owner = [0] * slot_num
    for s in sorted(range(slot_num), key=lambda s: (-sizes[s], s)):
        d = min(range(devices), key=lambda d: (load[d], d))
        owner[s] = d
        load[d] += sizes[s]
    return tuple(owner)


def plan_embeddings(cfg: ModelConfig, specs: tuple[EmbeddingSpec, ...], num_devices: int, *,
                    dense_bytes: int = 0, device_memory: int | None = None) -> ShardingPlan:
    """The placement of every embedding on ``num_devices`` devices; raises :class:`PlanError`
    when a device would need more than ``device_memory`` bytes.

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
        elif emb.replicated or (emb.replicated is None
                                and one <= cfg.solver.replicate_table_bytes):
            p = Placement("replicated", num_devices)
        elif emb.type.startswith("LocalizedSlot"):
            p = Placement("localized", num_devices,
                          _balance_slots(_slot_sizes(cfg, spec), spec.slot_num, num_devices))
        else:
            p = Placement("distributed", num_devices)
        tables.append(TablePlan(spec.name, p, (cap,) * num_devices, (one,) * num_devices))
    plan = ShardingPlan(num_devices, tuple(tables), dense_bytes, device_memory)
    if device_memory:
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
