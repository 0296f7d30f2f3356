"""Has a split model gained a submodule, parameter or buffer since a given moment (`nothing_added`)? A cheap test
before walking its module tree on every call (modules added after splitting: engines/late_modules.py,
integrations/peft/late_adapters.py); `count_modules_and_tensors` watches every module it counts.

Three global hooks of torch.nn (module, parameter and buffer registration), installed while a watched split
model lives (global_hooks.py; none at import), count the registrations made on the modules of split models
(`watch`): `setattr(module, name, x)`, `add_module`, a ModuleDict or ParameterDict item, `register_buffer`, as
PEFT uses them. Registrations on other modules are not counted: model code builds modules while it runs
(transformers' Llama slices its ModuleList of layers on every call, which makes a new ModuleList). A watched
tree can only gain something through one of these hooks or through a direct write into a module's `_modules`,
`_parameters` or `_buffers` dict, which tensorshard itself does while splitting; so an unchanged count means an
unchanged tree.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch import nn

from .global_hooks import GlobalHook

_count = 0
_watched: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _seen(module: nn.Module, *_args) -> None:
    global _count
    # While torch.compile traces, the registrations are those of modules the traced code makes (Llama's sliced
    # ModuleList), never watched ones; looking them up would make dynamo guard on the whole weak set's contents,
    # which change as unrelated split models are freed (failed guards, recompiles).
    if torch.compiler.is_compiling():
        return
    if module in _watched:
        _count += 1


def watch(root: nn.Module, modules: Iterable[nn.Module]) -> None:
    """Count registrations on these modules from now on (every module of a split model's tree below `root`, which
    holds the hooks while it lives)."""
    REGISTRATION_HOOKS.hold(root)
    _watched.update(modules)


def registrations() -> int:
    """How many submodules, parameters and buffers were registered on watched modules so far."""
    return _count


def count_modules_and_tensors(root: nn.Module) -> int:
    """Modules and tensors below `root`: a change means something was added since the last look. Registrations
    on these modules are counted from now on, so the next look can be skipped until one."""
    modules = list(root.modules())
    watch(root, modules)
    return sum(1 + len(m._parameters) + len(m._buffers) for m in modules)


def nothing_added(root: nn.Module, registrations_then: int | None, count_then: int) -> int | None:
    """The registration count to keep when nothing was added below `root` since the last look (no registration on
    the split model's modules since `registrations_then`, or still `count_then` modules and tensors); None when
    something may have been: then the engine looks (engines/late_modules.py)."""
    seen = registrations()
    if seen == registrations_then or count_modules_and_tensors(root) == count_then:
        return seen
    return None


def _install() -> list:
    registering = nn.modules.module
    return [registering.register_module_module_registration_hook(_seen),
            registering.register_module_parameter_registration_hook(_seen),
            registering.register_module_buffer_registration_hook(_seen)]


REGISTRATION_HOOKS = GlobalHook("torch.nn module, parameter and buffer registration hooks (registrations.py)", _install)
