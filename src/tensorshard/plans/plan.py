"""Plan: an ordered mapping from module-name patterns to parallel styles.

    plan = Plan({
        "layers.*.attn": Heads(num_heads=8, num_kv_heads=2, attrs={"n_heads": "heads", "n_kv_heads": "kv_heads"}),
        "layers.*.attn.wq": ColwiseParallel(blocks=("q",)),
        "layers.*.attn.w[kv]": ColwiseParallel(blocks=("kv",)),
        "layers.*.attn.wo": RowwiseParallel(blocks=("q",)),
        "layers.*.ffn.w[13]": ColwiseParallel(),
        "layers.*.ffn.w2": RowwiseParallel(),
    })

Patterns are globs over dotted module names, matched segment by segment: ``*``, ``?`` and ``[..]`` stay
inside one segment, ``**`` spans any number of segments. Each module takes the first entry that matches
it; modules inside a ``Replicate()`` module are left whole. A plan prints as a table and round-trips
through JSON (``plan.save(path)``, ``Plan.load(path)``).
"""

from __future__ import annotations

import difflib
import json
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from torch import nn

from ..styles.style import Style
from ..styles.heads import Heads
from ..styles.replicate import Replicate

FORMAT = "tensorshard.plan/1"


class Plan(Mapping[str, Style]):
    """An ordered ``{pattern: style}`` mapping. Immutable; combine plans with ``|``."""

    def __init__(self, entries: Mapping[str, Style] | Iterable[tuple[str, Style]] = ()) -> None:
        items = list(entries.items()) if isinstance(entries, Mapping) else list(entries)
        # Why plan inference left layers whole (layer name -> reason), for the split's report; not part of
        # the plan's data (equality, JSON).
        self.whole: dict[str, str] = {}
        self._entries: dict[str, Style] = {}
        for pattern, style in items:
            if not isinstance(pattern, str):
                raise TypeError(f"plan patterns are strings (module-name globs); got {pattern!r}")
            if not isinstance(style, Style):
                raise TypeError(
                    f"plan entry {pattern!r} maps to {style!r}; use a tensorshard style such as "
                    "ColwiseParallel(), RowwiseParallel(), EmbeddingParallel(), Replicate()"
                )
            self._entries[pattern] = style

    # -- mapping -------------------------------------------------------------------------------------------

    def __getitem__(self, pattern: str) -> Style:
        return self._entries[pattern]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __or__(self, other: Mapping[str, Style]) -> "Plan":
        """Entries of `other` first (they win), then ours."""
        return Plan(list(other.items()) + [(k, v) for k, v in self._entries.items() if k not in other])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and list(self._entries.items()) == list(other._entries.items())

    def __repr__(self) -> str:
        return f"Plan({len(self)} entries)\n{self.table()}"

    def __str__(self) -> str:
        return self.table()

    # -- matching ------------------------------------------------------------------------------------------

    def match(self, name: str) -> tuple[str, Style] | None:
        """The first entry whose pattern matches the module name `name`."""
        for pattern, style in self._entries.items():
            if match_pattern(pattern, name):
                return pattern, style
        return None

    def assign(self, module: nn.Module) -> dict[str, "Assignment"]:
        """Which style each module of `module` gets, checking that every pattern matches something.

        Raises ValueError for a pattern that matches no module, listing the closest module names.
        """
        names = [name for name, _ in module.named_modules()]
        out: dict[str, Assignment] = {}
        used: set[str] = set()
        whole: list[str] = []  # modules under a Replicate()
        heads: dict[str, Heads] = {}
        for name in names:
            if any(_inside(name, w) for w in whole):
                continue
            hit = self.match(name)
            if hit is None:
                continue
            pattern, style = hit
            used.add(pattern)
            if isinstance(style, Replicate):
                whole.append(name)
            if isinstance(style, Heads):
                heads[name] = style
            out[name] = Assignment(name, pattern, style)
        for name, assignment in out.items():
            owner = max((h for h in heads if _inside(name, h) and h != name), key=len, default=None)
            if isinstance(assignment.style, Heads):
                owner = name
            assignment.heads_owner = owner
        # A pattern shadowed by an earlier one (or inside a Replicate) is fine; one matching no name is not.
        unused = [p for p in self._entries if p not in used and not any(match_pattern(p, n) for n in names)]
        if unused:
            lines = []
            for pattern in unused:
                close = difflib.get_close_matches(pattern, _candidates(pattern, names), n=4, cutoff=0.5)
                hint = f" Closest module names: {', '.join(close)}." if close else ""
                lines.append(f"  {pattern!r} matches no module of {type(module).__name__}.{hint}")
            raise ValueError(
                "plan entries that match nothing (a typo, or a plan for another model?):\n" + "\n".join(lines)
                + "\nFix the patterns; list the module names with [n for n, _ in model.named_modules()]."
            )
        return out

    # -- presentation & storage ----------------------------------------------------------------------------

    def table(self) -> str:
        rows = [("pattern", "style")] + [(p, s.describe()) for p, s in self._entries.items()]
        width = max(len(r[0]) for r in rows)
        lines = [f"{a.ljust(width)}  {b}" for a, b in rows]
        lines.insert(1, "-" * width + "  " + "-" * max(len(r[1]) for r in rows))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "entries": [{"pattern": p, **s.to_dict()} for p, s in self._entries.items()]}

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
            raise ValueError(f"not a tensorshard plan: expected {{'format': {FORMAT!r}, 'entries': [...]}}")
        entries = []
        for i, entry in enumerate(data["entries"]):
            entry = dict(entry)
            if "pattern" not in entry:
                raise ValueError(f"plan entry {i} has no 'pattern': {entry!r}")
            entries.append((entry.pop("pattern"), Style.from_dict(entry)))
        return cls(entries)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON (atomically: a temporary file renamed into place)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(self.to_json() + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        try:
            return cls.from_json(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}); write plans with Plan.save() or `tensorshard plan --json`") from e


@dataclass
class Assignment:
    """The style a plan gives one module, and which module's Heads entry its head blocks refer to."""

    name: str
    pattern: str
    style: Style
    heads_owner: str | None = None


def _candidates(pattern: str, names: list[str]) -> list[str]:
    """Module names to suggest for `pattern`; for a glob, with numbered segments as ``*`` (layers.*.mlp)."""
    names = [n for n in names if n]
    if not any(c in pattern for c in "*?["):
        return names
    return list(dict.fromkeys(".".join("*" if p.isdigit() else p for p in n.split(".")) for n in names))


def _inside(name: str, parent: str) -> bool:
    return parent == "" or name == parent or name.startswith(parent + ".")


def escape(name: str) -> str:
    """A module name as a glob that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def match_pattern(pattern: str, name: str) -> bool:
    """Glob match of a dotted module name, segment by segment (``**`` = any number of segments)."""
    return _match(pattern.split(".") if pattern else [], name.split(".") if name else [])


def _match(pats: list[str], parts: list[str]) -> bool:
    if not pats:
        return not parts
    if pats[0] == "**":
        return any(_match(pats[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], pats[0]) and _match(pats[1:], parts[1:])


class BoundPlan(Plan):
    """The plan of a split model, still knowing the model: ``model.tensor_parallel_config`` returns one, so
    `convert_state_dict` can compute every tensor's slices from it. Equal to the plain plan."""

    def __init__(self, plan: Plan, model: nn.Module) -> None:
        super().__init__(list(plan.items()))
        self._model = weakref.ref(model)

    @property
    def model(self) -> nn.Module | None:
        return self._model()
