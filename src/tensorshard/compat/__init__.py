"""Code written for the `tensor_parallel` package (2.0), run on tensorshard: ``import tensorshard.compat as tp``.

    import tensorshard.compat as tp
    model = tp.tensor_parallel(model, ["cuda:0", "cuda:1"])                     # as before
    model = tp.tensor_parallel(model, devices, tensor_parallel_config=tp.Config(state_rules={...}, ...))
    with tp.save_tensor_parallel(model):
        torch.save(model.state_dict(), "model.pt")

The names and arguments mean what the original's README and docstrings say; the work is done by
tensorshard's plans and engines (a `Config` becomes a `Plan`: translate.py). What differs, and why, is in
docs/migrating.md.
"""

from ..checkpoint import infer_sharded_device_map, save_tensor_parallel
from ..styles import HeadsWithValues, PerDeviceValues
from .actions import Scale, Split, SplitInChunks, SplitInGroupedChunks, StateAction
from .check import UntranslatableConfig
from .config import Config
from .dispatch import convert_state_dict
from .entry import Sharded, TensorParallel, TensorParallelPreTrainedModel, tensor_parallel

__all__ = [
    "Config",
    "HeadsWithValues",
    "PerDeviceValues",
    "Scale",
    "Sharded",
    "Split",
    "SplitInChunks",
    "SplitInGroupedChunks",
    "StateAction",
    "TensorParallel",
    "TensorParallelPreTrainedModel",
    "UntranslatableConfig",
    "convert_state_dict",
    "infer_sharded_device_map",
    "save_tensor_parallel",
    "tensor_parallel",
]
