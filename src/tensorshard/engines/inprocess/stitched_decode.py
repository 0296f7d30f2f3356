"""When the fast decoding path runs one stitched graph for all shards, each shard's graph at the same time as the
others', or one `torch.compile` per shard.

CompiledSteps (compiled_steps.py) hands each kind of call (`_kind`: shapes, dtypes, cache lengths) to a `Stitcher`
first, on CPU slots, with inductor (the default backend and mode):

1. the first two calls of a kind run the shards as today (one thread each, one at a time), each shard's forward
   under a `torch.compile` whose backend only keeps dynamo's graph (`Capture`: the graph, where each of its inputs
   comes from, which output is which field) and runs it as it is;
2. the second call must add no graph: dynamo recompiling there means the step depends on Python state that changes
   per token (a sliding-window cache layer), which one fixed graph cannot follow;
3. then, by the weights a shard reads between two of its collectives (`weight_bytes_per_segment`):
   - from `PARALLEL_BYTES` on (`parallel_bytes()`: 8 times it without the native collectives), each shard's graph
     is compiled on its own with native collectives (C++ wrapper) and every later token runs them on the shards'
     threads at the same time (parallel_step.py): each core reads its share of the weights, as tensor
     parallelism promises;
   - below it, the shards' graphs are stitched into one (stitched_step.py), compiled once with inductor, and every
     later token runs it from the caller's thread: no thread, no hand-off, no dynamo frame evaluation per shard
     (a step that computes little between two collectives would spend more in the hand-offs than it saves).

On Linux the first call of a kind that finds no kept captures (below) runs neither 1 nor 2 here: every shard's call
is traced at the same time, each in a forked child that keeps dynamo's graph, checks that a second call adds none,
and sends its capture back (forked_traces.py); the step is built from those as from kept captures. A child that
fails leaves the kind to 1 and 2.

Once a kind's step is compiled, the shards' captures are kept on disk (engines/capture_store.py, kept_captures.py):
a later process, or a later split model of the same shape, finds them at the first call of that kind and builds
its step from them without running 1 and 2 (no trace); captures that do not fit are dropped and traced again.

Whatever stops this (a graph break, graphs that differ, an input that cannot be found again, inductor failing on
the stitched graph) is logged once at INFO with the reason, and that kind runs the per-shard compiled path from
then on. A stitched graph skips dynamo's guards; what they would have caught is checked here instead: the kind of
call and its plain arguments (`call_settings`: flags such as ``output_hidden_states`` make another kind), no
gradient, the model in eval mode, every input's dtype (stitched_step.py), and no module, weight or buffer
registered on a split model since the stitch (registrations.py; weights changed in place, or replaced, are read
afresh on every call). Callers in several threads capture one at a time. A parallel step whose shard failed is
dropped (its native group is aborted with it).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any, Callable, Hashable

import torch
from torch import nn
from torch._guards import TracingContext

from ...comm.native import ops as native
from ...logs import get_logger
from ...registrations import registrations
from ..aliasing_guards import aliasing_guards_in_cpp
from ..cheap_tracing import cheap_tracing
from ..graph_inputs import NotLocated, locate_inputs, output_fields
from ..inductor_cache import CacheUse
from ..own_code import own_function
from .. import capture_store, cpu_probe
from . import forked_traces, kept_captures
from .boundary import to_device
from .parallel_step import ParallelStep
from .shard_calls import ShardCalls
from .stitched_step import Capture, StitchError, StitchedStep, segments, stitch

logger = get_logger(__name__)

_CAPTURE_CALLS = 2  # calls of a kind run per shard before stitching: one to capture, one to see nothing recompile
# Weights a shard reads between two collectives (its parameters' bytes over its step's segments) from which its
# compiled graph runs on its own thread at the same time as the others' instead of being stitched: a stitched graph
# does every shard's arithmetic on one core, the parallel one pays a meeting of the threads per collective. With
# the native collectives (C++ graphs, no GIL inside): below the small Llama of BENCHMARKS.md section 5 (0.7 MiB
# per segment at 2 devices), whose parallel step was faster than the stitched one in every round (3.3 against 3.6
# ms per token at load 4-6 on 2 cores, docs/generation.md); the tiny test models (a few KiB) stay stitched. Without them (Python collectives, which take the GIL) 8 times as much: SmolLM2-135M's shape (4.3
# MiB) runs in parallel, the small Llama stitched (faster there with Python collectives).
PARALLEL_BYTES = 256 << 10
# torch 2.10's dynamo breaks a shard's decode step into several graphs where 2.13 makes one (seen at the floors,
# docs/versions.md), so nothing would stitch there: older torch keeps one compiled graph per shard from the start.
STITCHES = torch.__version__ >= "2.13"


def parallel_bytes() -> int:
    """The bound in force: `PARALLEL_BYTES` with the native collectives, 8 times it with the Python ones."""
    return PARALLEL_BYTES if native.available() else 8 * PARALLEL_BYTES


class Stitcher:
    """The stitched decode steps of one split model (a TensorParallel on CPU slots), one per kind of call."""

    def __init__(self, model: nn.Module, options: dict[str, Any], calls: ShardCalls) -> None:
        self.model = model
        self.world = len(model.module_shards)
        self.own, self.back = calls.own, calls.back  # (shard_calls.py; bound once: `own` runs per input per shard)
        self.config_patches = options.get("options") or {}
        self.options = options
        self._trace = {k: v for k, v in options.items() if k in ("fullgraph", "dynamic")}
        # per kind being captured, each shard's call under a torch.compile that keeps dynamo's graph (`_tracers`)
        self._tracing: dict[Hashable, list[Callable[..., Any]]] = {}
        self.steps: dict[Hashable, StitchedStep] = {}
        self.refused: set[Hashable] = set()
        self.parallel: dict[Hashable, int] = {}  # kinds run by a ParallelStep: weight bytes per segment
        self._retired: list[ParallelStep] = []  # parallel steps dropped (their native groups stay allocated)
        self._calls: dict[Hashable, int] = {}
        self._captures: dict[Hashable, dict[int, list[Capture]]] = {}
        self._now: tuple[Hashable, dict[int, dict]] | None = None  # the kind being captured, each rank's arguments
        self._traced: dict[Hashable, set[str]] = {}  # per kind being captured: the source files dynamo traced
        self._to_keep: dict[Hashable, tuple[str, list[Capture], set[str]]] = {}  # kept on disk once compiled
        self._names: dict[Hashable, str | None] = {}  # each kind's entry in the store, named before its first call
        self._capture_lock = threading.Lock()
        self.spans: dict[Hashable, list[tuple[float, float]]] = {}  # kinds traced in forked children: (start, end)

    @staticmethod
    def applies(model: nn.Module, options: dict[str, Any]) -> bool:
        """Stitch at all? torch 2.13 or later, CPU slots only, several of them, inductor in its default mode."""
        cpu = all(torch.device(d).type == "cpu" for d in model.devices)
        backend = options.get("backend", "inductor")
        return STITCHES and cpu and len(model.devices) > 1 and backend in ("inductor", None) and options.get("mode") is None

    def handles(self, kind: Hashable, kwargs: dict) -> bool:
        """Whether this call goes through the stitcher (capturing or stitched)."""
        if kind in self.refused or torch.is_grad_enabled() or self.model.training or "labels" in kwargs:
            return False
        step = self.steps.get(kind)
        if step is not None and step.registrations != registrations():
            self._refuse(kind, "a module, weight or buffer was registered on a split model since the step was stitched")
            return False
        return True

    def __call__(self, kind: Hashable, kwargs: dict) -> Any:
        """One call of the split model: stitched, or (the first calls of a kind) per shard, capturing."""
        step = self.steps.get(kind)
        if step is not None:
            out = self._stitched(kind, step, kwargs)
            if out is not None:
                return self.back(out, kwargs)
        elif self._calls.get(kind, 0) < _CAPTURE_CALLS:
            return self._capturing(kind, kwargs)
        return None  # the per-shard compiled path runs this call

    # -- the first call of a kind whose captures a previous process kept (capture_store.py) ----------------------

    def _from_store(self, kind: Hashable, kwargs: dict) -> Any:
        """The call run by the step built from kept captures, without tracing; None where there are none (or they
        fail to build, compile or check: they are dropped, and the kind is captured as if there had been none)."""
        model = self.model
        name = self._names[kind] = (
            capture_store.key([kind, self.options, [str(d) for d in model.devices], str(model.output_device)],
                              model.module_shards) if capture_store.enabled() else None)
        payload = capture_store.load(name) if name is not None else None
        if payload is None:
            return None
        started = time.perf_counter()
        out, why = self._from_payload(kind, kwargs, payload)
        if why is not None:  # captured as if there had been none, the entry replaced
            logger.info("the decode graphs kept on disk for this kind of call were not used (%s); tracing them", why)
            capture_store.discard(name)
            return None
        logger.info("%s's decode step was built from the shards' graphs kept on disk (%s), without tracing: first "
                    "call in %.1f s", type(self.model).__name__, capture_store.folder(), time.perf_counter() - started)
        return out

    def _from_children(self, kind: Hashable, kwargs: dict) -> Any:
        """The call run by the step built from every shard's trace made at the same time, each in a forked child
        (forked_traces.py); None where that does not apply or fails (the kind is then captured here)."""
        if not forked_traces.applies(self.model):
            return None
        started = time.perf_counter()
        per_rank = [{k: self.own(v, rank) for k, v in kwargs.items()} for rank in range(self.world)]
        try:
            traced = forked_traces.trace(self.model, per_rank, lambda: self._cheap_tracing(lock=False), self._trace,
                                         meanwhile=cpu_probe.probe)
        except (forked_traces.TraceFailed, OSError) as error:
            logger.info("the shards' decode steps could not be traced in forked processes (%s); tracing them here, "
                        "one after the other", error)
            return None
        self.spans[kind] = traced.spans
        name = self._names.get(kind)
        out, why = self._from_payload(kind, kwargs, traced.payload, keep=(name, traced.files) if name else None)
        if why is not None:
            logger.info("the decode graphs traced in forked processes were not used (%s); tracing them here", why)
            return None
        logger.info("%s's decode step was built from its %d shards' graphs, traced at the same time in forked "
                    "processes: first call in %.1f s", type(self.model).__name__, self.world, time.perf_counter() - started)
        return out

    def _from_payload(self, kind: Hashable, kwargs: dict, payload: list[dict],
                      keep: tuple[str, set[str]] | None = None) -> tuple[Any, str | None]:
        """The call run by the step built from `payload` (kept_captures.py's form), and None; or None and why it
        could not be used (then nothing of it stays). `keep`: the store's entry name and traced files, to keep the
        captures on disk once the step compiled."""
        try:
            captures = kept_captures.restored(self.model, payload)
            self._build(kind, captures)
        except Exception as error:  # graphs that do not fit this model after all (nothing ran)
            why = f"{type(error).__name__}: {error}"
        else:
            self._calls[kind] = _CAPTURE_CALLS
            if keep is not None:
                self._to_keep[kind] = (keep[0], captures, keep[1])
            out = self._stitched(kind, self.steps[kind], kwargs)  # (a shard failing in it raises, as it would later)
            why = None if out is not None else "the step built from them was refused (logged above)"
        if why is None:
            return out, None
        self.steps.pop(kind, None)
        self.refused.discard(kind)
        self._calls.pop(kind, None)
        self._to_keep.pop(kind, None)
        return None, why

    def _cheap_tracing(self, *, lock: bool = True) -> contextlib.AbstractContextManager:
        """While dynamo traces a shard's call: what makes its trace cheaper without changing its graph
        (engines/cheap_tracing.py, aliasing_guards.py), holding the model's call lock (`lock`: a forked child,
        alone in its process, takes none)."""
        stack = contextlib.ExitStack()
        stack.enter_context(aliasing_guards_in_cpp())
        stack.enter_context(cheap_tracing(self.model.module_shards, self.model.call_lock if lock else None))
        return stack

    # -- the first calls of a kind: the per-shard path, capturing ------------------------------------------------

    def _capturing(self, kind: Hashable, kwargs: dict) -> Any:
        with self._capture_lock:  # (`_now` is the one call being captured: callers in other threads wait)
            if self._calls.get(kind, 0) == 0 and kind not in self.steps:
                out = self._from_store(kind, kwargs)
                if out is None:
                    out = self._from_children(kind, kwargs)
                if out is not None:
                    return self.back(out, kwargs)
            return self._capture(kind, kwargs)

    def _capture(self, kind: Hashable, kwargs: dict) -> Any:
        own: dict[int, dict] = {}
        self._now = (kind, own)
        tracers = self._tracers(kind)

        def run(rank: int, args: tuple, shard_kwargs: dict) -> Any:
            own[rank] = {k: self.own(v, rank) for k, v in shard_kwargs.items()}
            out = tracers[rank](**own[rank])
            for capture in self._captures.get(kind, {}).get(rank, [])[:1]:
                if capture.output_type is None:
                    try:
                        capture.fields, capture.output_type = output_fields(out, capture.last_outputs, own[rank]), type(out)
                    except NotLocated as error:
                        self._refuse(kind, f"shard {rank}: {error}")
            return self.back(out, shard_kwargs)

        try:
            with torch._dynamo.config.patch(suppress_errors=True), self._cheap_tracing():
                out = self.model.run_modules((), kwargs, run, serial=True)
        finally:
            self._now = None
        calls = self._calls[kind] = self._calls.get(kind, 0) + 1
        if kind in self.refused:
            return out
        captures = self._captures.get(kind, {})
        try:
            self._one_graph_each(captures)
            if calls == _CAPTURE_CALLS:
                ranks = [captures[r][0] for r in range(self.world)]
                self._build(kind, ranks)
                del self._captures[kind]
                self._tracing.pop(kind, None)  # (traced: its dynamo cache goes with its functions, own_code.py)
                files = self._traced.pop(kind, set())
                name = self._names.get(kind)
                if name is not None and files:
                    self._to_keep[kind] = (name, ranks, files)
        except StitchError as error:
            self._refuse(kind, str(error))
        except Exception as error:  # a graph this code did not foresee: the per-shard path still decodes it
            self._refuse(kind, f"stitching failed ({type(error).__name__}: {error})")
        return out

    def _build(self, kind: Hashable, ranks: list[Capture]) -> None:
        """The kind's step from each shard's capture: parallel or stitched, by the weights read per segment."""
        per_segment = weight_bytes_per_segment(self.model, {r: [c] for r, c in enumerate(ranks)})
        if per_segment >= parallel_bytes():
            self.steps[kind] = ParallelStep(ranks, len(ranks), self.model.timeout, self.model.labels)
            self.parallel[kind] = per_segment
        else:
            src = next((r for r, d in enumerate(self.model.devices) if d == self.model.output_device), 0)
            self.steps[kind] = stitch(ranks, self.model.devices, src)
        self.steps[kind].registrations = registrations()

    def _one_graph_each(self, captures: dict[int, list[Capture]]) -> None:
        for rank in range(self.world):
            got = len(captures.get(rank, []))
            if got != 1:
                raise StitchError(f"shard {rank}'s step compiled into {got} graphs (one, without graph breaks, is needed)")
            if captures[rank][0].output_type is None:
                raise StitchError(f"shard {rank}'s output could not be matched with its graph's outputs")

    def _tracers(self, kind: Hashable) -> list[Callable[..., Any]]:
        """Each shard's call for capturing `kind`: a function of its own per kind and shard (engines/own_code.py), so
        that dynamo's recompile limit counts one kind's graphs, not every kind's of this model (its 9th cache length
        would run eagerly, and never be stitched); dropped, with dynamo's cache for it, once the kind is built or
        refused."""
        if kind not in self._tracing:
            self._tracing[kind] = [
                torch.compile(own_function(shard, f"shard{rank}_capture_{id(shard):x}"), backend=_KeepGraph(self, rank),
                              **self._trace)
                for rank, shard in enumerate(self.model.module_shards)
            ]
        return self._tracing[kind]

    def _keep(self, rank: int, gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        """The capturing backend's work for shard `rank` (`_KeepGraph`): note dynamo's graph, run it as it is."""
        if self._now is None:  # a recompile outside the capturing calls: nothing to stitch
            return gm.forward
        kind, own = self._now
        if kind in self.refused:
            return gm.forward
        kept = self._captures.setdefault(kind, {}).setdefault(rank, [])
        why = None
        if self._calls.get(kind, 0) > 0:
            why = "dynamo compiled again at the second call: the step depends on Python state that changes per token"
        elif kept:
            why = f"shard {rank}'s step compiled into {len(kept) + 1} graphs (a graph break; one graph is needed)"
        else:
            try:
                capture = Capture(gm, locate_inputs(self.model.module_shards[rank], own[rank], example_inputs, _input_names(gm)))
            except NotLocated as error:
                why = f"shard {rank}: {error}"
        if why is not None:
            self._refuse(kind, why)
            return gm.forward
        kept.append(capture)
        self._traced.setdefault(kind, set()).update(capture_store.traced_files(TracingContext.get_traced_code() or ()))

        def run(*inputs: Any) -> Any:
            capture.last_outputs = gm(*inputs)
            return capture.last_outputs

        return run

    # -- later calls: the stitched graph -------------------------------------------------------------------------

    def _stitched(self, kind: Hashable, step: StitchedStep | ParallelStep, kwargs: dict) -> Any:
        # (No late adapters to adopt, as the engine's call does first: anything registered since the stitch has
        # already dropped this step, `handles`, and the per-shard path adopts it.)
        per_rank = [{k: self.own(v, rank) for k, v in kwargs.items()} for rank in range(self.world)]
        if isinstance(step, ParallelStep):
            return self._parallel(kind, step, kwargs, per_rank)
        with self.model.call_lock:
            if step.compiled is None and not self._compile(kind, step, per_rank):
                return None
            try:
                out = step(per_rank)
            except StitchError as error:  # raised before the graph ran: the per-shard path takes this call
                self._refuse(kind, str(error))
                return None
        return to_device(out, self.model.output_device)

    def _parallel(self, kind: Hashable, step: ParallelStep, kwargs: dict, per_rank: list[dict]) -> Any:
        """Every shard's own compiled graph, each on its thread at the same time (parallel_step.py)."""
        with self.model.call_lock:
            if step.compiled is None and not self._compile(kind, step, per_rank):
                return None

        model = self.model
        if step.threads is not None and not model.debug and model.devices[0] == model.output_device and not model.running_here():
            return self._on_step_threads(kind, step, kwargs, per_rank)
        try:
            step.check(per_rank)
        except StitchError as error:  # raised before the graphs ran: the per-shard path takes this call
            self._refuse(kind, str(error))
            return None

        def run(rank: int, args: tuple, shard_kwargs: dict) -> Any:
            try:
                return self.back(step.run(rank, {k: self.own(v, rank) for k, v in shard_kwargs.items()}), shard_kwargs)
            except BaseException as error:  # the other shards may be waiting for this one in a native collective
                step.abort(rank, error)
                raise

        try:
            return self.model.run_modules((), kwargs, run, serial=False)
        except BaseException:
            # A shard failed (its native group is aborted: it cannot serve another call): later calls of this kind
            # run per shard under torch.compile.
            self._refuse(kind, "a shard's step failed in the parallel step")
            raise

    def _on_step_threads(self, kind: Hashable, step: ParallelStep, kwargs: dict, per_rank: list[dict]) -> Any:
        """The shards' graphs on the step's own threads (step_threads.py): every collective is native, so nothing
        of the engine's call is needed per token (the inputs are each rank's own already, the graphs call no Python
        collective; `debug`'s comparison of the ranks' outputs, and a call from inside a shard, take the engine's
        call). On CPU slots every rank's output is on the output device: rank 0's is returned."""
        inputs = [step.inputs(rank, own) for rank, own in enumerate(per_rank)]
        try:
            step.check_inputs(inputs)
        except StitchError as error:  # raised before the graphs ran: the per-shard path takes this call
            self._refuse(kind, str(error))
            return None

        def work(rank: int) -> Any:
            outs = step.graph(rank, inputs[rank])
            if rank == 0:  # (made while the other ranks' threads leave their graphs; on the output device already)
                return self.back(step.output(0, outs, per_rank[0]), kwargs)
            return None

        try:
            with self.model.call_lock:  # (callers in other threads take turns, as in the engine's call)
                return step.threads.run(work, abort=step.abort, timeout=self.model.timeout + 5.0)
        except BaseException:
            self._refuse(kind, "a shard's step failed in the parallel step")
            raise

    def _compile(self, kind: Hashable, step: StitchedStep | ParallelStep, per_rank: list[dict]) -> bool:
        """Compile the stitched graph, or each shard's (before it runs: a failure leaves every cache as it was),
        logged."""
        started, cache = time.perf_counter(), CacheUse()
        what = "the shards' graphs" if isinstance(step, ParallelStep) else "the stitched graph"
        try:
            step.compile(per_rank, config_patches=self.config_patches)
        except Exception as error:  # inductor failing on the graph: the per-shard path still works
            self._refuse(kind, f"inductor failed on {what} ({type(error).__name__}: {error})")
            return False
        if isinstance(step, ParallelStep):
            logger.info(
                "compiled the decode steps of %s's %d shards in %.1f s (%s wrapper; %d of them sharing another's "
                "graph; %s); every later token runs each shard's graph on its own thread at the same time as the "
                "others' (%.1f MiB of weights per shard between two collectives; stitched into one graph below "
                "%.1f MiB), with %s collectives",
                type(self.model).__name__, self.world, time.perf_counter() - started,
                "C++" if step.cpp_wrapper else "Python", step.shared, cache.since(),
                self.parallel.get(kind, 0) / 2**20, parallel_bytes() / 2**20, "native" if step.native else "Python",
            )
        else:
            logger.info(
                "stitched the decode steps of %s's %d shards into one graph and compiled it in %.1f s "
                "(%s; every later token runs it from the calling thread)",
                type(self.model).__name__, self.world, time.perf_counter() - started, cache.since(),
            )
        kept = self._to_keep.pop(kind, None)
        if kept is not None:  # (compiled: a later process builds this step from them without tracing)
            name, captures, files = kept
            try:
                payload = kept_captures.portable(self.model, captures)
            except (TypeError, ValueError, KeyError) as error:
                logger.debug("the decode graphs are not kept on disk: %s", error)
            else:
                capture_store.save(name, payload, files)
        return True

    def _refuse(self, kind: Hashable, why: str) -> None:
        if kind not in self.refused:
            logger.info("decoding %s with one compiled graph per shard, not one stitched graph: %s", type(self.model).__name__, why)
        self.refused.add(kind)
        step = self.steps.pop(kind, None)
        if isinstance(step, ParallelStep):
            # Kept, not closed: a shard of a failed call may still be leaving a native collective (the engine's
            # call returns within a grace period), and closing frees the region it reads. Its own threads (every one
            # back from its call, or abandoned) are stopped.
            self._retired.append(step)
            if step.threads is not None:
                step.threads.close()
        self._captures.pop(kind, None)
        self._traced.pop(kind, None)
        self._to_keep.pop(kind, None)
        self._tracing.pop(kind, None)


