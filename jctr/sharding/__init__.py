"""Placement of embedding tables over a device mesh and across hosts (model parallel tables,
data parallel dense network), all-to-all routing with ``jax.shard_map``, multi-host start-up."""

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.sharding.distributed import cluster_from_env, initialize_distributed
from jctr.sharding.mesh import AXIS, build_mesh, describe_mesh, global_batch, mesh_devices, to_host
from jctr.sharding.plan import Placement, PlanError, ShardingPlan, plan_embeddings
from jctr.sharding.sharded_embeddings import ShardedEmbeddings

__all__ = [
    "AXIS", "Placement", "PlanError", "ShardedEmbeddings", "ShardingPlan", "build_mesh",
    "cluster_from_env", "describe_mesh", "global_batch", "initialize_distributed",
    "mesh_devices", "plan_embeddings", "to_host",
]
