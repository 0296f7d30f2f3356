"""The torchrun engine: one process per device, shards as DTensors on the tensor-parallel mesh (engine.py),
``tensor_parallel(distributed=True)``'s device choice and process group (launch.py), and the data helpers
that keep the ranks of a tensor-parallel group fed the same batch (data.py)."""

from .data import InputMismatchError, TensorParallelSampler, broadcast_batch, check_same_inputs
from .engine import TorchrunState, parallelize, synchronize_rng
from .launch import tensor_parallel_distributed

__all__ = [
    "InputMismatchError",
    "TensorParallelSampler",
    "TorchrunState",
    "broadcast_batch",
    "check_same_inputs",
    "parallelize",
    "synchronize_rng",
    "tensor_parallel_distributed",
]
