"""The registry of presets: `PRESETS` maps a transformers ``model_type`` to its ``config -> Plan`` function, and
`@preset(...)` registers one. The families (decoders.py, encoders.py, gpt.py) register theirs when the package
imports them; `preset_for` (the package) looks them up."""

from __future__ import annotations

from typing import Callable

from ..plan import Plan

PRESETS: dict[str, Callable[..., Plan]] = {}


def preset(*model_types: str) -> Callable[[Callable[..., Plan]], Callable[..., Plan]]:
    """Register a ``config -> Plan`` function for these transformers ``model_type`` names."""

    def register(fn: Callable[..., Plan]) -> Callable[..., Plan]:
        for name in model_types:
            PRESETS[name] = fn
        return fn

    return register
