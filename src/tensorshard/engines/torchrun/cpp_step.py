"""A learnt torchrun decode step's graph built again with inductor's C++ wrapper: a later token is one C++ call.

    again = cpp_step.candidate((gm, inductor_settings), inputs, dynamic=False, name="LlamaForCausalLM")
    run = cpp_step.build(again, inputs, name="LlamaForCausalLM")  # after BUILD_AFTER direct calls (None: failed)
    outputs = run(*inputs)                                          # direct_step.py's call, while `enabled()`

Once a kind of call is learnt (direct_step.py), its token is the compiled graph called by the engine. Inductor's
default wrapper is Python: for SmolLM2-135M's shape at 2 ranks, each token runs ~400 extern kernel calls and ~900
`reinterpret_tensor` as Python lines. The same FX graph (as dynamo gave it to the backend), built with inductor's
C++ wrapper (comm/native/cpp_graphs.py: the same kernels, the wrapper a C++ function, cached on disk like any
inductor graph), runs them without Python. Built when:

- inductor compiled the graph (the compile config's backend; its mode and options are kept, the C++ wrapper added);
- its shapes are static (no int input: a dynamic-shapes graph keeps the Python wrapper);
- every operator it calls is one inductor generates code for or calls in C++: aten and prims operators, and
  tensorshard's native collectives (dispatcher operators written in C++, comm/native/collectives.cpp). A graph
  holding another operator (a Python `custom_op`, such as comm/dist_ops.py's Python collectives where the native
  library is not built) keeps the Python wrapper: its call would enter Python from C++ anyway;
- ``TENSORSHARD_CPP_WRAPPER`` is not "0" (read at each call too: "0" runs the Python wrapper's graph, to compare).

The build waits until the kind has run `BUILD_AFTER` tokens directly on the Python wrapper's graph (a kind in use,
not a one-off short call), then happens in that call, once per process and kind, logged at INFO; inductor's cache
keeps it for later processes (cold, the C++ wrapper is a long function, ~4000 lines for SmolLM2's shape, compiled
apart from the kernels: minutes; warm, ~2 s; docs/generation.md has the figures). A build that fails keeps the
Python wrapper (logged as a warning). Every rank builds at the same token (they count the same calls), each its own
graph; a rank whose build ends first waits for the others at the graph's first collective, within the group's time
limit (300 s by default), as at the first call's compile.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import fx

from ...comm.native import cpp_graphs
from ...logs import get_logger
from ...switches import switched_on
from ..inductor_cache import CacheUse

logger = get_logger(__name__)

ENV = "TENSORSHARD_CPP_WRAPPER"  # "0": the Python wrapper's graph (the in-process engine's switch too)
# Direct calls of a kind on the Python wrapper's graph before its C++ one is built: the build costs ~2 s with
# inductor's cache warm and minutes cold (SmolLM2's shape), and saves ~2 ms of CPU per token, so a one-off short
# generate() never pays it and the first call stays what it was; a kind in use pays it once, at its 65th token.
BUILD_AFTER = 64
_NAMESPACES = {"aten", "prims"}  # operators inductor lowers or calls as C++ kernels


def enabled() -> bool:
    return switched_on(ENV)


def why_not(gm: fx.GraphModule) -> str | None:
    """Why `gm` would not run without Python under the C++ wrapper (None: it would)."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            return f"it calls {target.name()}, a higher-order operator"
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            namespace = target.namespace
            name = target.name() if isinstance(target, torch._ops.OpOverload) else f"{namespace}::{target.__name__}"
            if namespace not in _NAMESPACES and not name.startswith("tensorshard::native_"):
                return f"it calls {name}, an operator that is not aten's, prims' or a native collective"
    return None


def candidate(again: tuple[fx.GraphModule, dict] | None, inputs: Sequence[Any], *, dynamic: bool,
              name: str) -> tuple[fx.GraphModule, dict] | None:
    """`again` (dynamo's FX graph and inductor's settings; None for another backend) where the graph of a learnt
    call with these graph `inputs` can be built with the C++ wrapper (see the module doc); else None, with the
    reason at DEBUG."""
    if again is None:
        return None
    why = "its shapes are dynamic (an int input)" if dynamic else why_not(again[0])
    if why is None and not all(isinstance(x, torch.Tensor) for x in inputs):
        why = "an input is not a tensor"
    if why is not None:
        logger.debug("the decode step of %s keeps inductor's Python wrapper: %s", name, why)
        return None
    return again


def build(again: tuple[fx.GraphModule, dict], inputs: Sequence[Any], *, name: str) -> Callable[..., Any] | None:
    """The graph `again` holds (a `candidate`) built with the C++ wrapper for `inputs` (a call's graph inputs: real
    tensors); None where the build fails (logged: the Python wrapper's graph goes on)."""
    gm, settings = again
    began, cache = time.perf_counter(), CacheUse()
    if not dist.is_initialized() or dist.get_rank() == 0:  # (the pause this call takes: say why before it)
        logger.info("building the decode step of %s with inductor's C++ wrapper, once per kind of call (seconds with "
                    "inductor's cache warm, minutes cold; %s=0 skips it)", name, ENV)
    # (CUDA graphs, "reduce-overhead"'s, do not apply to CPU ranks, and inductor refuses them beside the C++ wrapper)
    settings = {k: v for k, v in settings.items() if not k.startswith("triton.cudagraph")}
    try:
        compiled = cpp_graphs.compile_graph(gm, inputs, settings, hold=False)
    except Exception as error:  # a graph this inductor cannot build so: the Python wrapper's graph still runs it
        logger.warning("the decode step of %s keeps inductor's Python wrapper: its C++ wrapper failed to build (%s: %s)",
                       name, type(error).__name__, error)
        return None
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("built the decode step of %s with inductor's C++ wrapper in %.1f s (%s), after %d tokens of this "
                    "kind; later tokens call it (%s=0 keeps the Python wrapper)", name, time.perf_counter() - began,
                    cache.since(), BUILD_AFTER, ENV)
    return compiled
