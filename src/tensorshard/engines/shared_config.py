"""One configuration for a split model: the configuration objects every shard shares, and the fields of
them a split model refuses to change.

A transformers model reads its configuration while it runs (``config.pad_token_id`` to pool a sequence
classifier's last token, ``config.output_hidden_states``, ``config._attn_implementation``...), and users
change it after building the model. So a split model keeps one configuration:

- in one process, the shards are deep copies of the model, but its configuration objects (``config``, the
  sub-configs of multimodal and encoder-decoder models, ``generation_config``) are not copied: every shard,
  the split model's ``config`` and any view of a submodule hold the very objects the unsplit model held
  (`keep_shared`, a memo for ``copy.deepcopy``). A change made through any of them is seen by every shard
  at its next call. Under torchrun each process holds its one model, in place.
- Where a plan needs a device's own value of a field (Phi-3 reads ``config.num_attention_heads`` to slice its
  q|k|v), the module reading it gets a view of the shared configuration holding that value
  (styles/local_values.py); every other field stays the shared one.
- Fields that size the split (`sizes_the_split`: hidden_size, num_attention_heads, vocab_size, head_dim,
  ..., and any field a plan holds per device) cannot change after splitting: the weights were cut from them.
  `guard` makes setting one to another value raise `FrozenBySplitError`, naming the fix (change it before
  splitting). The configuration objects stay instances of their own classes (a subclass of the same name,
  as ``torch.nn.utils.parametrize`` and FSDP2 do for modules); a copy of one (``copy.deepcopy(config)``,
  pickling) is a plain, changeable configuration of the original class.

Threads: the shards of one call read the shared objects at the same time. transformers' model code writes to
its configuration only what every shard writes alike (a classifier's ``config.problem_type``).
"""

from __future__ import annotations

import re
import sys
import weakref
from typing import Any, Iterable

from torch import nn

from ..styles.local_values import is_local_values, local_values, shared_of


class FrozenBySplitError(ValueError, AttributeError):
    """A field of a split model's configuration that sizes the split was given another value. (A ValueError
    for the value; an AttributeError as for any attribute that cannot be set.)"""


# --- what a configuration is ----------------------------------------------------------------------------


def is_configuration(obj: Any) -> bool:
    """A transformers model or generation configuration (recognised without importing transformers)."""
    transformers = sys.modules.get("transformers")
    if transformers is None or isinstance(obj, type) or is_local_values(obj):
        return False
    base = getattr(transformers, "PreTrainedConfig", None) or getattr(transformers, "PretrainedConfig", None)
    return (base is not None and isinstance(obj, base)) or isinstance(obj, _generation_config_class(transformers))


def _generation_config_class(transformers) -> type:
    generation = sys.modules.get("transformers.generation.configuration_utils")
    return getattr(generation, "GenerationConfig", ()) if generation is not None else ()


def configurations(trees: Iterable[nn.Module]) -> list[Any]:
    """Every configuration object the modules of `trees` hold (their own attributes, views of them, and the
    sub-configs inside), once each, parents first."""
    found: dict[int, Any] = {}

    def visit(obj: Any) -> None:
        if is_local_values(obj):
            visit(shared_of(obj))
            for value in local_values(obj).values():
                visit(value)
            return
        if not is_configuration(obj) or id(obj) in found:
            return
        found[id(obj)] = obj
        for value in vars(obj).values():  # sub-configs: text_config, vision_config, encoder, decoder, ...
            for item in value if isinstance(value, (list, tuple)) else (value,):
                visit(item)

    for tree in trees:
        for module in tree.modules():
            for value in vars(module).values():
                visit(value)
    return list(found.values())


