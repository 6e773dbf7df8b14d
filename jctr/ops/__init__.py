"""Operations with jnp reference implementations; the one place that picks an implementation
by platform (the GPU kernels issue adds Pallas variants behind these names)."""

from jctr.ops.dispatch import dot_interaction, embedding_bag_backward, embedding_bag_forward
from jctr.ops.embedding_bag import embedding_bag
from jctr.ops.hashing import EMPTY_KEY, find_slots, hash_keys, home_slots, representatives
from jctr.ops.interaction import dot_interaction_reference, interaction_output_dim

__all__ = [
    "EMPTY_KEY", "dot_interaction", "dot_interaction_reference", "embedding_bag",
    "embedding_bag_backward", "embedding_bag_forward", "find_slots",
    "hash_keys", "home_slots", "interaction_output_dim", "representatives",
]
