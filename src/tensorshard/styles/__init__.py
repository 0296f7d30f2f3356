"""Parallel styles: how one module is split across devices. See base.py for the contract."""

from .base import STYLES, ShardContext, Style
from .column import ColwiseParallel
from .embedding import EmbeddingParallel
from .heads import Heads
from .replicate import Replicate
from .row import RowwiseParallel
from .shard_params import ShardParams
from .sum_grads import SumGrads

__all__ = [
    "STYLES",
    "ColwiseParallel",
    "EmbeddingParallel",
    "Heads",
    "Replicate",
    "RowwiseParallel",
    "ShardContext",
    "ShardParams",
    "Style",
    "SumGrads",
]
