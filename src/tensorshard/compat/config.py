"""`Config`: the `tensor_parallel` package's four rule tables, and their translation to a tensorshard plan.

    config = Config(
        state_rules={r".*mlp\\.fc1\\.(weight|bias)$": Split(world_size=2, dim=0),   # parameter name -> action
                     r".*mlp\\.fc2\\.weight$": Split(world_size=2, dim=1),
                     r".*mlp\\.fc2\\.bias$": "scale"},
        input_rules={},                                                            # module name -> {arg: action}
        output_rules={r".*mlp$": {0: "sum"}},
        attr_rules={r".*attn$": {"num_heads": "scale_int"}},                       # module name -> {attr: action}
    )
    plan = config.to_plan(model, world_size=2)     # a tensorshard Plan; print(plan) shows the table

How names find their rules is in rules.py (patterns are regular expressions found anywhere in a name, kept
compiled as the original keeps them); what each rule combination becomes is in translate.py.
"""

from __future__ import annotations

from torch import nn

from .rules import TABLES, RuleTables
from .config_to_plan import translate


class Config(RuleTables):
    """The tensor_parallel package's ``Config(state_rules, input_rules, output_rules, attr_rules)``."""

    def __repr__(self) -> str:
        counts = ", ".join(f"{len(getattr(self, t))} {t}" for t in TABLES)
        return f"Config({counts})"

    def to_plan(self, model: nn.Module, world_size: int):
        """The tensorshard `Plan` that does what this config does to `model` over `world_size` devices.

        Only reads the model (it may be on the meta device). Raises `UntranslatableConfig`, naming every
        rule that has no equivalent, before anything changes.
        """
        return translate(self, model, world_size)
