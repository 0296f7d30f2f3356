"""Replicate: keep a module whole on every device (and everything inside it)."""

from __future__ import annotations

from dataclasses import dataclass

from .style import Style, register


@register("replicate")
@dataclass(frozen=True, kw_only=True)
class Replicate(Style):
    """Keep this module, and every module inside it, whole on every device.

    Modules that no plan entry matches are replicated anyway; an explicit ``Replicate()`` also stops
    later entries from splitting the module's children. The gradients of replicated parameters are whole
    and identical on every device (each device runs the same computation), so their copies never drift.
    """
