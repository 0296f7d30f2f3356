"""tensorshard: tensor parallelism for any PyTorch model.

    import tensorshard as tp
    model = tp.tensor_parallel(model, ["cuda:0", "cuda:1"])

One set of plans and styles, two engines: in one process over a list of devices (`TensorParallel`), or
under torchrun on torch.distributed (`parallelize`).
"""

from .api import tensor_parallel
from .checkpoint import gathered_state_dict, save_tensor_parallel
from .comm.counter import CollectiveCounter, count_collectives
from .engines.inprocess import TensorParallel
from .memory import memory_per_device
from .partition import HeadGroups, Partition, split_evenly
from .plans.explain import explain
from .plans.infer import infer_plan
from .plans.plan import Plan
from .styles import ColwiseParallel, EmbeddingParallel, Heads, Replicate, RowwiseParallel, ShardParams, Style, SumGrads

__version__ = "0.1.0"

__all__ = [
    "CollectiveCounter",
    "ColwiseParallel",
    "EmbeddingParallel",
    "HeadGroups",
    "Heads",
    "Partition",
    "Plan",
    "Replicate",
    "RowwiseParallel",
    "ShardParams",
    "Style",
    "SumGrads",
    "TensorParallel",
    "count_collectives",
    "explain",
    "gathered_state_dict",
    "infer_plan",
    "memory_per_device",
    "save_tensor_parallel",
    "split_evenly",
    "tensor_parallel",
]
