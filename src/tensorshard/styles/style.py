"""The contract of a parallel style, the context it runs in, and the registry that makes plans JSON.

A style is a small frozen dataclass with keyword-only options. It does two things, both engine-agnostic:

1. `shard(module, ctx)`: say how the module's own parameters and buffers are split, as
   `{name: (dim, Partition)}`; whatever it does not list is replicated. Computed once on the full module.
2. `attach(module, splits, ctx)`: once the module holds its local slices, set its size attributes to the
   local values and wrap its forward with the collectives its layout needs at the boundary, taken from
   `ctx.comm` (threads in the in-process engine, `torch.distributed` under torchrun).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from ..comm.interface import Comm
from ..partition import HeadGroups, Partition

Splits = dict[str, tuple[int, Partition]]

STYLES: dict[str, type["Style"]] = {}


@dataclass
class ShardContext:
    """Where a style is being applied: which shard, of how many, which module, and its collectives."""

    rank: int
    world_size: int
    name: str  # the module's qualified name, for messages
    comm: Comm
    heads: HeadGroups | None = None  # from the nearest enclosing Heads(...) entry, if any
    # per-device unit counts of the module's plain blocks of sum(plain_sizes) features, in a balanced split
    # (plans/balance.py); None: even. Styles hand it to block_partition.
    plain_sizes: tuple[int, ...] | None = None


@functools.lru_cache(maxsize=None)
def _choices(cls: type, option: str) -> tuple:
    return typing.get_args(typing.get_type_hints(cls)[option])


def check_choices(style: "Style", *options: str) -> None:
    """Each of `options` holds one of the values its ``Literal[...]`` annotation allows; else a ValueError naming
    the style, the option, the value given and the choices."""
    for option in options:
        allowed, value = _choices(type(style), option), getattr(style, option)
        if value not in allowed:
            choices = ", ".join(repr(a) for a in allowed[:-1]) + f" or {allowed[-1]!r}"
            raise ValueError(f"{type(style).__name__}({option}={value!r}): use {choices}")


@dataclass(frozen=True, kw_only=True)
class Style:
    """Base class of all parallel styles."""

    kind: ClassVar[str] = ""

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        """How the module's own parameters/buffers are split; unlisted ones are replicated."""
        return {}

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        """Adapt the module, which now holds its local slices, to run as shard `ctx.rank`."""

    # -- data ------------------------------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        """Options that differ from their defaults."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:  # a required option
                out[f.name] = value
                continue
            if value != default:
                out[f.name] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"style": self.kind, **{k: _jsonable(v) for k, v in self.options().items()}}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Style":
        if not isinstance(data, dict) or "style" not in data:
            raise ValueError(f"a style entry needs a 'style' key naming one of {sorted(STYLES)}; got {data!r}")
        data = dict(data)
        name = data.pop("style")
        if name not in STYLES:
            raise ValueError(f"unknown style {name!r}; known styles: {sorted(STYLES)}")
        cls = STYLES[name]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"style {name!r} has no option(s) {sorted(unknown)}; its options: {sorted(known)}")
        return cls(**{k: cls._from_json(k, v) for k, v in data.items()})

    @classmethod
    def _from_json(cls, name: str, value: Any) -> Any:
        """Turn a JSON value back into the option's Python form (lists -> tuples)."""
        return tuple(value) if isinstance(value, list) else value

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def register(kind: str) -> Callable[[type[Style]], type[Style]]:
    """Class decorator: make a style known to plans read from JSON under the name `kind`."""

    def deco(cls: type[Style]) -> type[Style]:
        cls.kind = kind
        STYLES[kind] = cls
        return cls

    return deco


NO_GRAD_FORWARD = "_tensorshard_no_grad_forward"  # an instance's shorter forward for dynamo, without gradients


def wrap_forward(module: nn.Module, forward: Callable[..., Any], no_grad: Callable[..., Any] | None = None, *,
                 no_grad_now: Callable[[], Callable[..., Any] | None] | None = None) -> None:
    """Replace `module.forward` for this instance only; the class and other instances are untouched. The
    replacement shows the signature of the forward it wraps: callers read the argument names (transformers'
    generate() builds position_ids from the attention mask, for left padding, only for a forward that takes them).

    `no_grad`: the same computation as `forward` where gradients are off, in fewer lines (its checks made once,
    here), which dynamo traces in its place inside engines/cheap_tracing.py; it must call `forward` itself where
    gradients are on. `no_grad_now` instead: asked at each entry of that context, which such forward fits the call
    (None: `forward` itself). Kept with the forward it stands for: used only while that is the module's forward."""
    choose = no_grad_now if no_grad_now is not None else (None if no_grad is None else (lambda: no_grad))
    if choose is None:
        module.__dict__.pop(NO_GRAD_FORWARD, None)
    else:
        module.__dict__[NO_GRAD_FORWARD] = (forward, choose)
    if "__signature__" not in getattr(forward, "__dict__", {"__signature__": None}):
        try:
            forward.__signature__ = inspect.signature(module.forward)
        except (TypeError, ValueError):  # a builtin or C forward: nothing to show
            pass
    module.forward = forward  # nn.Module.__call__ looks the instance attribute up first


def no_grad_chooser(module: nn.Module, forward: Any) -> Callable[[], Callable[..., Any] | None] | None:
    """What `wrap_forward` kept to choose `module`'s no-gradient forward, where `forward` is still the forward it
    stands for; else None."""
    kept = module.__dict__.get(NO_GRAD_FORWARD)
    return kept[1] if isinstance(kept, tuple) and kept[0] is forward else None


def original_forward(module: nn.Module) -> Callable[..., Any]:
    """The module's own (class) forward, bound to it, even when an instance override is installed."""
    return type(module).forward.__get__(module, type(module))


def feature_dim(dim: int, x: torch.Tensor) -> int:
    return dim if dim >= 0 else x.dim() + dim
