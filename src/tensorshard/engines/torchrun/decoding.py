"""Compiled decoding for a transformers model parallelized under torchrun: what transformers does on CUDA, on
every device type.

    model = tp.parallelize(model, mesh)
    model.generate(ids, max_new_tokens=32, do_sample=False, cache_implementation="static")
    # rank 0 logs: compiled the decode step of LlamaForCausalLM (batch 1, 1 new token(s), cache of 37 tokens
    # (StaticCache), float32) in 14.2 s; torch.compile options {...}

transformers' `generate` compiles the decode step (`get_compiled_call`: `torch.compile(model.__call__)` with
the `CompileConfig`) when `_valid_auto_compile_criteria` says so: a compileable cache (StaticCache, passed by
hand or from `cache_implementation="static"`), no `generation_config.disable_compile`, and a CUDA/XPU/TPU
device. The last condition is what a split model lifts: its shards decode faster compiled on CPU ranks too
(docs/torchrun.md, "Compiled decoding"), so `parallelize` gives this one model instance
(not its class, not other models) two attributes that wrap transformers' methods:

1. `_valid_auto_compile_criteria`: transformers' own decision, asked as if `CompileConfig._compile_all_devices`
   were set when the cache is compileable; everything else (disable_compile, quantizers, offloading, flash
   attention's fullgraph override) stays transformers' call.
2. `get_compiled_call`: transformers' compiled call, wrapped so that each call that compiled (dynamo counted
   a new graph) logs on global rank 0 what it compiled and how long that took.

Both decisions and the log line are the in-process engine's too (engines/decode_decision.py).

The compiled step runs the model and its collectives as one graph; the engine's host-side work stays outside it
(engine.py). Before its first call, the ranks agree on the native collectives (comm/transport.connect_native):
where every rank is a CPU process of this host and loaded them, the graph calls those C++ operators
(comm/native/) and no collective enters Python; where every rank is a GPU of an NCCL group, the step traces
torch's functional collectives, which `mode="reduce-overhead"` (transformers' default on CUDA) captures in its CUDA
graphs with the rest of the step, gpt-fast's way (comm/graph_collectives.py: the step's collectives are noted as
it traces and counted per call here); elsewhere it calls comm/dist_ops.py's Python operators.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ...comm.graph_collectives import capturing_decode, report as report_collectives
from ...comm.transport import connect_native
from ...logs import get_logger
from ..aliasing_guards import aliasing_guards_in_cpp
from ..cheap_tracing import cheap_tracing
from .. import cpu_probe
from ..decode_decision import compileable_cache, decode_cache, describe_step, log_compiled
from ..own_code import eager_advice, eager_calls, own_function
from .direct_step import DirectSteps, enabled as direct_enabled
from .unguarded import Unguarded

logger = get_logger(__name__)


def install(root: nn.Module, guard, state) -> None:
    """Give the transformers generating model in `root` (root itself, or the model inside a PEFT wrapper) compiled
    decoding on every device; a module without one is left alone. `guard`: the group's GroupGuard, told when a
    compiled step raises (compiled code skips the root forward's report, so the other ranks stop at once);
    `state`: the TorchrunState, whose local views each compiled step puts in place at once (local_views.py)."""
    for model in root.modules():  # outermost first
        criteria = getattr(type(model), "_valid_auto_compile_criteria", None)
        compiled_call = getattr(type(model), "get_compiled_call", None)
        if criteria is not None and compiled_call is not None:
            model._valid_auto_compile_criteria = _on_every_device(model, criteria)
            model.get_compiled_call = _logging_compiles(model, compiled_call, guard, state)
            return


def _on_every_device(model: nn.Module, criteria: Callable) -> Callable:
    def valid_auto_compile_criteria(model_kwargs: dict, generation_config) -> bool:
        if generation_config.disable_compile or not compileable_cache(decode_cache(model_kwargs)):
            return criteria(model, model_kwargs, generation_config)
        forced = copy.copy(generation_config)  # the caller's config is left as it was
        forced.compile_config = copy.copy(generation_config.compile_config or _default_compile_config(model))
        forced.compile_config._compile_all_devices = True
        return criteria(model, model_kwargs, forced)

    return valid_auto_compile_criteria


def _default_compile_config(model: nn.Module):
    """The CompileConfig generate() compiles with when given none: the model's (a later transformers picks one per
    device type), or transformers 5.0's plain `CompileConfig()`, a class of the module of the model's
    GenerationConfig."""
    default = getattr(model, "_default_compile_config", None)
    return default() if callable(default) else sys.modules[type(model.generation_config).__module__].CompileConfig()


def _logging_compiles(model: nn.Module, compiled_call: Callable, guard, state) -> Callable:
    made: list = []  # [transformers' compiled call, our logging wrapper of this model's own compiled step]
    direct = DirectSteps(model, state, guard)  # later tokens: the compiled graph called directly (direct_step.py)

    def get_compiled_call(compile_config) -> Callable:
        compile_config = compile_config or _default_compile_config(model)
        ours = direct.capturing(compile_config)
        compiled = compiled_call(model, ours)
        if not made or made[0] is not compiled:  # transformers made a new one (another CompileConfig): the old one
            direct.forget()  # is gone (with the graphs it learnt, and dynamo's cache for its code: own_code.py)
            made[:] = [compiled, _logged(model, _own_step(model, compiled, ours), compile_config, guard, state, direct)]
        return made[1]

    return get_compiled_call


def _own_step(model: nn.Module, compiled: Callable, compile_config) -> Callable:
    """transformers' compiled call, `torch.compile(model.__call__, ...)`, compiled again on a function of this model's
    own (engines/own_code.py): dynamo keeps graphs, guards and its recompile limit per code object, and the frames of
    `model.__call__` are every model's, so every model parallelized in a process added its graph there (its
    collectives' group names differ) and from the 9th one the step ran eagerly. Another kind of compiled call
    (transformers leaves some models' call uncompiled) is kept as it is."""
    inner = getattr(compiled, "_torchdynamo_orig_callable", None)
    if getattr(inner, "__self__", None) is not model or getattr(inner, "__func__", None) is not type(model).__call__:
        return compiled
    step = own_function(model, f"decode_step_{type(model).__name__}_{id(model):x}")
    return torch.compile(step, **compile_config.to_dict())


def _logged(model: nn.Module, compiled: Callable, compile_config, guard, state, direct: DirectSteps) -> Callable:
    name = type(model).__name__
    collectives: dict[str, list] = {}  # per kind of step (describe_step): the capturable collectives it traced
    unguarded = Unguarded(model)
    frame = getattr(compiled, "_torchdynamo_orig_callable", None)  # the function dynamo compiles (its cache: own_code.py)
    warned: list[bool] = []  # (said once that dynamo ran the step eagerly)
    # Where later tokens leave dynamo for the direct step (CPU ranks), every call dynamo runs sees the model as it
    # traces cheaply (engines/cheap_tracing.py: the split layers through their class's or style's shorter forward,
    # configs read plainly): SmolLM2's shape traced 76,631 -> 43,312 bytecodes per rank at the first call. Decided
    # once per compiled call, since dynamo guards the classes it traced: every call it runs must see the same ones. Elsewhere (GPU ranks, TENSORSHARD_DIRECT_STEP=0) dynamo runs every token, and a
    # swap (~1.4 ms for SmolLM2's 210 split layers) would cost each of them.
    classes = (lambda: cheap_tracing([model])) if direct.sees_graphs() and direct_enabled() else contextlib.nullcontext

    def call(*args, **kwargs):
        connect_native(guard)  # once: every rank reaches the compiled step at the same point
        key = unguarded.key(args, kwargs)
        # a kind of call that compiled nothing at its last guarded call: only dynamo's differentiating guards, our
        # checks in place of the others (unguarded.py); where its graph is known, that graph alone (direct_step.py)
        skip = unguarded.may_skip(key, quiet=state.views.quiet())
        if skip:
            try:
                out = direct.run(key, args, kwargs)
            except BaseException as e:
                guard.report(e, f"the compiled decode step of {name}")
                raise
            if out is not None:
                if collectives:  # (traced functional collectives, counted per call as below)
                    report_collectives(collectives.get(describe_step(kwargs, getattr(model, "dtype", None)), ()))
                return out
        elif direct.may_keep(key) and unguarded.may_skip_warm(state.views.quiet()):
            # the first call of a kind: its step built from the graph an earlier process kept, without dynamo, where
            # every rank has one (kept_step.py); later calls of the kind run it directly, unguarded
            try:
                out = direct.from_store(key, unguarded.lasting(key), args, kwargs)
            except BaseException as e:
                guard.report(e, f"the compiled decode step of {name}")
                raise
            if out is not None:
                unguarded.ran(key, skipped=False, compiled=False)
                return out
        if getattr(state.mesh, "device_type", None) == "cpu":
            cpu_probe.start()  # (inductor's question about the CPU, answered while dynamo traces: cpu_probe.py)
        before = compiled_graphs()
        eager = eager_calls(frame) if frame is not None else 0
        began = time.perf_counter()
        try:
            # outside the graph: dynamo traces and guards no swap; on CUDA ranks of an NCCL group, collectives
            # that CUDA graphs capture
            with state.views.all_local(state.mesh), aliasing_guards_in_cpp(), capturing_decode() as traced:
                skip = skip and state.views.active  # (no views in place: a DTensor of another mesh)
                with unguarded.stance(skip), direct.watching() as seen, classes():
                    out = compiled(*args, **kwargs)
                if not skip and state.views.active and compiled_graphs() == before:
                    direct.learn(key, seen, args, kwargs, out)  # (the local views still in place)
        except BaseException as e:
            guard.report(e, f"the compiled decode step of {name}")
            raise
        # a call that ran no compiled graph (dynamo ran the frame eagerly: its recompile limit, a frame it skips)
        # does not warm its kind: under the stance dynamo would refuse to compile it again
        ran_graph = bool(seen) or not direct.sees_graphs()
        unguarded.ran(key, skip, compiled_graphs() != before, ran_graph=ran_graph)
        # dynamo ran the step eagerly (past its recompile limit, say): said once, on rank 0
        if not warned and (not ran_graph or (frame is not None and eager_calls(frame) > eager)):
            warned.append(True)
            if _rank0():
                logger.warning("%s", eager_advice(f"the compiled decode step of {name}", frame))
        # A replayed CUDA graph runs no Python: its collectives, noted while the step traced, are counted here.
        step = describe_step(kwargs, getattr(model, "dtype", None))
        if compiled_graphs() != before and traced:
            collectives[step] = traced
        report_collectives(collectives.get(step, ()))
        if compiled_graphs() != before and _rank0():
            log_compiled(logger, name, step, time.perf_counter() - began, compile_config.to_dict())
        return out

    return call


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its `unique_graphs` counter; 0 where torch lacks it)."""
    counters = getattr(getattr(torch._dynamo, "utils", None), "counters", None)
    return int(counters["stats"]["unique_graphs"]) if counters is not None else 0


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
