"""Checkpoints of split models.

- gathered (unsplit) saves: `save_tensor_parallel`, `gathered_state_dict`, `save_gathered` (gather.py);
- sharded saves that reload at any device count, with optimizer state: `save_sharded`, `load_sharded`;
- streaming loads straight into the devices: `load_pretrained` (streaming.py), behind `tensorshard.from_pretrained`;
  checkpoints in the hub's key layout are converted as transformers converts them (conversions.py);
- the `tensor_parallel` package's hand-loading helpers: `convert_state_dict`, `infer_sharded_device_map`
  (dispatch.py).

Each works for the in-process engine (`TensorParallel`) and, collectively, for a module split by
`parallelize` under torchrun (torchrun.py: the layout of one rank, and how the processes agree).
"""

from .hand_loading import convert_state_dict, infer_sharded_device_map
from .gather import gathered_state_dict, save_gathered, save_tensor_parallel
from .index import read_index
from .sharded import load_sharded, save_sharded
from .streaming import empty_weights

__all__ = [
    "convert_state_dict",
    "empty_weights",
    "gathered_state_dict",
    "infer_sharded_device_map",
    "load_sharded",
    "read_index",
    "save_gathered",
    "save_sharded",
    "save_tensor_parallel",
]
