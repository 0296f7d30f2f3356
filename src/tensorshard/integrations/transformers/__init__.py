"""transformers models split by tensorshard: still transformers models (generate, KV cache, save_pretrained).

model.py: a split PreTrainedModel; part_views.py: its parts (``split.model``, ``get_encoder()``) run on every
device; cache.py: per-device KV caches; wrapped.py: a module holding a transformers model (a split PeftModel
is one: ../peft/before_split.py).
"""

from torch import nn

from ...model_kind import TRANSFORMERS, WRAPPER, ModelKind
from ..peft.before_split import PeftTensorParallel, tensor_parallel_peft
from ..peft.recognised import PEFT
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


def tensor_parallel_transformers(module: nn.Module, kind: ModelKind, device_ids=None, **options) -> nn.Module:
    """Split a model that `model_kind` found to hold a transformers model, as its `kind` says: a transformers model
    (an instance of its class: model.py), a PeftModel (still a PeftModel: ../peft/before_split.py) or a module
    holding a transformers model (wrapped.py). The wrappers take the transformers model inside from `kind`."""
    if kind.name == TRANSFORMERS:
        split = tensor_parallel_pretrained(module, device_ids, kind=kind, **options)
    elif kind.name == PEFT:
        split = tensor_parallel_peft(module, device_ids, split_class=WrapperTensorParallel, kind=kind, **options)
    elif kind.name == WRAPPER:
        split = WrapperTensorParallel(module, device_ids, kind=kind, **options)
    else:
        raise ValueError(f"a {kind.name!r} model holds no transformers model; split it with tensorshard.TensorParallel")
    assemble_logits_once(split, kind)
    return split
