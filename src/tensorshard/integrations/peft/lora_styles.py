"""LoRA adapters on split layers: each adapter follows the split of the layer it adapts.

A LoRA layer (PEFT's ``lora.Linear``) computes ``y = base(x) + s * B(A(x))`` with A: (r, in) and B: (out, r).
Beside a split base layer its two factors split so that no collective is added per layer:

    column-parallel base (W split by output rows)       row-parallel base (W split by input columns)
      x        replicated                                  x_d      this device's input slice
      A        whole on every device                       A_d      split by input columns, like W
      a = A x  replicated                                  a_d = A_d x_d   a partial sum of A x
      B_d      split by output rows, like W                B        whole on every device
      y_d = W_d x + s B_d a      (no communication)        y = all_reduce(W_d x_d + s B a_d) + bias
                                                               (the base layer's own all-reduce)

Backward: in the column case the adapter reads x through the base layer's `copy_to_parallel` (the same
node, so the one all-reduce of dL/dx covers both), and A's gradient is a partial sum over the devices (each
B_d sees only its outputs); in the row case B's gradient is a partial sum (each device's a_d is partial).
Those gradients go through `comm.partial_grads`: one reduction per backward pass for all adapters, not one
per layer. Merging (``merge_adapter``) works on the local slices: B_d A (column) and B A_d (row) are exactly
this device's slice of the merged weight.

DoRA (``use_dora=True``) adds a magnitude vector m over the output features and rescales every output row
by m / ||W + s B A||, the row norm of the adapted weight (detached, as in PEFT):

    column-parallel base: each device holds whole rows (W_d, B_d): its norms are local, m splits like B
    row-parallel base:    each device holds part of every row (W_d, A_d): the squared row norms of
                          W_d + s B A_d are summed over the devices (one small all-reduce per layer and
                          call); m stays whole, with partial gradients like B; each device adds
                          (m/n - 1) W_d x_d + (m/n) s B A_d x_d to the base layer's all-reduce

Four styles, which `adapter_plan.py` puts in a plan for every LoRA layer it finds:
``LoraParallel`` on the LoRA layer itself (its forward), the base layer's own style on ``.base_layer``,
``LoraFactor`` on each ``lora_A.<adapter>`` / ``lora_B.<adapter>``, and ``LoraMagnitude`` on each DoRA
``lora_magnitude_vector.<adapter>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ...partition import block_partition, kv_local_ranges
from ...styles.column import tie_ranges
from ...styles.style import ShardContext, Splits, Style, check_choices, original_forward, register, wrap_forward
from .adapter_layer_style import AdapterLayerStyle


def lora_layer_problem(module: nn.Module) -> str | None:
    """Why this PEFT LoRA layer cannot follow a split base layer, or None when it can (vanilla LoRA, Linear)."""
    if not (hasattr(module, "lora_A") and hasattr(module, "lora_B") and hasattr(module, "base_layer")):
        return f"{type(module).__module__}.{type(module).__name__} is not a LoRA or IA3 layer"
    if getattr(module, "lora_embedding_A", None):
        return "LoRA on an embedding (lora_embedding_A/B)"
    factors = list(module.lora_A.values()) + list(module.lora_B.values())
    if not all(type(f) is nn.Linear for f in factors):
        kinds = sorted({type(f).__name__ for f in factors if type(f) is not nn.Linear})
        return f"LoRA factors of type {', '.join(kinds)} (only nn.Linear factors are supported)"
    variants = getattr(module, "lora_variant", {}) or {}
    other = sorted({type(v).__name__ for v in variants.values() if type(v).__name__ != "DoraLinearVariant"})
    if other:
        names = [n.removesuffix("LinearVariant") or n for n in other]
        return f"the LoRA variant(s) {', '.join(names)} (only plain LoRA and DoRA follow a split)"
    if variants:
        weight = getattr(module.get_base_layer(), "weight", None)
        if weight is None or not weight.is_floating_point():
            return "DoRA on a quantized layer (its row norms would need the dequantized weight of every device)"
    if any((getattr(module, "lora_bias", {}) or {}).values()):
        return "lora_bias=True"
    return None


def is_dora(module: nn.Module, adapter: str) -> bool:
    return type((getattr(module, "lora_variant", {}) or {}).get(adapter)).__name__ == "DoraLinearVariant"


@register("lora")
@dataclass(frozen=True, kw_only=True)
class LoraParallel(AdapterLayerStyle):
    """The forward of a PEFT LoRA layer whose base layer is split (see the module docstring); ``base``: how its
    ``.base_layer`` is split, ``"column"`` or ``"row"`` (adapter_layer_style.py)."""

    fix = "Leave this layer out of the adapter (LoraConfig target_modules / exclude_modules), or use plain LoRA"
    layer_problem = staticmethod(lora_layer_problem)

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        if self.base == "column":
            return  # PEFT's own forward is right: the factors' styles place the collectives
        name = ctx.name

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if kwargs.pop("adapter_names", None) is not None:
                raise NotImplementedError(f"{name}: adapter_names= (mixed adapter batches) on a split model")
            if module.disable_adapters and module.merged:
                module.unmerge()  # as PEFT's forward: disabled adapters are never left merged in
            active = [a for a in module.active_adapters if a in module.lora_A]
            if module.disable_adapters or module.merged or not active:
                return module.base_layer(x, *args, **kwargs)

            def partial(x_r: torch.Tensor) -> torch.Tensor:
                """This device's share of the adapters' output, from its input slice x_r: summed over the
                devices in the base layer's all-reduce."""
                total = None
                for adapter in active:
                    A, B, scaling = module.lora_A[adapter], module.lora_B[adapter], module.scaling[adapter]
                    h = module.lora_dropout[adapter](module._cast_input_dtype(x_r, A.weight.dtype))
                    if is_dora(module, adapter):  # LoraMagnitude's forward (whole m, all-reduced row norms)
                        delta = module.lora_magnitude_vector[adapter](
                            h, lora_A=A, lora_B=B, scaling=scaling, base_layer=module.get_base_layer())
                    else:
                        delta = B(A(h)) * scaling
                    total = delta if total is None else total + delta
                return total

            return module.base_layer(x, *args, add_before_reduce=partial, **kwargs)

        wrap_forward(module, forward)


