"""Which device owns each slot of a ``LocalizedSlot*`` embedding, and the rows that takes.

HugeCTR deals slot ``i`` to GPU ``i % gpus`` (``cal_max_voc_size_per_gpu`` in
``localized_slot_sparse_embedding_one_hot.hpp``, v2.3) and sizes every GPU's table for the
largest sum. jctr balances by size when the sizes are known (largest slot first onto the least
loaded device), which never needs more rows per device than dealing in turn and often fewer;
without sizes it deals in turn as HugeCTR does. The parser sizes tables given by
``slot_size_array`` with this, and the placement plan places their slots with it.

Example::

    owners = localized_slot_owners([1000, 10, 10, 5], 4, devices=2)   # (0, 1, 1, 1)
    rows_per_device([1000, 10, 10, 5], owners, 2)                        # 1000
"""

from __future__ import annotations


def localized_slot_owners(sizes, slot_num: int, devices: int) -> tuple[int, ...]:
    """The device of each slot: by size when ``sizes`` are given, else in turn."""
    if not sizes:
        return tuple(s % devices for s in range(slot_num))
    load = [0] * devices
    owner = [0] * slot_num
    for s in sorted(range(slot_num), key=lambda s: (-sizes[s], s)):
        d = min(range(devices), key=lambda d: (load[d], d))
        owner[s] = d
        load[d] += sizes[s]
    balanced = tuple(owner)
    dealt = tuple(s % devices for s in range(slot_num))
    # greedy balancing is near-optimal, not optimal: never worse than HugeCTR's dealing
    if rows_per_device(sizes, balanced, devices) > rows_per_device(sizes, dealt, devices):
        return dealt
    return balanced


def rows_per_device(sizes, owners: tuple[int, ...], devices: int) -> int:
    """The rows the most loaded device holds (every device's part is allocated that size)."""
    load = [0] * devices
    for size, d in zip(sizes, owners):
        load[d] += int(size)
    return max(load)
