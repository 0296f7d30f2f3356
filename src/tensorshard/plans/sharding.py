"""From a plan to the split of every parameter and buffer: the part both engines share.

`shard_plan(module, plan, world_size)` matches the plan, builds the head groups of every `Heads` entry,
and asks each style how its module's tensors split; with ``balance=True`` it then resizes the MLP splits of
blocks whose heads split unevenly (plans/balance.py). It only reads the model: every error about the plan
(a pattern that matches nothing, a style on the wrong layer type, a dimension with fewer units than
devices, neighbouring layers that disagree on a split (plans/validate.py), a tied weight split two
different ways, a split tensor some module reads without calling its owner, a split through a quantization
block) is raised here, before any engine touches the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import quant
from ..comm.interface import NoComm
from ..partition import HeadGroups, Partition
from ..styles.heads import Heads
from .balance import balanced_layers
from .direct_reads import direct_reads
from .module_shard import ModuleShard
from .plan import Plan
from .validate import check_layouts


@dataclass
class ShardedModel:
    """The plan applied to a model: per-module styles and per-tensor splits."""

    world_size: int
    modules: dict[str, ModuleShard]
    tensors: dict[int, tuple[int, Partition] | None]  # id(tensor) -> split (None: replicated)

    def split_of(self, tensor: torch.Tensor) -> tuple[int, Partition] | None:
        return self.tensors.get(id(tensor))

    def slice_map(self, module: nn.Module) -> dict[str, tuple[int, Partition] | None]:
        """Original state-dict name -> split, for every parameter and buffer of `module` under each of its
        names (tied tensors appear once per name): the one map from an original tensor to its slices."""
        return {
            f"{module_name}.{name}" if module_name else name: self.split_of(tensor)
            for module_name, mod in module.named_modules(remove_duplicate=False)
            for _, name, tensor in direct_tensors(mod)
        }


def direct_tensors(module: nn.Module):
    """(kind, name, tensor) for the module's own parameters and buffers (not its children's)."""
    for name, p in module._parameters.items():
        if p is not None:
            yield "param", name, p
    for name, b in module._buffers.items():
        if b is not None:
            yield "buffer", name, b


def shard_plan(module: nn.Module, plan: Plan, world_size: int, *, balance: bool = False) -> ShardedModel:
    """The split of every tensor of `module` under `plan` at `world_size` devices; `balance`: even out each
    device's weights over every block whose attention heads split unevenly (plans/balance.py)."""
    assignments = plan.assign(module)
    by_name = dict(module.named_modules())
    groups: dict[str, HeadGroups] = {}
    for name, a in assignments.items():
        if isinstance(a.style, Heads):
            groups[name] = HeadGroups.build(a.style.num_heads, a.style.kv, world_size, where=name or "<root>")
    modules: dict[str, ModuleShard] = {}
    for name, a in assignments.items():
        heads = groups.get(a.heads_owner) if a.heads_owner is not None else None
        shard = ModuleShard(name, a.pattern, a.style, heads, {})
        shard.splits = a.style.shard(by_name[name], shard.context(0, world_size, NoComm(0, world_size)))
        modules[name] = shard
    if balance and world_size > 1:
        for name, sizes in balanced_layers(by_name, modules, world_size).items():
            shard = modules[name]
            shard.plain_sizes = sizes
            shard.splits = shard.style.shard(by_name[name], shard.context(0, world_size, NoComm(0, world_size)))
    for name, shard in modules.items():
        for tname, (dim, part) in shard.splits.items():
            quant.check_split(by_name[name], tname, dim, part, name or "<root>")  # no cut quantization block

    check_layouts(module, modules, world_size)  # neighbours agree on how the features they pass are split
    check_direct_reads(module, modules)

    # Every tensor (a tied weight appears under several modules) must be split one way only.
    tensors: dict[int, tuple[int, Partition] | None] = {}
    first_seen: dict[int, str] = {}
    for mod_name, mod in by_name.items():
        splits = modules[mod_name].splits if mod_name in modules else {}
        for _, tname, t in direct_tensors(mod):
            split = splits.get(tname)
            where = f"{mod_name}.{tname}" if mod_name else tname
            if id(t) in tensors and tensors[id(t)] != split:
                raise ValueError(
                    f"{where} is the same tensor as {first_seen[id(t)]} (tied weights), but the plan splits them "
                    f"differently ({_describe(split)} vs {_describe(tensors[id(t)])}). Give both modules styles "
                    "that split the tensor alike (e.g. EmbeddingParallel(split='vocab') with ColwiseParallel on "
                    "the output head), or replicate both."
                )
            tensors.setdefault(id(t), split)
            first_seen.setdefault(id(t), where)
    return ShardedModel(world_size, modules, tensors)


def check_direct_reads(module: nn.Module, modules: dict[str, ModuleShard]) -> None:
    """Refuse a plan that splits a tensor some module reads without calling its owner (plans/direct_reads.py)."""
    split = {f"{name}.{t}" if name else t: name for name, ms in modules.items() for t in ms.splits}
    if not split:
        return
    for reader, reads in direct_reads(module).items():
        hit = [t for t in reads if t in split]
        if hit:
            owner = split[hit[0]]
            more = f" (and {len(hit) - 1} more split tensor(s))" if len(hit) > 1 else ""
            raise ValueError(
                f"{reader or '<root>'} ({type(module.get_submodule(reader)).__name__}) reads {hit[0]}{more} itself in "
                f"its forward instead of calling {owner}, which the plan splits: it would compute with one "
                f"device's slice as if it were the whole tensor (PyTorch's MultiheadAttention and the fused fast "
                f"path of TransformerEncoderLayer in eval do this). Leave {owner} whole (remove its plan entry), "
                f"or give {reader or 'the model'} a forward that calls its submodules."
            )


def _describe(split) -> str:
    return "replicated" if split is None else f"split along dim {split[0]}"