@register("lora_factor")
@dataclass(frozen=True, kw_only=True)
class LoraFactor(Style):
    """One factor (``lora_A.<adapter>`` or ``lora_B.<adapter>``, an nn.Linear) of a LoRA layer on a split base.

    Args:
        split: ``"output"``: rows split like the base layer's output (B of a column-parallel base);
            ``"input"``: columns split like the base layer's input (A of a row-parallel base);
            ``"whole_input"``: whole, reading the base layer's replicated input (A of a column base);
            ``"whole"``: whole (B of a row base). Whole factors get partial gradients, summed once per
            backward pass.
        blocks: the base layer's ``blocks`` (heads, fused q|k|v): the factor's split follows them.
    """

    split: Literal["output", "input", "whole_input", "whole"]
    blocks: tuple[int | str, ...] | None = None

    def __post_init__(self) -> None:
        check_choices(self, "split")

    def beside(self, module: nn.Module, part) -> Splits:
        """As `shard`, for a factor created beside a base layer already split by `part` (see LoraParallel)."""
        if self.split == "output":
            return {"weight": (0, part)} | ({"bias": (0, part)} if module.bias is not None else {})
        return {"weight": (1, part)} if self.split == "input" else {}

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        if type(module) is not nn.Linear:
            raise NotImplementedError(f"LoraFactor cannot split {ctx.name} ({type(module).__name__}); LoRA factors are nn.Linear")
        if self.split == "output":
            part = block_partition(module.out_features, ctx.world_size, self.blocks, ctx.heads, where=ctx.name, plain_sizes=ctx.plain_sizes)
            return {"weight": (0, part)} | ({"bias": (0, part)} if module.bias is not None else {})
        if self.split == "input":
            part = block_partition(module.in_features, ctx.world_size, self.blocks, ctx.heads, where=ctx.name, plain_sizes=ctx.plain_sizes)
            if part.overlapping:
                raise NotImplementedError(f"{ctx.name}: a LoRA A matrix cannot read replicated KV heads")
            return {"weight": (1, part)}
        return {}

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        comm, name = ctx.comm, ctx.name
        if self.split == "output":
            part = splits["weight"][1]
            module.out_features = part.local_size(ctx.rank)
            if not part.overlapping:
                return  # a plain local matmul: its input's gradient stays partial, summed by A's copy_to_parallel
            # Replicated KV heads (fewer than devices): each holder of such rows sees only its query heads' share
            # of their gradient; tie sums it over the holders, as ColwiseParallel does for the base weight.
            tied = kv_local_ranges(part.size, ctx.world_size, self.blocks or (), ctx.heads, ctx.rank, ctx.plain_sizes)
            groups = ctx.heads.kv_sharers()

            def forward(a: torch.Tensor) -> torch.Tensor:
                if not torch.is_grad_enabled():
                    return F.linear(a, module.weight, module.bias)
                bias = None if module.bias is None else tie_ranges(module.bias, 0, tied, comm, groups, name)
                return F.linear(a, tie_ranges(module.weight, 0, tied, comm, groups, name), bias)

            wrap_forward(module, forward)
            return
        if self.split == "input":
            part = splits["weight"][1]
            module.in_features = local = part.local_size(ctx.rank)

            def forward(x: torch.Tensor) -> torch.Tensor:
                if x.shape[-1] != local:
                    x = comm.split(x, x.dim() - 1, part, where=name)  # a whole input: keep this device's slice
                return F.linear(x, module.weight, module.bias)

            wrap_forward(module, forward)
            return
        # every factor, trainable now or not: set_adapter() may switch an adapter on later (the engines route only
        # the parameters that require gradients at each call)
        comm.partial_grads(module, [n for n, _ in module.named_parameters(recurse=False)], where=name)
        if self.split == "whole_input":
            inner = module.forward

            def forward(x: torch.Tensor) -> torch.Tensor:
                # the base layer's copy_to_parallel node (the same x): one all-reduce of dL/dx for both
                return inner(comm.copy_to_parallel(x, where=name))

            wrap_forward(module, forward)