class _KeepGraph:
    """The backend of a capturing `torch.compile` (`Stitcher._tracers`). It holds its stitcher weakly: torch keeps
    every backend it was given for the rest of the process (`torch._dynamo.reset` resets them), and one holding the
    stitcher would keep the split model and its weights alive after the user let go of them."""

    def __init__(self, stitcher: Stitcher, rank: int) -> None:
        self.stitcher, self.rank = weakref.ref(stitcher), rank

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        stitcher = self.stitcher()
        return gm.forward if stitcher is None else stitcher._keep(self.rank, gm, example_inputs)


def weight_bytes_per_segment(model: nn.Module, captures: dict[int, list[Capture]]) -> int:
    """The most bytes of weights any shard reads between two of its step's collectives, on average: its parameters
    and buffers over its graph's segments (collectives + 1)."""
    most = 0
    for rank, shard in enumerate(model.module_shards):
        tensors = {id(t): t for t in list(shard.parameters()) + list(shard.buffers())}
        collectives = sum(end is not None for _, end in segments(captures[rank][0].graph))
        most = max(most, sum(t.numel() * t.element_size() for t in tensors.values()) // (collectives + 1))
    return most


def call_settings(leaves: list, spec: Any) -> Hashable:
    """What a stitched graph is specialised on besides the kind of call (compiled_steps.py's `_kind`: tensors and
    caches): the call's plain values by value (`use_cache`, `output_attentions`, `logits_to_keep`), any other
    object by its type, and the arguments' structure. Dynamo's guards would recompile when one of these changes;
    a stitched graph has no guards, so a change makes another kind of call, captured and stitched anew.
    `leaves` and `spec`: the call's arguments as `tree_flatten` gives them (flattened once per call, by the caller).
    CPU autocast is part of it too: a call under ``torch.autocast("cpu", ...)`` is its own kind (its static cache
    is allocated in the autocast dtype, which would otherwise drop the float32 kind's stitched step for good)."""
    plain = (bool, int, float, str, type(None))
    autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    return str(spec), tuple(x if isinstance(x, plain) else type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)), autocast


def _input_names(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's inputs as dynamo named them (after where it found them: `l_kwargs_cache_layers_0_keys`)."""
    return [node.name for node in gm.graph.find_nodes(op="placeholder")]
