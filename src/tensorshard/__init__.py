"""tensorshard: tensor parallelism for any PyTorch model.

    import tensorshard as tp
    model = tp.tensor_parallel(model, ["cuda:0", "cuda:1"])

One set of plans and styles, two engines: in one process over a list of devices (`TensorParallel`), or
under torchrun on torch.distributed (`parallelize`).
"""

from .api import from_pretrained, parallelize, tensor_parallel
from .checkpoint import (
    convert_state_dict,
    gathered_state_dict,
    infer_sharded_device_map,
    load_sharded,
    save_gathered,
    save_sharded,
    save_tensor_parallel,
)
from .comm.counter import CollectiveCounter, count_collectives
from .comm.rendezvous import CollectiveAborted
from .comm.timeline import ShardTimeline, shard_timeline
from .engines.inprocess import PerDeviceOptimizer, TensorParallel, per_device_optimizer
from .engines.torchrun import InputMismatchError, TensorParallelSampler, broadcast_batch, check_same_inputs, synchronize_rng
from .plan_inference import infer_plan
from .integrations import causal_lm_loss as _causal_lm_loss  # noqa: F401  (registers its after_split hook)
from .integrations import hf_trainer as _hf_trainer  # noqa: F401  (registers its after_split hook)
from .integrations import peft as _peft  # noqa: F401  (registers what plans, styles and engines call; no PEFT import)
from .loss_parallel import vocab_parallel_cross_entropy
from .memory import memory_per_device
from . import optimizers
from .partition import HeadGroups, Partition, split_evenly
from .plans.explain import explain
from .plans.plan import Plan
from .plans.presets import preset_for
from .styles import (
    AttentionHeads,
    ChannelParallel,
    ColwiseParallel,
    EmbeddingParallel,
    Heads,
    Replicate,
    RowwiseParallel,
    RowwiseToSequence,
    SequenceParallel,
    ShardParams,
    Style,
    SumGradients,
    VocabParallelHead,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionHeads",
    "ChannelParallel",
    "CollectiveAborted",
    "CollectiveCounter",
    "ColwiseParallel",
    "EmbeddingParallel",
    "HeadGroups",
    "Heads",
    "InputMismatchError",
    "Partition",
    "PerDeviceOptimizer",
    "Plan",
    "Replicate",
    "RowwiseParallel",
    "RowwiseToSequence",
    "SequenceParallel",
    "ShardParams",
    "ShardTimeline",
    "Style",
    "SumGradients",
    "TensorParallel",
    "TensorParallelSampler",
    "VocabParallelHead",
    "broadcast_batch",
    "check_same_inputs",
    "convert_state_dict",
    "count_collectives",
    "explain",
    "from_pretrained",
    "gathered_state_dict",
    "infer_plan",
    "infer_sharded_device_map",
    "load_sharded",
    "memory_per_device",
    "parallelize",
    "optimizers",
    "per_device_optimizer",
    "preset_for",
    "save_gathered",
    "save_sharded",
    "save_tensor_parallel",
    "shard_timeline",
    "split_evenly",
    "synchronize_rng",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
]
