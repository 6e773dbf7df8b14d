"""Hash embeddings: tables with dynamic insertion of 64-bit keys, bags, row-wise optimizers."""

import jctr._x64  # noqa: F401  (64-bit keys on before JAX makes an array)
from jctr.embedding.hash_table import HashTable, TableFullError, create_table, export_items, lookup
from jctr.embedding.sparse_embedding import (
    EmbeddingSpec,
    EmbeddingState,
    apply_gradients,
    init_embedding,
    lookup_rows,
    pool,
)

__all__ = [
    "EmbeddingSpec", "EmbeddingState", "HashTable", "TableFullError", "apply_gradients",
    "create_table", "export_items", "init_embedding", "lookup", "lookup_rows", "pool",
]
