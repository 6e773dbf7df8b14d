"""Kernels and their jnp references. Code elsewhere calls these names only; ``dispatch`` picks
the implementation per platform (Pallas/Triton kernels on GPU, the XLA formulations and native
kernels for the hash lookup and the dot interaction on CPU)."""

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.ops.bag import embedding_bag, gather_rows, key_gradients, sum_at_representatives
from jctr.ops.dispatch import (
    dot_interaction,
    embedding_bag_backward,
    embedding_bag_forward,
    every_platform,
    evict_rows,
    find_and_assign,
    find_slots,
    host_callback,
    initialize_rows,
    linear,
    rebuild_slots,
    row_rule_by_segment,
    sgd_by_segment,
)
from jctr.ops.hashing import (
    EMPTY_KEY,
    hash_keys,
    home_slots,
    key_uniform,
    mix64,
    owner_shards,
    owner_shards_host,
    representatives,
)
from jctr.ops.interaction import dot_interaction_reference, interaction_output_dim

__all__ = [
    "EMPTY_KEY", "dot_interaction", "dot_interaction_reference", "embedding_bag",
    "embedding_bag_backward", "embedding_bag_forward", "every_platform", "evict_rows",
    "find_and_assign", "find_slots", "gather_rows", "hash_keys", "home_slots", "host_callback",
    "initialize_rows",
    "interaction_output_dim", "key_gradients", "key_uniform", "linear", "mix64",
    "owner_shards", "owner_shards_host", "rebuild_slots", "representatives", "row_rule_by_segment",
    "sgd_by_segment",
    "sum_at_representatives",
]
