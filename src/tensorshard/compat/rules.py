"""What a tensor_parallel config says, read as data: its four rule tables, how a name finds its rules, and
what each state action means (`Rule`).

The tables are kept as the original keeps them: ``{compiled pattern: action(s)}``, so code that looks a
rule up or adds one by ``re.compile(...)`` works as before. Patterns are found anywhere in a name
(``re.search``): a tensor takes the first state rule whose pattern it contains; a module collects the
input, output and attribute rules of every pattern it contains (two different actions for the same
argument are a conflict). `Config` (config.py) is these tables plus their translation to a plan; the
translator (translate.py, check.py) and `convert_state_dict` read them through this module only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from .state_actions import Scale, Split, SplitInChunks, SplitInGroupedChunks, StateAction

TABLES = ("state_rules", "input_rules", "output_rules", "attr_rules")


class RuleTables:
    """The tensor_parallel package's ``Config(state_rules, input_rules, output_rules, attr_rules)`` tables."""

    def __init__(
        self,
        state_rules: Mapping[Any, Any],
        input_rules: Mapping[Any, Mapping[Any, Any]] | None = None,
        output_rules: Mapping[Any, Mapping[Any, Any]] | None = None,
        attr_rules: Mapping[Any, Mapping[str, Any]] | None = None,
    ) -> None:
        given = {"state_rules": state_rules, "input_rules": input_rules or {}, "output_rules": output_rules or {},
                 "attr_rules": attr_rules or {}}
        for table, rules in given.items():
            if not isinstance(rules, Mapping):
                raise TypeError(f"Config({table}=...) must be a dict of {{regex: ...}}; got {type(rules).__name__}")
            for pattern, actions in rules.items():
                compile_pattern(pattern, table)
                if table != "state_rules" and not isinstance(actions, Mapping):
                    raise TypeError(
                        f"Config {table}[{pattern_text(pattern)!r}] must map arguments to actions, e.g. {{0: 'sum'}}; "
                        f"got {actions!r}"
                    )
        self.state_rules = {compile_pattern(p, "state_rules"): a for p, a in state_rules.items()}
        self.input_rules = {compile_pattern(p, "input_rules"): _int_keys(a) for p, a in given["input_rules"].items()}
        self.output_rules = {compile_pattern(p, "output_rules"): _int_keys(a) for p, a in given["output_rules"].items()}
        self.attr_rules = {compile_pattern(p, "attr_rules"): dict(a) for p, a in given["attr_rules"].items()}

    def state_rule(self, name: str) -> tuple[Any, Any] | None:
        """The first state rule whose pattern occurs in the tensor name `name`: (pattern, action)."""
        for pattern, action in self.state_rules.items():
            if compile_pattern(pattern, "state_rules").search(name):
                return pattern, action
        return None

    def module_rules(self, table: str, name: str) -> tuple[dict[Any, Any], list[str]]:
        """The merged ``{argument: action}`` of every rule of `table` matching module `name`, and the
        conflicts (one argument given two different actions by two patterns)."""
        merged: dict[Any, Any] = {}
        source: dict[Any, str] = {}
        conflicts = []
        for pattern, actions in getattr(self, table).items():
            if not compile_pattern(pattern, table).search(name):
                continue
            for key, action in _int_keys(actions).items():
                if key in merged and merged[key] != action:
                    conflicts.append(
                        f"{table}: module {name!r} argument {key!r} gets {merged[key]!r} from {source[key]!r} and "
                        f"{action!r} from {pattern_text(pattern)!r}"
                    )
                    continue
                merged[key], source[key] = action, pattern_text(pattern)
        return merged, conflicts


def compile_pattern(pattern: Any, table: str) -> re.Pattern:
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise TypeError(f"Config {table} keys are regular expressions (strings); got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"Config {table}: {pattern!r} is not a valid regular expression ({e})") from None


def pattern_text(pattern: Any) -> str:
    """A rule's pattern as the user wrote it, for messages."""
    return pattern.pattern if isinstance(pattern, re.Pattern) else str(pattern)


def _int_keys(actions: Mapping[Any, Any]) -> dict[Any, Any]:
    """``{"0": "sum"}`` -> ``{0: "sum"}``, as the original canonicalises argument positions."""
    return {int(k) if isinstance(k, str) and k.strip().isdigit() else k: v for k, v in actions.items()}


# --- what a state action means --------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A state rule, normalised: ``split`` along `dim` in units of `chunk` features, in `groups` equal
    blocks; or ``scale``. `text` is how the user wrote it, for messages."""

    kind: str  # "split" | "scale"
    text: str
    dim: int = 0
    chunk: int = 1
    groups: int = 1

    def action(self, world_size: int) -> StateAction:
        if self.kind == "scale":
            return Scale(world_size)
        return SplitInGroupedChunks(world_size, self.dim, self.groups, self.chunk)


_KNOWN = {"Split": Split, "SplitInChunks": SplitInChunks, "SplitInGroupedChunks": SplitInGroupedChunks, "Scale": Scale}


def read_action(action: Any, world_size: int) -> Rule | str:
    """The `Rule` an action stands for, or a sentence saying why it has no tensorshard equivalent.

    The original package's own objects (``tensor_parallel.state_actions.Split`` ...) are read by class
    name and attributes, like ours; subclasses are not, since they may split differently. The 1.x strings
    ``"split <dim>"`` and ``"scale"`` mean the same as Split and Scale.
    """
    if isinstance(action, str):
        kind, *opts = action.split()
        if kind == "split" and len(opts) == 1 and opts[0].lstrip("-").isdigit():
            return Rule("split", repr(action), dim=int(opts[0]))
        if kind == "scale" and not opts:
            return Rule("scale", repr(action))
        return f"{action!r} is not a state rule (use 'split <dim>', 'scale', Split, SplitInChunks, SplitInGroupedChunks or Scale)"
    name = type(action).__name__
    if name not in _KNOWN or (isinstance(action, StateAction) and type(action) is not _KNOWN[name]):
        what = "a Python callable" if callable(action) else f"a {name}"
        return (
            f"{action!r} is {what}; tensorshard.compat translates only Split, SplitInChunks, SplitInGroupedChunks, "
            "Scale and the strings 'split <dim>' / 'scale'. Write this part as a tensorshard Plan "
            "(docs/plans.md: ColwiseParallel(blocks=...), ShardParams)"
        )
    given = getattr(action, "world_size", None)
    if given != world_size:
        return f"{action!r} was made for world_size={given}, but the model is being split over {world_size} devices"
    if name == "Scale":
        return Rule("scale", repr(action))
    chunk, groups = getattr(action, "chunk_size", 1), getattr(action, "num_groups", 1)
    if not all(isinstance(v, int) and v >= 1 for v in (chunk, groups)):
        return f"{action!r}: chunk_size and num_groups must be positive ints"
    return Rule("split", repr(action), dim=action.dim, chunk=chunk, groups=groups)
