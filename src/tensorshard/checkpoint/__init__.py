"""Checkpoints of split models: gathered (unsplit) saves, sharded saves that reload at any device count."""

from .gather import gathered_state_dict, save_tensor_parallel

__all__ = ["gathered_state_dict", "save_tensor_parallel"]
