"""IA3 adapters on split layers: each learned scale vector follows the split of the features it scales.

An IA3 layer (PEFT's ``ia3.Linear``) rescales features elementwise by a learned vector l: the output
features, ``y = base(x) * l``, or, for a layer PEFT calls feed-forward, the input features,
``y = base(x * l)``. Beside a split base layer the vector is split where the features are, and no
collective is added:

    column-parallel base (output features split)       row-parallel base (input features split)
      scales outputs:  l_d split like W's rows           scales inputs:   l_d split like W's columns,
                       y_d = W_d x * l_d                                   y = all_reduce(W_d (x_d * l_d))
      scales inputs:   l whole; x replicated, so         scales outputs:  l whole; y is whole after the
                       every device scales it alike                        base layer's all-reduce

Gradients come out whole without an extra reduction: a whole l scaling the input of a column-parallel
layer sits before that layer's `copy_to_parallel` (whose backward all-reduce completes dL/d(x l)), and a
whole l scaling a row-parallel layer's output sees the replicated output and its replicated gradient.
Rows of replicated KV heads (fewer KV heads than devices) sum their gradient over the devices holding them,
as the base weight's do.

Two styles, which `adapter_plan.py` puts in a plan for every IA3 layer it finds: ``Ia3Parallel`` on the
IA3 layer (its forward, where the split needs one) and ``Ia3Scale`` on its ``ia3_l`` vectors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ...partition import block_partition, kv_local_ranges
from ...styles.column import tie_ranges
from ...styles.style import ShardContext, Splits, Style, check_choices, original_forward, register, wrap_forward
from .adapter_layer_style import AdapterLayerStyle
from .lora_styles import with_views


def ia3_layer_problem(module: nn.Module) -> str | None:
    """Why this PEFT IA3 layer cannot follow a split base layer, or None when it can (a Linear / Conv1D)."""
    if not isinstance(getattr(module, "ia3_l", None), nn.ParameterDict):
        return f"{type(module).__name__} is not an IA3 layer"
    if type(module).__name__ != "Linear":
        return f"IA3 on a {type(module).__name__} layer (only Linear and transformers' Conv1D layers follow a split)"
    return None


@register("ia3")
@dataclass(frozen=True, kw_only=True)
class Ia3Parallel(AdapterLayerStyle):
    """The forward of a PEFT IA3 layer whose base layer is split (see the module docstring); ``base``: how its
    ``.base_layer`` is split, ``"column"`` or ``"row"`` (adapter_layer_style.py)."""

    fix = "Leave this layer out of the adapter (IA3Config target_modules), or keep it whole in the plan"
    layer_problem = staticmethod(ia3_layer_problem)

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        run = original_forward(module)  # PEFT's own forward is right, except for a row-parallel base's inputs
        if self.base == "row" and module.is_feedforward:

            def run(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
                active = [a for a in module.active_adapters if a in module.ia3_l]
                if module.disable_adapters and module.merged:
                    module.unmerge()
                if module.disable_adapters or module.merged or not active:
                    return module.base_layer(x, *args, **kwargs)
                dtype = module.ia3_l[active[-1]].dtype
                scaling = 1
                for adapter in active:
                    scaling = scaling * module.ia3_l[adapter].flatten()  # this device's slice of the input features

                def scaled(x_r: torch.Tensor) -> torch.Tensor:  # x_r: this device's input slice
                    return (x_r.to(dtype) * scaling).to(x_r.dtype)

                return module.base_layer(x, *args, before_matmul=scaled, **kwargs)

        def forward(*args, **kwargs):
            views = getattr(module.ia3_l, "tied_views", None)  # set by Ia3Scale for replicated KV heads
            return run(*args, **kwargs) if views is None else with_views(module.ia3_l, run, views)(*args, **kwargs)

        wrap_forward(module, forward)


@register("ia3_scale")
@dataclass(frozen=True, kw_only=True)
class Ia3Scale(Style):
    """The ``ia3_l`` vectors of an IA3 layer on a split base (a ParameterDict, one vector per adapter).

    Args:
        split: ``"output"``: split like the base layer's output features (vectors of shape (out, 1));
            ``"input"``: like its input features (shape (1, in)); ``"whole"``: whole on every device.
        blocks: the base layer's ``blocks`` (heads, fused q|k|v).
    """

    split: Literal["output", "input", "whole"]
    blocks: tuple[int | str, ...] | None = None

    def __post_init__(self) -> None:
        check_choices(self, "split")

    def beside(self, module: nn.Module, part) -> Splits:
        """As `shard`, for vectors created beside a base layer already split by `part` (see Ia3Parallel)."""
        if self.split == "whole":
            return {}
        return {name: (0 if self.split == "output" else 1, part) for name in module._parameters}

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        if not isinstance(module, nn.ParameterDict):
            raise NotImplementedError(f"Ia3Scale cannot split {ctx.name} ({type(module).__name__}): expected the "
                                      "ia3_l ParameterDict of a PEFT IA3 layer")
        if self.split == "whole":
            return {}
        dim = 0 if self.split == "output" else 1
        splits = {}
        for name, p in module._parameters.items():
            part = block_partition(p.shape[dim], ctx.world_size, self.blocks, ctx.heads, where=f"{ctx.name}.{name}", plain_sizes=ctx.plain_sizes)
            if part.overlapping and self.split == "input":
                raise NotImplementedError(f"{ctx.name}: an IA3 vector over a layer's inputs cannot read replicated KV heads")
            splits[name] = (dim, part)
        return splits

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        overlapping = {n: part for n, (_, part) in splits.items() if part.overlapping}
        if not overlapping:
            return
        comm, where = ctx.comm, ctx.name
        groups = ctx.heads.kv_sharers()
        tied = {n: kv_local_ranges(p.size, ctx.world_size, self.blocks or (), ctx.heads, ctx.rank, ctx.plain_sizes) for n, p in overlapping.items()}
        # Replicated KV heads: the IA3 layer's forward (Ia3Parallel) reads these vectors through views whose
        # gradient sums over the devices holding the same head.
        module.tied_views = lambda: {n: tie_ranges(module._parameters[n], 0, r, comm, groups, where) for n, r in tied.items()}

