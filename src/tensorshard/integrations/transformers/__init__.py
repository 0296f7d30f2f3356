"""transformers models split by tensorshard: still transformers models (generate, KV cache, save_pretrained).

model.py: a split PreTrainedModel; views.py: its parts (``split.model``, ``get_encoder()``) run on every
device; cache.py: per-device KV caches; wrapped.py: a module holding a transformers model (a split PeftModel
is one: ../peft/before_split.py).
"""

from torch import nn

from ...layers import is_peft_model
from ..peft.before_split import PeftTensorParallel, tensor_parallel_peft
from .cache import ShardedCache, rank_caches
from .model import TransformersTensorParallel, is_transformers_model, split_class, tensor_parallel_pretrained
from .split_logits import assemble_logits_once
from .wrapped import WrapperTensorParallel

__all__ = [
    "PeftTensorParallel",
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
    """Split a transformers model (an instance of its class), a PeftModel (still a PeftModel:
    ../peft/before_split.py) or a module holding a transformers model (wrapped.py)."""
    if is_peft_model(module):
        split = tensor_parallel_peft(module, device_ids, split_class=WrapperTensorParallel, **options)
    elif is_transformers_model(module):
        split = tensor_parallel_pretrained(module, device_ids, **options)
    else:
        split = WrapperTensorParallel(module, device_ids, **options)
    assemble_logits_once(split)
    return split
