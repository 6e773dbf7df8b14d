"""A model placed on its devices: one device, or a mesh with tables split by the plan.

It owns everything that depends on where the state lives -- the sharding plan, the embedding
engines, the state's shardings, moving batches onto the devices and jitting step functions for
that placement -- so that training, export and tools can place a model without a trainer.

Example::

    step_config, init_state = build_model(cfg)
    placed = PlacedModel(cfg, step_config.specs, dense_bytes=0)
    state = placed.create(init_state)
    eval_step = placed.jit(make_eval_step(step_config, placed.engine_full))
    loss, probs = eval_step(state, placed.to_devices(batch, process_local=False))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from jctr.config import ConfigError, ModelConfig
from jctr.data.batch import Batch
from jctr.embedding.sparse_embedding import EmbeddingSpec
from jctr.errors import UserError
from jctr.models.ctr import TrainState
from jctr.ops.dispatch import deterministic_gpu
from jctr.sharding.mesh import (
    build_mesh,
    describe_mesh,
    global_batch,
    mesh_devices,
    replicated,
    sharded,
)
from jctr.sharding.plan import device_memory_bytes, format_bytes, plan_embeddings
from jctr.sharding.sharded_embeddings import ShardedEmbeddings, globalize_segments


def dense_bytes(init_state: Callable[[], TrainState]) -> int:
    """Bytes of the dense parameters plus the dense optimizer state (one copy), from shapes
    only."""
    shapes = jax.eval_shape(lambda: (lambda st: (st.params, st.batch_stats, st.opt_state))(
        init_state()))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


class PlacedModel:
    """Where a model's state lives and how arrays get there.

    ``engine`` is None on one device; on a mesh it is the :class:`ShardedEmbeddings` with the
    solver's ``all2all_capacity_factor`` (small send buffers for the usual batch) and
    ``engine_full`` the one that fits any batch.
    """

    def __init__(self, cfg: ModelConfig, specs: tuple[EmbeddingSpec, ...], *,
                 dense_bytes: int = 0):
        self.cfg = cfg
        self.specs = specs
        self.mesh = build_mesh(cfg.solver.gpu, cfg.source)
        self.device = mesh_devices(cfg.solver.gpu, cfg.source)[0]  # the one device, if one
        self.num_devices = 1 if self.mesh is None else self.mesh.devices.size
        self._check_batch_sizes()
        # the plan is checked against device memory before any table is allocated
        self.plan = plan_embeddings(cfg, specs, self.num_devices, dense_bytes=dense_bytes,
                                    device_memory=device_memory_bytes(self.device),
                                    shared_memory=self.device.platform == "cpu")
        self.placements = self.plan.placements
        if self.mesh is None:
            self.engine = self.engine_full = None
            self.state_shardings = None
        else:
            factor = cfg.solver.all2all_capacity_factor or None
            self.engine_full = ShardedEmbeddings(self.mesh, specs, self.placements)
            self.engine = (ShardedEmbeddings(self.mesh, specs, self.placements, factor)
                           if factor else self.engine_full)
            rep = replicated(self.mesh)
            self.state_shardings = TrainState(rep, rep, rep, rep, rep,
                                              self.engine.shardings(), rep)

    def describe(self) -> str:
        lines = [describe_mesh(self.mesh), self.plan.describe()]
        evicting = [s.name for s in self.specs if s.eviction is not None]
        if evicting and self.device.platform == "gpu" and not deterministic_gpu():
            # (the GPU insert kernel's claims race; ordered ones cost ~20x: docs/kernels.md)
            lines.append(f"[jctr] note: {', '.join(evicting)} evict on a GPU without XLA's "
                         "deterministic ops, so a resumed or repeated run may evict other "
                         "keys than the uninterrupted one; XLA_FLAGS=--xla_gpu_deterministic_"
                         "ops=true makes them the same, bit for bit (slower)")
        return "\n".join(lines)

    # ---- abstract arrays: compile and size the steps before any table is allocated --------

    def _shard(self, sharding):
        return lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    def abstract_state(self, init_state: Callable[[], TrainState]) -> TrainState:
        """The state :meth:`create` would make, as shapes with their shardings."""
        if self.mesh is None:
            return jax.tree.map(self._shard(SingleDeviceSharding(self.device)),
                                jax.eval_shape(init_state))
        shapes = jax.eval_shape(lambda: init_state()._replace(embeddings=self.engine.init()))
        return jax.tree.map(lambda sh, sub: jax.tree.map(self._shard(sh), sub),
                            self.state_shardings, shapes,
                            is_leaf=lambda x: isinstance(x, Sharding))

    def abstract_batch(self, batch_size: int) -> Batch:
        """A global batch of ``batch_size`` samples on the devices, as shapes."""
        data = self.cfg.data
        put = self._shard(SingleDeviceSharding(self.device) if self.mesh is None
                          else sharded(self.mesh))
        sds = lambda shape, dtype: put(jax.ShapeDtypeStruct(shape, dtype))  # noqa: E731
        keys = tuple(sds((batch_size * sp.key_positions,), np.int64) for sp in data.sparse)
        return Batch(sds((batch_size, data.label_dim), np.float32),
                     sds((batch_size, data.dense_dim), np.float32), keys,
                     tuple(sds(k.shape, np.int32) for k in keys), sds((batch_size,), np.bool_))

    def local_devices(self) -> int:
        """Devices of the mesh this process drives (they share its host memory on CPU)."""
        if self.mesh is None:
            return 1
        return sum(d.process_index == jax.process_index() for d in self.mesh.devices.ravel())

    def state_bytes_per_device(self, abstract_state: TrainState) -> int:
        """Bytes of one device's part of the state."""
        total = 0
        for x in jax.tree.leaves(abstract_state):
            shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
            total += int(np.prod(shape)) * x.dtype.itemsize
        return total

    def _check_batch_sizes(self) -> None:
        for name in ("batchsize", "batchsize_eval"):
            value = getattr(self.cfg.solver, name)
            if value % self.num_devices or value % jax.process_count():
                raise ConfigError(f"solver.{name}", f"{value} does not split evenly over "
                                  f"{self.num_devices} devices in {jax.process_count()} "
                                  "process(es); use a multiple of the device count",
                                  self.cfg.source)

    def create(self, init_state: Callable[[], TrainState]) -> TrainState:
        """The initial state on the device(s): tables in the engine's layout, everything else
        replicated. A device (or process) that cannot hold them is an error naming each
        table's share, not the allocator's internal message."""
        try:
            if self.mesh is None:
                return jax.device_put(init_state(), self.device)

            def init_sharded():
                return init_state()._replace(embeddings=self.engine.init())

            return jax.jit(init_sharded, out_shardings=self.state_shardings)()
        except (MemoryError, RuntimeError) as e:
            text = str(e)
            if not isinstance(e, MemoryError) and "RESOURCE_EXHAUSTED" not in text \
                    and "out of memory" not in text.lower():
                raise
            tables = "; ".join(f"{t.name} {format_bytes(max(t.bytes_per_device))}"
                               for t in self.plan.tables)
            raise UserError(
                f"the model's state does not fit: allocating it failed "
                f"({_first_line(text) or type(e).__name__}); per device: {tables}; dense "
                f"{format_bytes(self.plan.dense_bytes)}. Lower max_vocabulary_size_per_gpu "
                "(or use more devices), or give the process more memory (ulimit -v, the "
                "container's limit)") from None

    def put_replicated(self, tree: Any) -> Any:
        """Dense arrays (parameters, statistics) where the dense part of the state lives."""
        return jax.device_put(tree, self.device if self.mesh is None
                              else replicated(self.mesh))

    def jit(self, fn: Callable, *, donate_state: bool = False, returns_state: bool = False,
            compiler_options: dict | None = None) -> Callable:
        """``fn(state, batch, ...)`` jitted for this placement; with ``returns_state`` the
        result is ``(state, other)`` and the new state keeps the state's shardings."""
        kwargs: dict[str, Any] = {"compiler_options": compiler_options}
        if donate_state:
            kwargs["donate_argnums"] = 0
        if returns_state and self.mesh is not None:
            kwargs["out_shardings"] = (self.state_shardings, replicated(self.mesh))
        return jax.jit(fn, **kwargs)

    def to_devices(self, batch: Batch, process_local: bool) -> Batch:
        """Host batch -> device arrays. On a mesh the batch is split over the devices; a
        ``process_local`` batch is this process's share (its segment ids are made global)."""
        if self.mesh is None:
            return jax.device_put(batch, self.device)
        if process_local and jax.process_count() > 1:
            batch = globalize_segments(batch, tuple(sp.slot_num for sp in self.cfg.data.sparse),
                                       jax.process_index(), jax.process_count())
        return global_batch(self.mesh, batch)

    def routing_fits(self, local_batch: Batch) -> bool:
        """Whether this process's batch fits the small all-to-all buffers (host check)."""
        if self.engine is None or self.engine is self.engine_full:
            return True
        return self.engine.fits(local_batch, self.num_devices // jax.process_count())

    @staticmethod
    def process_share(batch: Batch) -> Batch:
        """This process's contiguous share of a batch every process read whole."""
        n, p = jax.process_count(), jax.process_index()
        if n == 1:
            return batch
        cut = lambda x: x[p * x.shape[0] // n:(p + 1) * x.shape[0] // n]  # noqa: E731
        return Batch(cut(batch.label), cut(batch.dense), tuple(map(cut, batch.keys)),
                     tuple(map(cut, batch.segments)), cut(batch.mask))

    @staticmethod
    def copy_to_host(tree: Any) -> Any:
        """A host copy of this process's part of every array in ``tree`` (one numpy array per
        distinct shard, replicas stored once), for :meth:`copy_to_devices`: keeping the best
        weights without a second copy in device memory."""
        return jax.tree.map(HostCopy.of, tree)

    @staticmethod
    def copy_to_devices(tree: Any) -> Any:
        """The arrays of a :meth:`copy_to_host` copy, placed again as they were."""
        return jax.tree.map(lambda h: h.to_device() if isinstance(h, HostCopy) else h, tree,
                            is_leaf=lambda x: isinstance(x, HostCopy))


def _index_key(index: tuple) -> tuple:
    return tuple((s.start, s.stop) for s in index)


class HostCopy:
    """One array's addressable shards on the host, with the sharding to put them back."""

    def __init__(self, shape, sharding, shards: dict):
        self.shape, self.sharding, self.shards = shape, sharding, shards

    @classmethod
    def of(cls, array: Any) -> Any:
        if not isinstance(array, jax.Array):
            return array
        shards = {}
        for shard in array.addressable_shards:
            key = _index_key(shard.index)
            if key not in shards:
                shards[key] = np.array(shard.data)
        return cls(array.shape, array.sharding, shards)

    def to_device(self) -> jax.Array:
        return jax.make_array_from_callback(self.shape, self.sharding,
                                            lambda index: self.shards[_index_key(index)])


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:200] if text.strip() else ""
