"""Has any module gained a submodule, parameter or buffer since a given moment? A cheap test before walking a
split model's tree on every call (late adapters: engines/inprocess/late_adapters.py, torchrun/late_adapters.py).

Three global hooks of torch.nn (module, parameter and buffer registration), installed when this file is first
imported, count every registration in the process: `setattr(module, name, x)`, `add_module`, a ModuleDict or
ParameterDict item, `register_buffer`, as PEFT and every model constructor use them. A model's tree can only gain
something through one of them (or through a direct write into a module's `_modules`, `_parameters` or `_buffers`
dict, which tensorshard itself does only while splitting), so an unchanged count means an unchanged tree.
"""

from __future__ import annotations

from torch import nn

_count = 0


def _seen(*_args) -> None:
    global _count
    _count += 1


def registrations() -> int:
    """How many submodules, parameters and buffers were registered on any module of this process so far."""
    return _count


nn.modules.module.register_module_module_registration_hook(_seen)
nn.modules.module.register_module_parameter_registration_hook(_seen)
nn.modules.module.register_module_buffer_registration_hook(_seen)
