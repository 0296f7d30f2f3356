"""Parallel styles: how one module is split across devices. See base.py for the contract."""

from .attention_heads import AttentionHeads
from .style import STYLES, ShardContext, Style
from .channel import ChannelParallel
from .column import ColwiseParallel
from .embedding import EmbeddingParallel
from .heads import Heads
from .per_device import HeadsWithValues, PerDeviceValues
from .replicate import Replicate
from .row import RowwiseParallel
from .sequence import RowwiseToSequence, SequenceParallel
from .shard_params import ShardParams
from .sum_gradients import SumGradients
from .vocab_head import VocabParallelHead

__all__ = [
    "AttentionHeads",
    "STYLES",
    "ChannelParallel",
    "ColwiseParallel",
    "EmbeddingParallel",
    "Heads",
    "HeadsWithValues",
    "PerDeviceValues",
    "Replicate",
    "RowwiseParallel",
    "RowwiseToSequence",
    "SequenceParallel",
    "ShardContext",
    "ShardParams",
    "Style",
    "VocabParallelHead",
    "SumGradients",
]
