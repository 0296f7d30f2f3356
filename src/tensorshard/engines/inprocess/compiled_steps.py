"""Each shard's forward compiled once and replayed per call: the fast decoding path of the in-process engine.

Decoding a token is mostly Python and operator dispatch (a small Llama on CPU: 11 ms per token eagerly, 6 ms
compiled), and every shard of a split model runs the model's whole Python, one thread at a time under the GIL,
so N shards cost about N times the unsplit model's token. A compiled shard runs no model Python per token: the
forward is one graph of generated kernels whose only calls back into Python are the collectives, kept inside
the graph as operators (comm/thread_ops.py).

    steps = CompiledSteps(split, options={"dynamic": False})
    out = steps(input_ids=..., past_key_values=cache, ...)    # the split model's call, each shard compiled

What happens per call:
- the inputs are copied to every device as in any call (boundary.py); an object the engine gives each shard its
  own copy of (a KV cache) is handed over as that shard's own object, so the compiled code sees a plain
  transformers cache, not the dispatcher over all of them (what the model integration says, shard_calls.py);
- the first call of a kind (a new batch size, cache length or dtype: `_kind`) compiles every shard, one shard at
  a time (the baton passes at every collective: schedule.py's serial way), since `torch.compile` is not
  thread-safe; each shard compiles its own graphs, under a code object of its own (`_entry`);
- later calls run the shards at the same time or one at a time, as the call schedule measures faster
  (schedule.py): compiled code that does little between two collectives makes two threads hand the GIL back and
  forth at every kernel (a small Llama on 2 cores: a third of the speed of one thread after the other), while one
  that streams many weights between them overlaps; `run_shards_together()` fixes the first way;
- a graph torch.compile fails to make runs that part eagerly (the same numbers, slower), unless `fullgraph`.

On CPU slots (inductor, its default mode) a kind of call seen twice is handed on to stitched_decode.py, which
builds from the shards' captured graphs either one stitched graph run from the calling thread (a step that reads
few weights between two collectives) or each shard's graph compiled on its own with native collectives, run on
its own thread at the same time as the others (parallel_step.py); this per-shard path is what remains where
neither can be built (a graph break, a step that recompiles per token).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable

import torch
from torch import nn
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten

from ...comm import thread_ops
from ...logs import get_logger
from ..aliasing_guards import aliasing_guards_in_cpp
from ..decode_decision import WrapperSettings, describe_step, log_compiled
from ..own_code import eager_advice, eager_calls, own_function
from .shard_calls import ShardCalls
from .stitched_decode import Stitcher, call_settings

logger = get_logger(__name__)


class CompiledSteps:
    """The shards of `model` (a TensorParallel), each behind its own `torch.compile`.

    Args:
        model: the split model.
        options: `torch.compile` keyword arguments (fullgraph, dynamic, backend, mode, options).
        calls: how a call becomes each shard's and a shard's output the caller's (shard_calls.py): the call's
            arguments by name, each shard's own copy of a per-device object (its KV cache), the caller's object
            back in the output. Default: everything as given (positional arguments stay positional, never stitched);
            the transformers integration passes its own (integrations/transformers/fast_decode.py).
        stitch: on CPU slots, run every shard's step as one stitched graph from the calling thread once a kind of
            call was seen twice (stitched_decode.py); False keeps one compiled graph per shard.
    """

    def __init__(
        self,
        model: nn.Module,
        options: dict[str, Any],
        *,
        calls: ShardCalls | None = None,
        stitch: bool = True,
    ) -> None:
        if calls is not None and not isinstance(calls, ShardCalls):
            raise TypeError(
                f"calls must be a ShardCalls (engines/inprocess/shard_calls.py), or None for the default; got "
                f"{type(calls).__name__}"
            )
        self.model = model
        self.options = dict(options)
        self.calls = calls if calls is not None else ShardCalls()
        self.own, self.back = self.calls.own, self.calls.back  # (bound once: `own` runs per argument per shard)
        self.entries = [_entry(shard, rank) for rank, shard in enumerate(model.module_shards)]
        self.compiled = [torch.compile(entry, **self.options) for entry in self.entries]
        self.warned = False  # (said once that a shard's step ran eagerly: `_check_eager`)
        self.kinds: set[Hashable] = set()  # kinds of call compiled so far
        self.together = False  # later calls always run the shards at the same time (`run_shards_together`)
        # a stitched step has no guards: an adapter switched or disabled makes another kind (every shard alike)
        self.settings = WrapperSettings(model.module_shards[0])
        self.stitcher = (
            Stitcher(model, self.options, self.calls)
            if stitch and Stitcher.applies(model, self.options) else None
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the graphs' collectives keep their constant names, which the stitcher rewrites (comm/thread_ops.py)
        thread_ops.decode_steps.compiling = True
        try:
            return self._call(*args, **kwargs)
        finally:
            thread_ops.decode_steps.compiling = False

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        world = len(self.compiled)
        named = self.calls.keywords(args, kwargs)
        if named is not None:
            args, kwargs = (), named
        kind, settings = _call_kind(args, kwargs)
        stitcher = self.stitcher if named is not None else None  # (a stitched step finds its inputs by name)
        stitch_kind = (kind, settings, self.settings()) if stitcher is not None else None
        if stitcher is not None and stitcher.handles(stitch_kind, kwargs):
            out = stitcher(stitch_kind, kwargs)
            if out is not None:
                return out
        first = kind not in self.kinds
        started = time.perf_counter()
        # A first call compiles, one shard at a time; later calls run the shards at the same time
        # (`run_shards_together`), else as the call schedule measures faster (schedule.py: a step that computes
        # little between two collectives makes the threads hand the GIL back and forth; one at a time is faster).
        serial = True if first else (False if self.together else None)
        # A graph torch.compile fails to make (an internal error at a recompile) runs that frame eagerly, as a
        # failure to compile does without graph breaks allowed: the numbers are the same, only slower. A compile
        # builds its object-aliasing guards in C++ (aliasing_guards.py: each style wrapper holds its module and comm).
        fullgraph = self.options.get("fullgraph", False)
        with torch._dynamo.config.patch(suppress_errors=not fullgraph), aliasing_guards_in_cpp():
            eager = None if self.warned else [eager_calls(entry) for entry in self.entries]
            out = self.model.run_modules(args, kwargs, self._run, serial=serial)
        if eager is not None:
            self._check_eager(eager)
        if first:
            self.kinds.add(kind)
            log_compiled(logger, type(self.model).__name__, describe_step(kwargs, getattr(self.model, "dtype", None)),
                         time.perf_counter() - started, self.options, devices=world)
        return out

    def _check_eager(self, before: list[int]) -> None:
        """Say once (WARNING) that a shard's step ran eagerly in this call (`before`: each shard's count of such calls
        before it), silently slower: past dynamo's recompile limit, or a compile that failed. Each split model's steps
        have code of their own (`_entry`), so only this model's own recompiles reach the limit (a step that
        recompiles per token, a compile per cache length)."""
        ranks = [rank for rank, (entry, was) in enumerate(zip(self.entries, before)) if eager_calls(entry) > was]
        if ranks:
            self.warned = True
            what = f"the compiled decode step of {type(self.model).__name__} (shard{'s' if len(ranks) > 1 else ''} " \
                   f"{', '.join(map(str, ranks))})"
            logger.warning("%s", eager_advice(what, self.entries[ranks[0]]))

    def keep_one_graph_per_shard(self) -> None:
        """Never stitch: every call runs each shard's own compiled graph in its thread (to compare, or to debug)."""
        self.stitcher = None

    def run_shards_together(self) -> None:
        """Never stitch, and run every shard's compiled graph on its own thread at the same time as the others on
        every call after the first (not as the call schedule measures): to compare, or where the weights per
        collective are too few for the default's choice (stitched_decode.py's `PARALLEL_BYTES`)."""
        self.stitcher = None
        self.together = True

    def _run(self, rank: int, args: tuple, kwargs: dict) -> Any:
        args = tuple(self.own(a, rank) for a in args)
        own = {k: self.own(v, rank) for k, v in kwargs.items()}
        return self.back(self.compiled[rank](*args, **own), kwargs)


