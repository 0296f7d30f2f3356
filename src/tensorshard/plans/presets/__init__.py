"""Presets: short declarative plans for known architectures, looked up from the model."""

from __future__ import annotations

from torch import nn

from ..plan import Plan


def preset_for(module: nn.Module) -> Plan | None:
    """The preset plan for `module`'s architecture, or None."""
    return None