@register("lora_magnitude")
@dataclass(frozen=True, kw_only=True)
class LoraMagnitude(Style):
    """The DoRA magnitude vector (``lora_magnitude_vector.<adapter>``, one entry per output feature) of a LoRA
    layer on a split base (see the module docstring).

    Args:
        split: ``"output"``: split like the base layer's output (column-parallel base; the row norms are
            local); ``"whole"``: whole on every device (row-parallel base: the squared row norms are summed
            over the devices, and m's gradients are partial sums).
        blocks: the base layer's ``blocks`` (heads, fused q|k|v), for ``"output"``.
    """

    split: Literal["output", "whole"]
    blocks: tuple[int | str, ...] | None = None

    def __post_init__(self) -> None:
        check_choices(self, "split")

    def beside(self, module: nn.Module, part) -> Splits:
        """As `shard`, for a magnitude created beside a base layer already split by `part` (see LoraParallel)."""
        return {"weight": (0, part)} if self.split == "output" else {}

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise NotImplementedError(f"LoraMagnitude cannot split {ctx.name} ({type(module).__name__}): expected "
                                      "PEFT's DoRA magnitude, a module holding one vector `weight`")
        if self.split == "output":
            return {"weight": (0, block_partition(weight.shape[0], ctx.world_size, self.blocks, ctx.heads, where=ctx.name, plain_sizes=ctx.plain_sizes))}
        return {}

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        comm, name = ctx.comm, ctx.name
        if self.split == "output":
            part = splits["weight"][1]
            if part.overlapping:  # replicated KV heads: m's rows for them sum their gradient over the holders
                tied = kv_local_ranges(part.size, ctx.world_size, self.blocks or (), ctx.heads, ctx.rank, ctx.plain_sizes)
                groups = ctx.heads.kv_sharers()
                views = lambda: {"weight": tie_ranges(module.weight, 0, tied, comm, groups, name)}  # noqa: E731
                wrap_forward(module, with_views(module, original_forward(module), views))
            return
        comm.partial_grads(module, ["weight"], where=name)

        def forward(x_r, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name=None):
            """This device's share of DoRA's output beyond the base layer's, from its input slice x_r."""
            eye = torch.eye(x_r.shape[-1], device=x_r.device, dtype=x_r.dtype)
            weight = base_layer.weight.to(x_r.dtype)
            weight = weight.T if module.fan_in_fan_out else weight  # (out, in_r)
            with torch.no_grad():  # the norm is a constant for autograd, as in PEFT
                adapted = weight + scaling * lora_B(lora_A(eye)).T.to(x_r.dtype)
                norm = comm.all_reduce(adapted.pow(2).sum(dim=1), where=f"{name} (DoRA row norms)").sqrt()
            scale = (module.weight / norm).view(1, -1)
            return (scale - 1) * F.linear(x_r, weight) + scale * lora_B(lora_A(x_r)) * scaling

        wrap_forward(module, forward)


def with_views(module: nn.Module, run, views):
    """`run` (a forward) with some of `module`'s parameters replaced, for the call, by the tensors `views()`
    returns (when autograd records): e.g. tied views of rows several devices hold."""

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        swapped = views()
        saved = {n: module._parameters[n] for n in swapped}
        module._parameters.update(swapped)
        try:
            return run(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    return forward
