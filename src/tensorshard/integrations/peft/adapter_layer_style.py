"""The style of a PEFT adapter layer (LoRA, IA3) whose base layer is split: what the methods' styles share.

A PEFT adapter layer keeps the layer it adapts as ``.base_layer`` and adds the adapter in its own forward. Its
style knows how that base layer is split (``base``: column- or row-parallel), splits no tensor of its own (the
adapter's tensors have their own styles, created beside it: `beside`), and refuses a layer its method cannot
follow (`problem`: its method's `layer_problem`) with the method's fix. Each method's style has its own
`attach`: LoraParallel (lora_styles.py), Ia3Parallel (ia3_styles.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Literal

from torch import nn

from ...styles.style import ShardContext, Splits, Style, check_choices


@dataclass(frozen=True, kw_only=True)
class AdapterLayerStyle(Style):
    """Base of the styles on a PEFT adapter layer whose base layer is split.

    Args:
        base: how ``.base_layer`` is split: ``"column"`` (ColwiseParallel, output not gathered) or ``"row"``.
    """

    base: Literal["column", "row"] = "column"
    # the method's check of a layer (lora_layer_problem, ia3_layer_problem): why it cannot follow, or None
    layer_problem: ClassVar[Callable[[nn.Module], str | None]]
    fix: ClassVar[str] = ""  # what to do instead when `problem` refuses a layer

    def __post_init__(self) -> None:
        check_choices(self, "base")

    def problem(self, module: nn.Module) -> str | None:
        """Why this adapter layer cannot follow a split base layer, or None when it can."""
        return type(self).layer_problem(module)

    def beside(self, module: nn.Module, part) -> Splits:
        """The splits of this style's module when it is created beside a base layer already split by `part`
        (an adapter added after splitting; integrations/peft/late_adapters.py, for both engines): what `shard`
        would say."""
        return {}

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        problem = self.problem(module)
        if problem:
            raise NotImplementedError(
                f"{ctx.name}: {problem} cannot be split with its {self.base}-parallel base layer. {self.fix}"
            )
        return {}
