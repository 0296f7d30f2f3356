"""Copies of a split model: ``copy.deepcopy(split)`` builds a second split model; pickling is refused.

A split model's shards run forwards that the styles installed as closures over the shard's modules and
the devices' collectives (threads, locks, barriers), so copying its objects one by one would either fail
or, worse, leave the copy calling the original's layers. `deep_copy` builds the copy the way the original
was built: the consumed original (kept, empty, on the meta device) is copied and split again with the
same devices, plan and options, then every shard's tensors are cloned into the new shards (ties kept),
and every submodule takes the train/eval mode and ``requires_grad`` of its counterpart. Memory: one more
copy of every device's slices, on that device. Hooks a user registered on the shards are not copied.

Pickling (``torch.save(split)``) is refused with an error naming the savers that work.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...model_kind import model_kind
from ...plans.sharding import direct_tensors
from ..resplit import unmark_consumed


def deep_copy(model, memo: dict):
    original, hook_id = model.__dict__["_consumed"]
    skeleton = copy.deepcopy(original)  # meta tensors: only the module tree is copied
    skeleton._forward_pre_hooks.pop(hook_id, None)  # the "this model was split" guard of the original
    unmark_consumed(skeleton)
    zero = list(dict.fromkeys(getattr(model, "zero_splits", None) or {}))
    new = type(model)(
        skeleton, list(model.devices), output_device=model.output_device, plan=model.plan, timeout=model.timeout,
        debug=model.debug, sharded=bool(zero), sharded_param_names=zero or None, check=False,
        balance=model.balance, kind=model_kind(skeleton),  # a new split: its kind, asked once (a wrapper's inner model is the copy's)
    )
    memo[id(model)] = new
    for old_shard, new_shard in zip(model.module_shards, new.module_shards):
        clones: dict[int, torch.Tensor] = {}
        new_modules = dict(new_shard.named_modules(remove_duplicate=False))
        added = sorted(n for n, _ in old_shard.named_modules(remove_duplicate=False) if n not in new_modules)
        if added:
            raise NotImplementedError(
                f"copy.deepcopy of a split model whose shards gained modules after splitting ({', '.join(added[:3])}"
                f"{', ...' if len(added) > 3 else ''}: adapters added after splitting?): add them before splitting, "
                "or save the model (tp.save_sharded) and load it into a new split"
            )
        for name, old in old_shard.named_modules(remove_duplicate=False):
            target = new_modules[name]
            target.training = old.training
            for kind, tname, t in direct_tensors(old):
                if id(t) not in clones:
                    data = t.detach().clone()
                    clones[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if kind == "param" else data
                (target._parameters if kind == "param" else target._buffers)[tname] = clones[id(t)]
    new.training = model.training
    return new


def refuse_pickle(model) -> None:
    raise TypeError(
        f"a split {type(model).__name__} cannot be pickled (torch.save(model)): its shards run on threads and "
        "collectives of this process. Save its weights instead: tp.save_sharded(model, folder) (each device "
        "its slices; tp.load_sharded / tp.from_pretrained reload at any device count), or, for the unsplit "
        "model's state dict, `with tp.save_tensor_parallel(model): torch.save(model.state_dict(), path)`."
    )
