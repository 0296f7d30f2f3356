"""The collective timeout both engines use: a default, the TENSORSHARD_TIMEOUT override, and checks.

Every wait at a collective is bounded by this many seconds; a shard that does not arrive in time fails
the call with an error naming the device (or rank) and the operation. The default is long enough for
a slow first step (lazy initialisation, compilation) and short enough that a hang is noticed.
"""

from __future__ import annotations

import math
import os

DEFAULT_TIMEOUT = 300.0
ENV = "TENSORSHARD_TIMEOUT"


def resolve_timeout(timeout: float | None) -> float:
    """`timeout` in seconds, else $TENSORSHARD_TIMEOUT, else 300; a positive, finite number."""
    source = "timeout"
    if timeout is None:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT
        source = f"{ENV}={raw!r}"
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{source} is not a number of seconds; set e.g. {ENV}=600, or unset it for 300") from None
    elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout={timeout!r} has type {type(timeout).__name__}; give seconds as a number, e.g. timeout=600")
    timeout = float(timeout)
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(
            f"{source}: {timeout} is not a positive, finite number of seconds. Every collective waits at most "
            "this long so that a failed or stuck shard cannot hang the job; give e.g. 600 for slow steps."
        )
    return timeout
