"""Key -> vector stores shared by serving and streaming: the CPU hash maps, a Redis cluster and
RocksDB (see :mod:`jctr.stores.base` for the protocol)."""

from jctr.stores.base import KeyValueStore, StoreError, StoreUnavailable
from jctr.stores.hash_map import HashMapStore

__all__ = ["HashMapStore", "KeyValueStore", "StoreError", "StoreUnavailable"]
