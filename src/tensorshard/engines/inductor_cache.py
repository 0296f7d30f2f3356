"""What inductor's on-disk caches did during a compile: graphs found, compiled anew, or compiled without them.

    from tensorshard.engines.inductor_cache import CacheUse
    use = CacheUse()
    step.compile(...)                      # any inductor compiles
    logger.info("compiled in 1.6 s (%s)", use.since())   # "inductor's cache, 2 graphs: 2 found"

A split model's first fast call is a few seconds when inductor finds its graphs on disk and minutes when it builds
them (SmolLM2's shape at 2 devices: two C++-wrapper graphs of ~4,000 lines each); the time alone does not say
which happened. One `make demo` took 44 s for a first call that took 17-22 s in three runs after it: that process
built both shards' C++ wrappers and kernels again (sources byte-identical to the cached ones, under the build keys
a process with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 makes) and wrote no FX-graph or AOT-autograd cache entry:
inductor's caches were off there. The compile log lines now say which it was: graphs found, compiled anew,
compiled without the cache (a bypass, whose reason inductor logs at INFO under `torch._inductor.codecache`), or
nothing looked up (the caches off).
"""

from __future__ import annotations

import torch

_KINDS = (("fxgraph_cache_hit", "found"), ("fxgraph_cache_miss", "compiled anew"),
          ("fxgraph_cache_bypass", "compiled without the cache"))


def _counts() -> dict[str, int]:
    counters = getattr(getattr(torch._dynamo, "utils", None), "counters", None)  # (where a torch lacks them: {})
    return {k: int(counters["inductor"][k]) for k, _ in _KINDS} if counters is not None else {}


class CacheUse:
    """Inductor's FX-graph cache counters from now: `since()` says what they did in words."""

    def __init__(self) -> None:
        self.before = _counts()

    def since(self) -> str:
        after = _counts()
        parts = [f"{after[k] - self.before.get(k, 0)} {words}" for k, words in _KINDS
                 if after.get(k, 0) > self.before.get(k, 0)]
        if not parts:
            return "inductor's cache: nothing looked up"
        graphs = sum(after[k] - self.before.get(k, 0) for k, _ in _KINDS)
        bypass = " (inductor's log at INFO, torch._inductor.codecache, says why)" if "without" in parts[-1] else ""
        return f"inductor's cache, {graphs} graph{'s' if graphs != 1 else ''}: {', '.join(parts)}{bypass}"
