"""transformers models split by tensorshard: still transformers models (generate, KV cache, save_pretrained)."""

from .cache import ShardedCache, rank_caches
from .model import TransformersTensorParallel, is_transformers_model, split_class, tensor_parallel_pretrained

__all__ = [
    "ShardedCache",
    "TransformersTensorParallel",
    "is_transformers_model",
    "rank_caches",
    "split_class",
    "tensor_parallel_pretrained",
]
