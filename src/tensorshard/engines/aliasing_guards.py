"""Dynamo's object-aliasing guards, built in C++ for one compiled call: for either engine's compiled steps.

    from tensorshard.engines.aliasing_guards import aliasing_guards_in_cpp
    with aliasing_guards_in_cpp():
        out = compiled(*args, **kwargs)     # a compile during this call builds them as C++ guards

When dynamo reaches one object along two paths it guards that they stay one (`a is b`). From torch 2.8 it gathers
those checks into one Python lambda at the end of the guard tree (`torch._dynamo.config.
use_lamba_guard_for_object_aliasing`, spelled so), on the view that they are rare. A split model is full of them:
every style wrapper holds its module and the group's comm, so SmolLM2's shape at 2 torchrun ranks has ~1,000,
which took ~7 s to build at the first call and are evaluated in Python every token. With the switch off for the
call, dynamo builds the same checks as C++ guards. The switch is read only while guards are built, is restored
after the call, and where torch lacks it nothing changes.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_SWITCH = "use_lamba_guard_for_object_aliasing"


@contextmanager
def aliasing_guards_in_cpp():
    """For the duration: dynamo builds object-aliasing guards as C++ guards (not one Python lambda)."""
    config = torch._dynamo.config
    if not hasattr(config, _SWITCH):
        yield
        return
    before = getattr(config, _SWITCH)
    setattr(config, _SWITCH, False)
    try:
        yield
    finally:
        setattr(config, _SWITCH, before)
