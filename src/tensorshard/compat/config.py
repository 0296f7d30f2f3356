"""`Config`: the `tensor_parallel` package's four rule tables, kept as the user wrote them.

    config = Config(
        state_rules={r".*mlp\\.fc1\\.(weight|bias)$": Split(world_size=2, dim=0),   # parameter name -> action
                     r".*mlp\\.fc2\\.weight$": Split(world_size=2, dim=1),
                     r".*mlp\\.fc2\\.bias$": "scale"},
        input_rules={},                                                            # module name -> {arg: action}
        output_rules={r".*mlp$": {0: "sum"}},
        attr_rules={r".*attn$": {"num_heads": "scale_int"}},                       # module name -> {attr: action}
    )
    plan = config.to_plan(model, world_size=2)     # a tensorshard Plan; print(plan) shows the table

Patterns are regular expressions found anywhere in a name (``re.search``), as in the original: a
parameter takes the first state rule whose pattern it contains; a module collects the input, output and
attribute rules of every pattern it contains (two different actions for the same argument are an error).
The meaning of each rule, and which combinations tensorshard can run, is in translate.py.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from torch import nn

from .translate import translate


class Config:
    """The tensor_parallel package's ``Config(state_rules, input_rules, output_rules, attr_rules)``."""

    def __init__(
        self,
        state_rules: Mapping[str, Any],
        input_rules: Mapping[str, Mapping[Any, Any]] | None = None,
        output_rules: Mapping[str, Mapping[Any, Any]] | None = None,
        attr_rules: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        tables = {"state_rules": state_rules, "input_rules": input_rules or {}, "output_rules": output_rules or {},
                  "attr_rules": attr_rules or {}}
        for table, rules in tables.items():
            if not isinstance(rules, Mapping):
                raise TypeError(f"Config({table}=...) must be a dict of {{regex: ...}}; got {type(rules).__name__}")
            for pattern, actions in rules.items():
                _compile(pattern, table)
                if table != "state_rules" and not isinstance(actions, Mapping):
                    raise TypeError(
                        f"Config {table}[{pattern!r}] must map arguments to actions, e.g. {{0: 'sum'}}; got {actions!r}"
                    )
        self.state_rules = dict(state_rules)
        self.input_rules = {p: _int_keys(a) for p, a in tables["input_rules"].items()}
        self.output_rules = {p: _int_keys(a) for p, a in tables["output_rules"].items()}
        self.attr_rules = {p: dict(a) for p, a in tables["attr_rules"].items()}

    def __repr__(self) -> str:
        counts = ", ".join(f"{len(getattr(self, t))} {t}" for t in ("state_rules", "input_rules", "output_rules", "attr_rules"))
        return f"Config({counts})"

    def to_plan(self, model: nn.Module, world_size: int):
        """The tensorshard `Plan` that does what this config does to `model` over `world_size` devices.

        Only reads the model (it may be on the meta device). Raises `UntranslatableConfig`, naming every
        rule that has no equivalent, before anything changes.
        """
        return translate(self, model, world_size)

    # -- matching, as the original does it --------------------------------------------------------------

    def state_rule(self, name: str) -> tuple[str, Any] | None:
        """The first state rule whose pattern occurs in the tensor name `name`."""
        for pattern, action in self.state_rules.items():
            if _compile(pattern, "state_rules").search(name):
                return pattern, action
        return None

    def module_rules(self, table: str, name: str) -> tuple[dict[Any, Any], list[str]]:
        """The merged ``{argument: action}`` of every rule of `table` matching module `name`, and the
        conflicts (one argument given two different actions by two patterns)."""
        merged: dict[Any, Any] = {}
        source: dict[Any, str] = {}
        conflicts = []
        for pattern, actions in getattr(self, table).items():
            if not _compile(pattern, table).search(name):
                continue
            for key, action in actions.items():
                if key in merged and merged[key] != action:
                    conflicts.append(
                        f"{table}: module {name!r} argument {key!r} gets {merged[key]!r} from {source[key]!r} and "
                        f"{action!r} from {pattern!r}"
                    )
                    continue
                merged[key], source[key] = action, pattern
        return merged, conflicts


def _compile(pattern: Any, table: str) -> re.Pattern:
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise TypeError(f"Config {table} keys are regular expressions (strings); got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"Config {table}: {pattern!r} is not a valid regular expression ({e})") from None


def _int_keys(actions: Mapping[Any, Any]) -> dict[Any, Any]:
    """``{"0": "sum"}`` -> ``{0: "sum"}``, as the original canonicalises argument positions."""
    return {int(k) if isinstance(k, str) and k.strip().isdigit() else k: v for k, v in actions.items()}
