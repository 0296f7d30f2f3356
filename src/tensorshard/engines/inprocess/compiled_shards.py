"""torch.compile of an in-process split model: every shard compiled, each in its own thread, as the unsplit
model would be, with the collectives inside its graphs.

    compiled = torch.compile(split)                   # or split.compile(...), with any torch.compile options
    for block in split.model.layers: block.compile()  # per block, torchtitan's way (a view compiles its parts)

A split model's call is engine code (copying the inputs to every device, handing each shard to its thread,
joining the outputs) that dynamo cannot trace: traced, it broke the graph dozens of times, and only the shard
run in the calling thread was compiled, the others running eagerly in theirs. So the split model's own call is
a frame dynamo skips (`torch.compiler.disable(recursive=False)` on `TensorParallel.__call__`): it reads the
compiler torch.compile installed for the calling thread, runs the engine with dynamo off, and runs each shard's
forward under that same compiler in the shard's thread, under a code object of its own (`entry`: dynamo keeps
graphs, guards and its recompile limit per code object). Each shard then compiles what the unsplit model would:
one graph for the whole model (or one per compiled block), the same graph breaks, and its collectives as
operators whose autograd is comm/functions.py's (comm/traced_collectives.py): the backward graph holds the
backward collectives, so a compiled training step runs the eager path's collectives (2 + 2 per block) and its
numbers.

Compiled per block (`compile()` on a view of the blocks), every block of every shard shares its class's code
object, and dynamo guards each graph on the constants it read: so the collectives name their shard and call site
by a tensor the graph takes as an input (each style's comm is bound to its module, comm/threads.py `at`), and
ZeRO-3's hooks read only flags that are the same in every block (zero.py); one graph then serves every block and
shard, as for the unsplit model. Where dynamo still runs a frame eagerly (past its recompile limit, on one shard
and not another), the engine marks the call as compiled (`kind_of_call`) and the eager collectives take their
traced forms' paths, so the shards still meet.

The first calls after compiling run the shards one at a time, and their backward passes too (torch.compile is
not thread-safe); later calls run them as the engine would (a recompile then, for an input of a new shape, takes
dynamo's compile lock in its thread). Reading and setting the compiler of a thread uses
dynamo's `get_eval_frame_callback` / `set_eval_frame`: where a torch release lacks them, `compile()` on a split
model says so.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch import nn

from ...logs import get_logger
from .compiled_steps import _entry  # `shard(...)` under a code object of its own (engines/own_code.py)
from .views import root_of

logger = get_logger(__name__)

_frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_get_compiler = getattr(_frames, "get_eval_frame_callback", None)
_set_compiler = getattr(_frames, "set_eval_frame", None)
# dynamo's compiler of this thread: set_compiler(c) installs c and returns the one it replaces. A builtin, so that a
# frame dynamo skips can take the compiler off before any other frame starts (that frame would be traced).
set_compiler = _set_compiler if callable(_get_compiler) and callable(_set_compiler) else None
_here = threading.local()  # .compiler: the compiler of the split model's call this thread is running
WARMUP = 2  # calls run one shard at a time after compiling (a first call, then a recompile for a changed input)


def supported() -> bool:
    """Whether this torch lets the engine hand a thread's compiler to the shards' threads."""
    return set_compiler is not None


def require_support() -> None:
    if not supported():
        raise NotImplementedError(
            f"torch {torch.__version__} has no torch._C._dynamo.eval_frame.get_eval_frame_callback/set_eval_frame, "
            "which compiling an in-process split model needs; compile the blocks of each shard yourself "
            "(for shard in split.module_shards: ...) or run it eagerly"
        )


def compiler_of_the_call() -> Any:
    """Inside the engine: the compiler the split model's current call runs its shards under (or None)."""
    return getattr(_here, "compiler", None)


def run_compiled(model: nn.Module, compiler: Any, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`call(*args, **kwargs)` (the split model's call; the caller took dynamo's compiler off this thread): the
    engine runs each shard under `compiler` (`shard_call`)."""
    previous = getattr(_here, "compiler", None)
    _here.compiler = compiler
    seen = model.__dict__.setdefault("_compilers_seen", set())
    if id(compiler) not in seen:
        seen.add(id(compiler))
        start_warmup(root_of(model))
    try:
        return call(*args, **kwargs)
    finally:
        _here.compiler = previous


def shard_call(model: nn.Module, compiler: Any) -> Callable[[int, tuple, dict], Any]:
    """(rank, args, kwargs) -> shard `rank`'s forward, compiled by `compiler` in the calling thread."""
    entries = model.__dict__.setdefault("_compiled_entries", {})
    shards = model.module_shards

    def call(rank: int, args: tuple, kwargs: dict) -> Any:
        shard = shards[rank]
        entry = entries.get(id(shard))
        if entry is None or entry[0] is not shard:
            entry = entries[id(shard)] = (shard, _entry(shard, rank))
        zero = model.__dict__.get("_zero")  # ZeRO-3: gathered outside the graph (its hooks do nothing traced)
        scope = zero.gather_everything(rank) if zero is not None else None
        prior = _set_compiler(compiler)
        try:
            return entry[1](*args, **kwargs)
        finally:
            _set_compiler(prior)
            if scope is not None:
                zero.release(scope, rank)

    return call


def compile_split(model: nn.Module, root: nn.Module, args: tuple, kwargs: dict) -> None:
    """`model.compile(*args, **kwargs)`: a split model's call compiled (`run_compiled`), or for a view (a block of
    a split model, say) its part in every shard compiled as `nn.Module.compile` would."""
    require_support()
    if root is not model:
        for part in model.module_shards:
            part.compile(*args, **kwargs)
        root.__dict__["_compiled_parts"] = True
    else:
        # a bound method: torch.compile keeps it (it unwraps a function made by torch.compiler.disable)
        model._compiled_call_impl = torch.compile(model._compiled_call, *args, **kwargs)
    start_warmup(root)
    logger.info("compiled %s on each of its %d device(s)", type(model).__name__, len(model.module_shards))


def kind_of_call(root: nn.Module, compiled: bool, steps: bool) -> str:
    """What a call of the split model `root` runs compiled: "shards" (each shard's forward: `compiled`), "steps"
    (the decode steps of compiled_steps.py), "blocks" (parts of them: `compile()` on a view), or "" (nothing). Its
    eager collectives then take their traced forms' paths, so that a frame dynamo runs eagerly on one shard and
    compiled on another still meets the same collectives (comm/threads.py, ThreadComm._eager_where)."""
    if compiled or steps:
        return "steps" if steps else "shards"
    return "blocks" if root.__dict__.get("_compiled_parts") else ""


def start_warmup(model: nn.Module) -> None:
    """The next calls of `model` run their shards one at a time (and their backward passes): they compile."""
    model.__dict__["_compile_warmup"] = WARMUP


def take_warmup(model: nn.Module) -> bool:
    """Whether this call of `model` is one of its warm-up calls (counted down)."""
    left = model.__dict__.get("_compile_warmup", 0)
    if left:
        model.__dict__["_compile_warmup"] = left - 1
    return bool(left)
