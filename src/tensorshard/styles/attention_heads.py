"""`AttentionHeads`, a style for transformers presets that `Heads` does not cover.

`AttentionHeads`: `Heads`, plus per-head inputs built outside the attention (ALiBi biases) and a guard for
fused layouts that keep each KV group's query heads next to its K and V.

    "h.*.self_attention": AttentionHeads(num_heads=16, head_dim=64, attrs={"num_heads": "heads"},
                                         head_inputs={"alibi": "batch*heads"})

``head_inputs`` names arguments of the module's forward that carry a slice per *query head* of the whole
model, and their layout: ``"batch*heads"`` (heads folded into dim 0 after the batch, as BLOOM's ALiBi
tensor of shape (batch * heads, 1, keys)) or ``"heads"`` (heads in dim 1, as Falcon's ALiBi and the mask
it is folded into; a size of 1 there broadcasts over heads and is left alone). Each device keeps the
slices of its own heads (`comm.split`: in backward the gradient is gathered, so a replicated input keeps
its full gradient on every device).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from ..partition import Partition
from .style import ShardContext, Splits, original_forward, register, wrap_forward
from .heads import Heads

LAYOUTS = ("batch*heads", "heads")


@register("attention_heads")
@dataclass(frozen=True, kw_only=True)
class AttentionHeads(Heads):
    """`Heads`, plus per-head inputs and a guard for fused per-group layouts.

    Args:
        head_inputs: forward argument -> layout ("batch*heads" or "heads") of a tensor holding every
            query head's slice; each device keeps its heads' slices.
        whole_kv_groups: the module's fused projection stores each KV group's query heads together with
            that group's K and V (Falcon's new decoder architecture), so a KV head cannot be replicated on
            several devices: the split needs at most num_kv_heads devices.
    """

    head_inputs: dict[str, str] = field(default_factory=dict)
    whole_kv_groups: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, layout in self.head_inputs.items():
            if layout not in LAYOUTS:
                raise ValueError(f"AttentionHeads head_inputs[{name!r}] = {layout!r}: use one of {LAYOUTS}")

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        if self.whole_kv_groups and ctx.world_size > self.kv:
            raise ValueError(
                f"{ctx.name}: its fused query/key/value projection keeps each of its {self.kv} KV groups in one "
                f"block, so it can be split over at most {self.kv} devices, not {ctx.world_size}. Use fewer "
                "devices, or replicate this attention in the plan."
            )
        params = inspect.signature(original_forward(module)).parameters
        missing = [name for name in self.head_inputs if name not in params]
        if missing:
            raise ValueError(
                f"{ctx.name}: head_inputs names {missing}, but {type(module).__name__}.forward takes {list(params)}"
            )
        return super().shard(module, ctx)

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        super().attach(module, splits, ctx)
        if not self.head_inputs:
            return
        comm, name, heads = ctx.comm, ctx.name, ctx.heads
        run = original_forward(module)
        signature = inspect.signature(run)
        parts = Partition(heads.num_heads, tuple((q,) for q in heads.q))  # query-head ranges per device

        def local(x: torch.Tensor, layout: str) -> torch.Tensor:
            if layout == "heads":
                return x if x.shape[1] == 1 else comm.split(x, 1, parts, where=name)
            # (batch * heads, ...) -> (batch, heads, ...) -> this device's heads -> (batch * local heads, ...)
            folded = x.view(-1, heads.num_heads, *x.shape[1:])
            return comm.split(folded, 1, parts, where=name).flatten(0, 1)

        def forward(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            for arg, layout in self.head_inputs.items():
                value = bound.arguments.get(arg)
                if isinstance(value, torch.Tensor):
                    bound.arguments[arg] = local(value, layout)
            return run(*bound.args, **bound.kwargs)

        wrap_forward(module, forward)
