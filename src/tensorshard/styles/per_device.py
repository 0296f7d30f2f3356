"""Styles that set a module's attributes to one value per device, e.g. the tensor_parallel package's
attribute rules (``{"num_heads": "scale_int"}``), which tensorshard.compat evaluates for each rank.

    "layers.*.attn": PerDeviceValues(values={"n_heads": (5, 4)})        # 9 heads over 2 devices
    "layers.*.attn": HeadsWithValues(num_heads=9, values={"n_heads": (5, 4)})   # + head geometry

`HeadsWithValues` is a `Heads` entry (the projections inside split on its head boundaries) that also sets
the listed attributes; `PerDeviceValues` only sets them. A plan holding these is made for one device
count: applied to another, they refuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .style import ShardContext, Splits, Style, register
from .heads import Heads


def _normalise(style: Style) -> None:
    """``{"n_heads": [5, 4]}`` (as read from JSON) -> ``{"n_heads": (5, 4)}``, so plans compare equal."""
    if not isinstance(style.values, dict) or not all(isinstance(v, (list, tuple)) for v in style.values.values()):
        raise TypeError(f"{type(style).__name__}(values=...) maps attribute names to one value per device; got {style.values!r}")
    object.__setattr__(style, "values", {k: tuple(v) for k, v in style.values.items()})


def _check(values: dict[str, Any], ctx: ShardContext, module: nn.Module) -> None:
    for attr, per_rank in values.items():
        if len(per_rank) != ctx.world_size:
            raise ValueError(
                f"{ctx.name}: {attr} has values for {len(per_rank)} devices {tuple(per_rank)}, but the model is split "
                f"over {ctx.world_size}; translate the tensor_parallel config again for {ctx.world_size} devices"
            )
        if not hasattr(module, attr):
            raise ValueError(f"{ctx.name}: the config sets attribute {attr!r}, which {type(module).__name__} does not have")


def _set(values: dict[str, Any], module: nn.Module, rank: int) -> None:
    for attr, per_rank in values.items():
        setattr(module, attr, per_rank[rank])


@register("per_device_values")
@dataclass(frozen=True, kw_only=True)
class PerDeviceValues(Style):
    """Keep the module whole; set each listed attribute to its value for this device.

    Args:
        values: attribute name -> one value per device, in device order.
    """

    values: dict[str, tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _normalise(self)

    @classmethod
    def _from_json(cls, name, value):
        return value

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        _check(self.values, ctx, module)
        return {}

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        _set(self.values, module, ctx.rank)


@register("heads_with_values")
@dataclass(frozen=True, kw_only=True)
class HeadsWithValues(Heads):
    """`Heads` (geometry for the projections inside, head-count attrs) plus per-device attribute values."""

    values: dict[str, tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        _normalise(self)

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        _check(self.values, ctx, module)
        return super().shard(module, ctx)

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        super().attach(module, splits, ctx)
        _set(self.values, module, ctx.rank)
