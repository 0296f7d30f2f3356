"""The original's hand-loading helpers: `convert_state_dict` with its signature (a `Config` needs
no model). `infer_sharded_device_map` is tensorshard's own (device strings, which accelerate takes).

    with accelerate.init_empty_weights():
        model = tp.TensorParallel(MyModel(), device_ids=["cuda:0", "cuda:1"], tensor_parallel_config=config)
    sd = tp.convert_state_dict(torch.load("part_1.bin"), tensor_parallel_config=model.tensor_parallel_config,
                               world_size=len(model.devices))
    device_map = tp.infer_sharded_device_map(model)          # {"module_shards.1.fc.weight": "cuda:1", ...}
    for name, tensor in sd.items():
        accelerate.utils.set_module_tensor_to_device(model, name, device_map[name], value=tensor)
    model.apply_sharding()                                    # ZeRO-3, now that the weights are there

Keys are ``module_shards.<rank>.<name>``, for a plain and a transformers model alike (tensorshard's split
transformers model has no ``wrapped_model.`` level, so `for_pretrained` changes nothing), without the
original's ``tp_wrapped_module.`` levels and ``_sanity_check_params`` entries.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

import tensorshard as ts
from ..checkpoint import infer_sharded_device_map, save_tensor_parallel  # noqa: F401 - the original's dispatch module held them
from .config import Config
from .rules import pattern_text, read_action


def convert_state_dict(
    input_state_dict: Mapping[str, torch.Tensor],
    tensor_parallel_config: Config | ts.Plan | dict | None = None,
    world_size: int | None = None,
    for_pretrained: bool = False,
    *,
    model: nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """Split (part of) an unsplit state dict into the tensors of each device, as the split model names them.

    `tensor_parallel_config`: ``model.tensor_parallel_config`` of the split model (its layout), or the
    `Config` it was split with. A Config needs no model: each tensor is cut by its state rule, which the
    translation guarantees is the split the model holds, except that a "scale"d bias stays whole (tensorshard
    adds it once, after the sum). A tensorshard `Plan` needs `model=` (the unsplit module, e.g. on meta).
    """
    if not isinstance(for_pretrained, bool):
        raise TypeError(f"for_pretrained must be True or False; got {for_pretrained!r}")
    if not isinstance(tensor_parallel_config, Config) or model is not None:  # the layout from a model
        return ts.convert_state_dict(input_state_dict, tensor_parallel_config=tensor_parallel_config,
                                     world_size=world_size, model=model)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"convert_state_dict needs world_size=<number of devices>; got {world_size!r}")
    out: dict[str, torch.Tensor] = {}
    for rank in range(world_size):
        for name, tensor in input_state_dict.items():
            hit = tensor_parallel_config.state_rule(name)
            rule = read_action(hit[1], world_size) if hit else None
            if isinstance(rule, str):
                raise ValueError(f"convert_state_dict: state_rules[{pattern_text(hit[0])!r}] (matches {name}): {rule}")
            if rule is not None and rule.kind == "split":
                local = rule.action(world_size)(tensor, rank)
            else:  # whole on every device, each with its own copy
                local = tensor if rank == 0 else tensor.clone()
            out[f"module_shards.{rank}.{name}"] = local
    return out
