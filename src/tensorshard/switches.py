"""The library's on/off environment switches (``TENSORSHARD_NATIVE``, ``TENSORSHARD_CPP_WRAPPER``, ...): each is on
unless set to "0", "false", "no" or "off" (any case, spaces ignored); docs/generation.md and docs/torchrun.md say
what each turns off."""

from __future__ import annotations

import os

_OFF = ("0", "false", "no", "off")


def switched_on(name: str) -> bool:
    """Whether the switch `name` (an environment variable, on by default) is on now."""
    return os.environ.get(name, "1").strip().lower() not in _OFF