def keep_shared(module: nn.Module) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo under which copies of `module` keep its configuration objects (not copies)."""
    return {id(c): c for c in configurations([module])}


# --- fields that size the split ---------------------------------------------------------------------------

# Field names, across transformers' configurations, of sizes and counts that shape weights or attention heads:
# hidden_size, intermediate_size, vocab_size, head_dim, kv_channels, num_attention_heads, num_key_value_heads,
# num_local_experts, num_hidden_layers, GPT-2's n_embd / n_head, T5's d_model / d_kv / d_ff, ...
_SIZES = re.compile(
    r"\w*_(size|sizes|dim|dims|channels|heads|experts)"
    r"|(num|n)_\w*(layers|groups)|(encoder|decoder)_layers"
    r"|n_(embd|inner|head|layer|positions|ctx)|d_(model|kv|ff|inner|head)|dim|rotary_dim|(kv|q)_lora_rank"
)
# ...except those read at run time, which change the computation, not the shapes.
_RUN_TIME = {
    "sliding_window_size", "attention_chunk_size", "chunk_size", "block_size", "max_batch_size", "cache_size",
    "max_window_layers",
}


def sizes_the_split(name: str, value: Any) -> bool:
    """A configuration field a split model cannot change: a size or count (by name, see `_SIZES`) holding
    an int (or ints, or None)."""
    if name.startswith("_") or name in _RUN_TIME or not _SIZES.fullmatch(name):
        return False
    values = value if isinstance(value, (list, tuple)) else (value,)
    return all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in values)


class _Guard:
    """What one configuration object refuses: field name -> why (for the message)."""

    def __init__(self, split: str) -> None:
        self.fields: dict[str, str] = {}
        self.split = split


_GUARDS: dict[int, _Guard] = {}  # id(config) -> its guard, while the object lives


def guard(trees: Iterable[nn.Module], split: str) -> None:
    """After a split: the configurations `trees` hold refuse new values for the fields that size the split,
    and for those a plan holds per device (`LocalValues`). `split` says how it was split ("over 2 devices")."""
    trees = list(trees)
    per_device: dict[int, set[str]] = {}
    for tree in trees:
        for module in tree.modules():
            for value in vars(module).values():
                _collect_local(value, per_device)
    for config in configurations(trees):
        if not is_model_configuration(config):
            continue  # a generation configuration: nothing in it sizes the model
        state = _GUARDS.get(id(config))
        if state is None:  # (a config shared by two split models keeps one guard, with both lists)
            state = _GUARDS[id(config)] = _Guard(split)
            weakref.finalize(config, _GUARDS.pop, id(config), None)
            if type(config) not in _GUARDED.values():
                object.__setattr__(config, "__class__", _guarded_class(type(config)))
        for name, value in vars(config).items():
            if sizes_the_split(name, value):
                state.fields.setdefault(name, "it sizes the split layers' weights or attention heads")
        for name in per_device.get(id(config), ()):
            state.fields[name] = "the plan gives every device its own value of it"


def _collect_local(value: Any, out: dict[int, set[str]]) -> None:
    if is_local_values(value):
        local = local_values(value)
        out.setdefault(id(shared_of(value)), set()).update(local)
        for inner in local.values():
            _collect_local(inner, out)


def is_model_configuration(config: Any) -> bool:
    """A transformers model configuration (not a generation configuration)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedConfig", None) or getattr(transformers, "PretrainedConfig", None)
    return base is not None and isinstance(config, base)


def _check(config: Any, name: str, value: Any) -> None:
    state = _GUARDS.get(id(config))
    if state is None:
        return
    aliases = getattr(type(config), "attribute_map", None) or {}
    key = aliases.get(name, name)
    why = state.fields.get(key)
    if why is None:
        return
    missing = object()
    current = getattr(config, key, missing)
    if same_value(current, value):
        return
    shown = f"{name} ({key})" if key != name else name
    raise FrozenBySplitError(
        f"{type(config).__name__}.{shown} = {value!r}: this model is split {state.split} and {why} "
        f"({current!r} now), so a split model cannot change it. Change it on the unsplit model's configuration "
        "before splitting (tp.tensor_parallel / tp.parallelize); for a new model of another size, "
        "copy.deepcopy(config) gives a configuration you can change."
    )


def same_value(a: Any, b: Any) -> bool:
    """`a` and `b` are equal values of one type (setting one over the other changes nothing)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are not the same
        return False


_GUARDED: dict[type, type] = {}  # configuration class -> its guarded subclass


def _guarded_class(cls: type) -> type:
    """`cls` under the same name, whose instances refuse the fields their guard lists (see `_check`)."""
    if cls in _GUARDED:
        return _GUARDED[cls]

    def __setattr__(self, name: str, value: Any) -> None:
        _check(self, name, value)
        cls.__setattr__(self, name, value)

    def __reduce_ex__(self, protocol: int):
        # copy, deepcopy and pickle rebuild an instance of `cls`: a copy is a configuration like any other
        reduced = cls.__reduce_ex__(self, protocol)
        if not isinstance(reduced, tuple) or len(reduced) < 2:
            return reduced
        args = tuple(cls if a is guarded else a for a in reduced[1])
        return (reduced[0], args, *reduced[2:])

    namespace = {
        "__slots__": (),  # the instance layout of `cls`, so that an instance can switch classes
        "__setattr__": __setattr__,
        "__reduce_ex__": __reduce_ex__,
        "__class__": property(lambda self: cls),  # what code that compares classes sees (dataclass __eq__)
        "__eq__": cls.__eq__,
        "__hash__": cls.__hash__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    guarded = _GUARDED[cls] = type(cls.__name__, (cls,), namespace)
    return guarded