def _entry(shard: nn.Module, rank: int) -> Callable[..., Any]:
    """`shard(...)` as a function with a code object of its own (engines/own_code.py). torch.compile keeps its graphs,
    guards and recompile limit per code object: compiled as it is, every shard of every split model of the process
    would share the code of the model's (or the engine wrapper's) forward, and so one recompile limit, each shard's
    graph tried against the others' guards first. Its graphs die with it (dynamo's cache for it is cleared)."""
    return own_function(shard, f"shard{rank}_step_{id(shard):x}")


_PLAIN = (bool, int, float, str, type(None))


def _call_kind(args: tuple, kwargs: dict) -> tuple[Hashable, Hashable]:
    """The call's kind (`_kind`) and what a stitched step is specialised on besides (stitched_decode.py's
    `call_settings`), read in one pass over the keyword arguments where each is a leaf of the call's tree (a tensor,
    a plain value, a cache or another object: a decode step's arguments), else through `tree_flatten`. Either way
    two calls get the same pair exactly when their arguments' names, structure, tensor shapes and dtypes, caches'
    kinds and lengths and plain values are the same. Per token (a small Llama's: input ids, positions, mask, cache
    and three flags): ~7 us against ~24 for the flattened way."""
    if not args:
        kind, settings = [], []
        for name, x in kwargs.items():
            if isinstance(x, torch.Tensor):
                kind.append((name, x.shape, x.dtype))
            elif isinstance(x, _PLAIN):  # (by value, as `call_settings`: an IntEnum's members differ)
                settings.append((name, type(x), x))
            elif isinstance(x, tuple) or type(x) in SUPPORTED_NODES:  # a container: its leaves count
                break
            else:
                if hasattr(x, "layers"):
                    kind.append((name, _cache_lengths(x)))
                settings.append((name, type(x).__name__))
        else:
            autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
            return tuple(kind), (tuple(settings), autocast)
    leaves, spec = tree_flatten((args, kwargs))
    return _kind(leaves), call_settings(leaves, spec)


def _kind(leaves: list) -> Hashable:
    """What a compiled graph is specialised on, as far as the inputs tell: each tensor's shape and dtype, and the
    length of a static KV cache (its tensors' shapes)."""
    return tuple(
        (tuple(x.shape), str(x.dtype).removeprefix("torch.")) if isinstance(x, torch.Tensor) else _cache_lengths(x)
        for x in leaves if isinstance(x, torch.Tensor) or hasattr(x, "layers")
    )


def _cache_lengths(cache: Any) -> tuple:
    """A transformers cache's kind and each layer's fixed length (a static layer's `max_cache_len`; None for others)."""
    return type(cache).__name__, tuple(getattr(layer, "max_cache_len", None) for layer in getattr(cache, "layers", ()))
