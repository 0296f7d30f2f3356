"""A function of its own for each thing the engines hand `torch.compile`, whose compiled graphs die with it.

    step = own_function(shard, f"shard0_step_{id(shard):x}")     # shard(*args, **kwargs), under a code object of its own
    compiled = torch.compile(step, **options)
    before = eager_calls(step)
    out = compiled(...)
    if eager_calls(step) > before: logger.warning(...)             # dynamo ran this call eagerly (why: at_recompile_limit)

Dynamo keeps what it compiled for a frame (graphs, guards, the count of recompiles that its `recompile_limit`, 8 by
default, caps) on the frame's code object, not on the function or the model. Compiled as they are, every split
model of a process shares one code object: under torchrun, transformers' `get_compiled_call` compiles
`model.__call__`, whose frames are every model's (measured: the frame dynamo compiled was the model's forward,
one code for all). Each new model adds an entry there (its graph reads its own group's names and handles), and
from the 9th model a job parallelizes, dynamo runs the decode step eagerly: the same tokens and collectives,
silently slower, with one line of dynamo's log (`hit config.recompile_limit (8)`) as the only sign.

So each split model's compiled steps get a function whose code object is a new one (`own_function`: the same
bytecode, another name), and dynamo's cache for it starts empty. That cache must also die with the model: dynamo's
own tables keep every code object it compiled alive (a global map from each compiled code to the code it came
from, whose key lives in the original code's cache), and with it the compiled graphs and what their backends hold.
So when the function itself is garbage (the model and its engine objects gone), its code's cache is cleared
(dynamo's `reset_code`, the call `torch._dynamo.reset()` makes for every code): the graphs, guards and backends'
results go, and the entries in dynamo's tables with them. (Measured in one process, where the shards already had
code of their own: every split model decoded on the stitched path stayed alive after `del`, its weights read by
the captured graphs dynamo's cache kept.) Where a torch lacks `reset_code` the cache stays, with what it holds.

What remains is a limit a single model reaches on its own: a step that recompiles per token (sliding-window cache
layers) or one compile per kind of call past the limit. Past it dynamo runs a call that matches none of its graphs
eagerly, saying so once per code in its own log. The function counts such calls (`eager_calls`: its body runs as
Python only when dynamo did not run compiled code for it; traced, the count is a branch dynamo drops), so the
engines say once (WARNING) that their step ran eagerly, and why (`at_recompile_limit`), with the fix; the engine
never raises the process's limit, which governs the user's other compiled code.
"""

from __future__ import annotations

import itertools
import sys
import types
import weakref
from typing import Any, Callable

import torch

_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_reset_code = getattr(_eval_frame, "reset_code", None)  # clears one code object's cache entries
_cache_entries = getattr(_eval_frame, "_debug_get_cache_entry_list", None)  # (a code object) -> its cache entries
_EAGER = "_tensorshard_eager_calls"  # an own function's attribute: [calls dynamo ran eagerly]
_serial = itertools.count()  # numbers the own functions of this process


def own_function(call: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`call(*args, **kwargs)` as a new function whose code object is its own, named `name` (what dynamo's logs and
    errors show); dynamo's cache for it starts empty and is cleared when the function is garbage. Keep the function
    (or the `torch.compile` wrapper around it) for as long as its graphs are wanted: on the object that owns them."""

    eager = [0]  # calls dynamo ran eagerly (`eager_calls`)

    def step(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():  # (True while dynamo traces: never part of a graph)
            eager[0] += 1
        return call(*args, **kwargs)

    # Code objects compare and hash by value, and dynamo keeps some of its per-code state in dicts and sets: two
    # codes equal in every field, a dead model's and a new one's whose `name` reuses its freed address, would share
    # that state (a new model's step skipped as the dead one's was, say). A number of its own keeps each one unequal.
    name = f"{name}_{next(_serial)}"
    names = {"co_name": name, "co_qualname": name} if sys.version_info >= (3, 11) else {"co_name": name}
    code = step.__code__.replace(**names)
    made = types.FunctionType(code, step.__globals__, name, None, step.__closure__)
    made.__dict__[_EAGER] = eager
    if _reset_code is not None:
        # (holds the code, not the function: dynamo's tables hold the code anyway until its cache is cleared)
        weakref.finalize(made, _reset_code, code).atexit = False
    return made


def eager_calls(function: Callable[..., Any]) -> int:
    """How many calls of `function` (an `own_function`) ran its Python rather than dynamo's compiled code: dynamo ran
    them eagerly (past its recompile limit, a compile that failed, dynamo switched off). 0 for another function."""
    return getattr(function, "__dict__", {}).get(_EAGER, [0])[0]


def cache_entries(function: Callable[..., Any]) -> int | None:
    """How many compiled entries dynamo holds for `function`'s code (None where this torch cannot say)."""
    code = getattr(function, "__code__", None)
    if _cache_entries is None or code is None:
        return None
    try:
        return len(_cache_entries(code))
    except (TypeError, RuntimeError):
        return None


def recompile_limit() -> int:
    """Dynamo's recompile limit in force (`torch._dynamo.config.recompile_limit`; `cache_size_limit` before)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8)))


def at_recompile_limit(function: Callable[..., Any]) -> bool:
    """Whether dynamo holds as many entries for `function`'s code as its recompile limit: a call that matches none
    of them runs eagerly (dynamo compiles nothing more for it). A bound method counts its function's code."""
    entries = cache_entries(function)
    return entries is not None and entries >= recompile_limit()


def eager_advice(what: str, function: Callable[..., Any]) -> str:
    """The WARNING's text when `what` (a named model's compiled step, `function` the one dynamo compiles) ran
    eagerly: why, where it can be told, and the fix."""
    if at_recompile_limit(function):
        return (
            f"{what} ran eagerly (the same tokens, slower): it reached dynamo's recompile limit "
            f"(torch._dynamo.config.recompile_limit = {recompile_limit()}), having compiled that many graphs for "
            "this one model, and dynamo runs a call that matches none of them eagerly. A step that recompiles per "
            "token (sliding-window cache layers) or a compile per kind of call (each batch size and cache length: "
            "pass generate() one StaticCache of a fixed max_cache_len) gets there; to keep it compiled, raise that "
            "limit before generating, or split the model again (each split model's steps have a limit of their own)"
        )
    return (f"{what} ran eagerly (the same tokens, slower): dynamo compiled no graph for a call of it; dynamo's own "
            "messages say why (TORCH_LOGS=\"recompiles,graph_breaks\" shows more)")
