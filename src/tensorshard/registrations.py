"""Has a split model gained a submodule, parameter or buffer since a given moment? A cheap test before walking
its module tree on every call (late adapters: engines/inprocess/late_adapters.py, torchrun/late_adapters.py;
plans/late_adapters.py's count watches every module it counts).

Three global hooks of torch.nn (module, parameter and buffer registration), installed when this file is first
imported, count the registrations made on the modules of split models (`watch`): `setattr(module, name, x)`,
`add_module`, a ModuleDict or ParameterDict item, `register_buffer`, as PEFT uses them. Registrations on other
modules are not counted: model code builds modules while it runs (transformers' Llama slices its ModuleList of
layers on every call, which makes a new ModuleList). A watched tree can only gain something through one of
these hooks or through a direct write into a module's `_modules`, `_parameters` or `_buffers` dict, which
tensorshard itself does while splitting; so an unchanged count means an unchanged tree.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch import nn

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


def watch(modules: Iterable[nn.Module]) -> None:
    """Count registrations on these modules from now on (every module of a split model's tree)."""
    _watched.update(modules)


def registrations() -> int:
    """How many submodules, parameters and buffers were registered on watched modules so far."""
    return _count


nn.modules.module.register_module_module_registration_hook(_seen)
nn.modules.module.register_module_parameter_registration_hook(_seen)
nn.modules.module.register_module_buffer_registration_hook(_seen)
