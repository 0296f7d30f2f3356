"""transformers models split by tensorshard: still transformers models (generate, KV cache, save_pretrained).

model.py: a split PreTrainedModel; cache.py: per-device KV caches; wrapped.py: a module holding a
transformers model; peft.py: a split PeftModel (PEFT's adapter format).
"""

import sys

from torch import nn

from .cache import ShardedCache, rank_caches
from .model import TransformersTensorParallel, is_transformers_model, split_class, tensor_parallel_pretrained
from .wrapped import WrapperTensorParallel

__all__ = [
    "ShardedCache",
    "TransformersTensorParallel",
    "WrapperTensorParallel",
    "is_transformers_model",
    "rank_caches",
    "split_class",
    "tensor_parallel_pretrained",
    "tensor_parallel_transformers",
]


def tensor_parallel_transformers(module: nn.Module, device_ids=None, **options) -> nn.Module:
    """Split a transformers model (an instance of its class), a PeftModel (still a PeftModel: peft.py) or a
    module holding a transformers model (wrapped.py)."""
    peft = sys.modules.get("peft")  # a PeftModel's owner imported peft already
    if peft is not None and isinstance(module, peft.PeftModel):
        # deferred: peft.py imports peft, an optional heavy dependency (loaded already here)
        from .peft import tensor_parallel_peft

        return tensor_parallel_peft(module, device_ids, **options)
    if is_transformers_model(module):
        return tensor_parallel_pretrained(module, device_ids, **options)
    return WrapperTensorParallel(module, device_ids, **options)
