"""`LocalValues`: an object as one module of one device sees it: its own values for a few attributes, the
shared object's for every other.

A `Heads` entry with ``attrs={"config.num_attention_heads": "heads"}`` (Phi-3 slices its fused q|k|v with
``self.config.num_attention_heads``) must give that attention module its device's head count, while the
configuration stays the one object every module, device and the user read and write:

    attn.config = LocalValues(config, {"num_attention_heads": 5})
    attn.config.num_attention_heads        # 5: this device's heads
    attn.config._attn_implementation       # the shared config's, as it is now (set_attn_implementation)
    attn.config.output_hidden_states = True   # written to the shared config
    isinstance(attn.config, Phi3Config)    # True

Writing one of the local attributes through the view is refused: it holds the split's value for this
device. Deep copies (a module copied with its configuration) copy the shared object and keep the local
values.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn


class LocalValues:
    """`shared`, with `local` attribute values of this module's own (see the module docstring)."""

    __slots__ = ("_shared", "_local", "__weakref__")

    def __init__(self, shared: Any, local: dict[str, Any] | None = None) -> None:
        object.__setattr__(self, "_shared", shared)
        object.__setattr__(self, "_local", dict(local or {}))

    @property
    def __class__(self):  # isinstance() checks see the shared object's class
        return type(object.__getattribute__(self, "_shared"))

    def __getattr__(self, name: str) -> Any:  # only for names the view itself lacks: every field
        local = object.__getattribute__(self, "_local")
        key = _canonical(object.__getattribute__(self, "_shared"), name)
        if key in local:
            return local[key]
        return getattr(object.__getattribute__(self, "_shared"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        shared = object.__getattribute__(self, "_shared")
        key = _canonical(shared, name)
        if key in object.__getattribute__(self, "_local"):
            raise AttributeError(
                f"{type(shared).__name__}.{name} of this module holds its device's own value "
                f"({object.__getattribute__(self, '_local')[key]}) in a split model: the split depends on it. "
                "Change it on the unsplit model before splitting."
            )
        setattr(shared, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(object.__getattribute__(self, "_shared"), name)

    # Only dunder methods here: any other name on this class would hide the shared object's field of that
    # name. What Python looks up on the type itself, not through __getattr__:
    def __repr__(self) -> str:
        return f"{shared_of(self)!r} (this module's own: {local_values(self)})"

    def __iter__(self):
        return iter(shared_of(self))

    @property
    def __dict__(self) -> dict[str, Any]:
        # torch.compile reads a plain object's fields from its __dict__ (dynamo's generic getattr), which without
        # this would be the shared object's: a split Phi-3 compiled with every device's head count the unsplit
        # model's. A snapshot: its fields as this module reads them (writing to it reaches nothing; write the field)
        return {**vars(shared_of(self)), **local_values(self)}

    def __eq__(self, other: Any) -> bool:
        return shared_of(self) == (shared_of(other) if type(other) is LocalValues else other)

    def __hash__(self) -> int:
        return hash(shared_of(self))  # raises as the shared object does (transformers configs are unhashable)

    def __copy__(self) -> "LocalValues":
        return LocalValues(shared_of(self), local_values(self))

    def __deepcopy__(self, memo: dict) -> "LocalValues":
        return LocalValues(copy.deepcopy(shared_of(self), memo), copy.deepcopy(local_values(self), memo))

    def __reduce__(self):
        return (LocalValues, (shared_of(self), local_values(self)))


def shared_of(view: LocalValues) -> Any:
    """The shared object behind `view`."""
    return object.__getattribute__(view, "_shared")


def local_values(view: LocalValues) -> dict[str, Any]:
    """The attributes `view` holds for its module alone (a copy)."""
    return dict(object.__getattribute__(view, "_local"))


def is_local_values(value: Any) -> bool:
    return type(value) is LocalValues  # (isinstance sees the shared object's class)


def _canonical(obj: Any, name: str) -> str:
    """`name` as `obj` stores it: transformers configs map aliases (GPT-2's num_attention_heads -> n_head)."""
    aliases = getattr(type(obj), "attribute_map", None)
    return aliases.get(name, name) if isinstance(aliases, dict) else name


def set_local_path(owner: Any, path: str, value: Any) -> None:
    """``owner.<path> = value`` where `path` may pass through shared plain objects (``config.num_heads``,
    ``config.text_config.num_heads``): each such object becomes a `LocalValues` view for this module alone,
    which holds the value; submodules on the way are walked as they are."""
    *parents, attr = path.split(".")
    for part in parents:
        child = getattr(owner, part)
        if not isinstance(child, nn.Module):
            if not is_local_values(child):
                child = LocalValues(child)
            _set(owner, part, child)
        owner = child
    _set(owner, attr, value)


def _set(owner: Any, name: str, value: Any) -> None:
    if is_local_values(owner):
        object.__getattribute__(owner, "_local")[_canonical(shared_of(owner), name)] = value
    else:
        setattr(owner, name, value)
