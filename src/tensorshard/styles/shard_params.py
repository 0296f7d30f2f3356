"""ShardParams: split the parameters of a module that is not a plain layer (fused MoE experts, a
per-channel norm after a split convolution), and say how its input and output are laid out.

    "mlp.experts": ShardParams(params={"gate_up_proj": {"dim": 1, "blocks": [I, I]},
                                       "down_proj": 2})        # input whole, output a partial sum

``input="replicate"``: every floating-point tensor argument is whole on every device and goes through
``copy_to_parallel`` (one all-reduce of its gradient in backward). ``input="split"``: the arguments
already arrive split (after a column-parallel layer); nothing is done.
``output="partial"``: every floating-point tensor the module returns is this device's share of a sum and
is all-reduced. ``output="split"``: returned as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..partition import block_partition
from .style import ShardContext, Splits, Style, check_choices, original_forward, register, wrap_forward


@register("shard_params")
@dataclass(frozen=True, kw_only=True)
class ShardParams(Style):
    """Split named parameters/buffers of a module along given dimensions.

    Args:
        params: name -> dim, or name -> {"dim": d, "blocks": [...]} (blocks as in ColwiseParallel).
        input: "replicate" or "split" (see module docstring).
        output: "partial" or "split".
    """

    params: dict[str, Any] = field(default_factory=dict)
    input: Literal["replicate", "split"] = "replicate"
    output: Literal["partial", "split"] = "partial"

    def __post_init__(self) -> None:
        check_choices(self, "input", "output")
        if not self.params:
            raise ValueError("ShardParams needs params={name: dim, ...}; to keep a module whole use Replicate()")
        for name, spec in self.params.items():
            dim, blocks = _spec(spec)
            if not isinstance(dim, int) or isinstance(dim, bool):
                raise TypeError(f"ShardParams params[{name!r}]: dim must be an int, got {dim!r}")

    @classmethod
    def _from_json(cls, name, value):
        return value

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        tensors = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        splits: Splits = {}
        for name, spec in self.params.items():
            if name not in tensors:
                raise ValueError(
                    f"{ctx.name}: ShardParams names {name!r}, but {type(module).__name__} has only "
                    f"{sorted(tensors)} as its own parameters/buffers"
                )
            dim, blocks = _spec(spec)
            t = tensors[name]
            if not -t.dim() <= dim < t.dim():
                raise ValueError(f"{ctx.name}.{name}: dim {dim} is out of range for shape {tuple(t.shape)}")
            dim %= t.dim()
            splits[name] = (dim, block_partition(t.shape[dim], ctx.world_size, blocks, ctx.heads, where=f"{ctx.name}.{name}", plain_sizes=ctx.plain_sizes))
        return splits

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        comm, name = ctx.comm, ctx.name
        run = original_forward(module)

        def floats(fn):
            return lambda t: fn(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        def forward(*args, **kwargs):
            if self.input == "replicate":
                args, kwargs = tree_map(floats(lambda t: comm.copy_to_parallel(t, where=name)), (args, kwargs))
            out = run(*args, **kwargs)
            if self.output == "partial":
                out = tree_map(floats(lambda t: comm.all_reduce(t, where=name)), out)
            return out

        wrap_forward(module, forward)


def _spec(spec: Any) -> tuple[int, tuple | None]:
    if isinstance(spec, dict):
        blocks = spec.get("blocks")
        return spec.get("dim"), tuple(blocks) if blocks else None
    return spec, None
