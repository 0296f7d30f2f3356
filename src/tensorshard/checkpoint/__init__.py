"""Checkpoints of split models.

- gathered (unsplit) saves: `save_tensor_parallel`, `gathered_state_dict`, `save_gathered` (gather.py);
- sharded saves that reload at any device count, with optimizer state: `save_sharded`, `load_sharded`;
- streaming loads straight into the devices: `from_pretrained`, `convert_state_dict`,
  `infer_sharded_device_map` (streaming.py).
"""

from .gather import gathered_state_dict, save_gathered, save_tensor_parallel
from .index import read_index
from .sharded import load_sharded, save_sharded
from .streaming import convert_state_dict, empty_weights, from_pretrained, infer_sharded_device_map

__all__ = [
    "convert_state_dict",
    "empty_weights",
    "from_pretrained",
    "gathered_state_dict",
    "infer_sharded_device_map",
    "load_sharded",
    "read_index",
    "save_gathered",
    "save_sharded",
    "save_tensor_parallel",
]
