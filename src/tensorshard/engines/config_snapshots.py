"""While dynamo traces a split model's decode step: each module's transformers config read as a plain object.

    from tensorshard.engines.config_snapshots import plain_configs
    with plain_configs(shards):
        out = compiled_capture(**kwargs)    # `self.config.x` is one attribute read for dynamo, not a traced function

transformers' `PretrainedConfig.__getattribute__` is Python (it resolves the class's `attribute_map` aliases on every
read), so dynamo traces it at every `config.x` a forward reads: for SmolLM2's shape ~720 reads, 9,400 bytecodes per
shard, a fifth of what the unsplit model traces in all. Inside `plain_configs(modules)` each module holding a config
(`module.config`) holds a snapshot of it instead: an instance of a subclass of the config's class (made once per
class, same name) whose `__getattribute__` is object's, which dynamo reads directly, and whose aliases are
properties reading the attribute they name (what the alias resolution did). The snapshot holds the config's
attributes as they are at entry (read afresh at every entry: a config changed between two calls is seen), a nested
config (`text_config`) by its own snapshot; one snapshot per config, kept, so the frames traced inside see the same
objects at every call. A write to a snapshot goes to the config too. Every module gets its own config back on exit,
also after an error.

Used only through `engines/cheap_tracing.py`, where the traced frames' guards are never evaluated outside it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

from torch import nn

try:  # (transformers is optional: without it no module holds such a config)
    from transformers import PretrainedConfig
except ImportError:  # pragma: no cover - transformers is installed with the project's extras
    PretrainedConfig = None

_classes: dict[type, type | None] = {}  # config class -> its snapshot class (None: Python would not make one)
_snapshots: dict[int, tuple[weakref.ref, Any]] = {}  # id(config) -> (the config, its snapshot), kept per config
_originals: dict[int, Any] = {}  # id(snapshot) -> its config (where a write to the snapshot goes too)


class PlainConfig:
    """Mixed into a config's class for its snapshot: attributes read as object's, written through to the config."""

    __getattribute__ = object.__getattribute__

    def __setattr__(self, key: str, value: Any) -> None:
        original = _originals.get(id(self))  # (none for a copy of a snapshot: transformers' get_text_config makes one)
        if original is not None:
            setattr(original, key, value)  # (the config resolves its own aliases)
        object.__setattr__(self, type(self).attribute_map.get(key, key), value)


def _alias(target: str) -> property:
    return property(lambda self: getattr(self, target), lambda self, value: setattr(self, target, value))


def snapshot_class(cls: type) -> type | None:
    """`cls` read as a plain object (made once per class, named as `cls`), or None where Python refuses it."""
    if cls not in _classes:
        namespace: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        for alias, target in dict(getattr(cls, "attribute_map", None) or {}).items():
            namespace[alias] = _alias(target)
        try:
            made = type(cls)(cls.__name__, (PlainConfig, cls), namespace)
        except TypeError:
            made = None
        _classes.setdefault(cls, made)
    return _classes[cls]


def snapshot(config: Any) -> Any:
    """The kept snapshot of `config`, its attributes refreshed from it now (None where its class has none)."""
    sub = snapshot_class(type(config))
    if sub is None:
        return None
    kept = _snapshots.get(id(config))
    if kept is None or kept[0]() is not config:
        made = object.__new__(sub)
        _originals[id(made)] = config
        key = id(config)
        kept = _snapshots[key] = (weakref.ref(config, lambda _, key=key, made_id=id(made): _forget(key, made_id)), made)
    plain = kept[1]
    fresh = {key: (snapshot(value) or value) if _is_config(value) else value
             for key, value in object.__getattribute__(config, "__dict__").items()}
    state = object.__getattribute__(plain, "__dict__")
    state.update(fresh)  # (updated in place, never emptied: another split model of the same config may be reading it)
    for key in [k for k in state if k not in fresh]:
        del state[key]
    return plain


def _forget(key: int, made_id: int) -> None:
    _snapshots.pop(key, None)
    _originals.pop(made_id, None)


def _is_config(value: Any) -> bool:
    return PretrainedConfig is not None and isinstance(value, PretrainedConfig) and not isinstance(value, PlainConfig)


@contextmanager
def plain_configs(roots: Iterable[nn.Module]) -> Iterator[int]:
    """For the duration: every module under `roots` holding a transformers config holds its snapshot (see the module
    doc). Yields how many modules were changed."""
    changed: list[tuple[nn.Module, Any]] = []
    seen: set[int] = set()
    made: dict[int, Any] = {}
    try:
        for root in roots:
            for module in root.modules():
                config = module.__dict__.get("config")
                if id(module) in seen or not _is_config(config):
                    continue
                seen.add(id(module))
                if id(config) not in made:
                    made[id(config)] = snapshot(config)
                plain = made[id(config)]
                if plain is None:
                    continue
                module.__dict__["config"] = plain
                changed.append((module, config))
        yield len(changed)
    finally:
        for module, config in reversed(changed):
            module.__dict__["config"] = config
