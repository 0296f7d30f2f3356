"""The style of a PEFT adapter layer (LoRA, IA3) whose base layer is split: what the methods' styles share.

A PEFT adapter layer keeps the layer it adapts as ``.base_layer`` and adds the adapter in its own forward. Its
style knows how that base layer is split (``base``: column- or row-parallel), splits no tensor of its own (the
adapter's tensors have their own styles, created beside it: `beside`), and refuses a layer its method cannot
follow (`problem`) with the method's fix. Each method's style has its own `attach`: LoraParallel (lora.py),
Ia3Parallel (ia3.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from torch import nn

from .base import ShardContext, Splits, Style


@dataclass(frozen=True, kw_only=True)
class AdapterLayerStyle(Style):
    """Base of the styles on a PEFT adapter layer whose base layer is split.

    Args:
        base: how ``.base_layer`` is split: ``"column"`` (ColwiseParallel, output not gathered) or ``"row"``.
    """

    base: Literal["column", "row"] = "column"
    fix: ClassVar[str] = ""  # what to do instead when `problem` refuses a layer

    def __post_init__(self) -> None:
        if self.base not in ("column", "row"):
            raise ValueError(f"{type(self).__name__}(base={self.base!r}): use 'column' or 'row'")

    def problem(self, module: nn.Module) -> str | None:
        """Why this adapter layer cannot follow a split base layer, or None when it can."""
        raise NotImplementedError

    def beside(self, module: nn.Module, part) -> Splits:
        """The splits of this style's module when it is created beside a base layer already split by `part`
        (an adapter added after splitting; plans/late_adapters.py, for both engines): what `shard` would say."""
        return {}

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        problem = self.problem(module)
        if problem:
            raise NotImplementedError(
                f"{ctx.name}: {problem} cannot be split with its {self.base}-parallel base layer. {self.fix}"
            )
        return {}
