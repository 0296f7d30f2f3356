"""Later tokens of the compiled decode step under torchrun call the compiled graph itself: no dynamo frame, no
guards, no generated code gathering the graph's inputs, no local views put in place per call.

    direct = DirectSteps(model, state)                  # one per generating model (decoding.py)
    config = direct.capturing(compile_config)           # what transformers compiles with: each graph noted
    with direct.watching() as seen:                     # a call run by dynamo, every guard evaluated ...
        out = compiled(*args, **kwargs)
    direct.learn(key, seen, args, kwargs, out)          # ... that compiled nothing: its graph and inputs learnt
    out = direct.run(key, args, kwargs)                 # a later call of that kind: the graph alone (None: not ready)
    if direct.may_keep(key):                            # the first call of a kind, in a later process ...
        out = direct.from_store(key, kind, args, kwargs)  # ... its step built from what `learn` kept (kept_step.py)

Per token, a compiled step that dynamo runs pays, on each rank, dynamo's frame and its differentiating guards
(engines/torchrun/unguarded.py), the local views put in place and taken out again (local_views.py: ~270 tensors
for SmolLM2's shape at 2 ranks), and the generated code that gathers the graph's ~370 inputs one attribute chain
at a time. The in-process engine calls its shards' graphs directly (engines/inprocess/stitched_step.py); this is
the same for the one graph of a torchrun rank:

1. transformers' `torch.compile` gets a backend of ours (`capturing`): the backend the compile config asks for
   (inductor with its mode and options, as torch.compile would build it) compiles each graph as before, and each
   compiled graph is wrapped to note its inputs and outputs while a call is watched;
2. a call of a kind (unguarded.py's key) run with every guard that compiled nothing and ran exactly one graph is
   the proof of which graph serves that kind: each graph input is found again by identity (a weight's local view,
   named by its module's table and its DTensor's layout; a tensor argument; a tensor of a cache layer), and each
   field of the output is a graph output or an argument (the cache), as the in-process engine finds its shards'
   (engines/graph_inputs.py); anything else and the kind stays with dynamo (logged at DEBUG);
3. later calls of that kind, where unguarded.py would skip the guards, run the graph with the inputs read afresh:
   each weight's local view is kept from one call to the next while its DTensor and its local tensor are the
   same objects (a weight replaced, or its local tensor, makes a new view), every input's dtype is checked
   against the graph's (inductor's code checks sizes and strides, not dtypes), and the output is built as
   dynamo's code built it.

What dynamo's guards and code did beyond that is ours to keep: the kind of call, gradients, eval mode,
registrations and adapter settings are unguarded.py's checks (a change makes another key: dynamo runs it, with
every guard, and it is learnt again; the steps learnt before a registration are dropped); a module training makes
no direct call. Dynamo's code also replays the Python side effects of the traced step after its graph: read from
dynamo while it compiles the graph, attributes of existing objects set to constants are replayed by the direct
call too (a decode step sets three: transformers' output-capturing context reset, `comm.end_traced_call`'s reset);
a graph with any other side effect stays with dynamo. An int input (dynamic shapes) is read from the tensor input
dynamo read it from (a size, stride or offset).
The collectives are the graph's own operators: `tp.count_collectives()` counts them as before. Where inductor
compiled the graph and it calls only aten, prims and the native collectives, the learnt step builds it again with
inductor's C++ wrapper once the kind has run `cpp_step.BUILD_AFTER` tokens directly, and later calls run that one:
a token is then one C++ call, no Python per kernel (cpp_step.py).
A learnt step with static shapes is also kept on disk, per rank (kept_step.py, engines/capture_store.py): in a later
process, the first call of that kind builds the step from it and runs it without entering dynamo, where every rank
found its entry (they agree first). ``TENSORSHARD_CAPTURE_CACHE=0`` turns that off.
``TENSORSHARD_DIRECT_STEP=0`` leaves every call to dynamo (to compare, or to rule this out); GPU ranks (CUDA graphs,
functional collectives) keep dynamo's path.
"""

from __future__ import annotations

import copy
import functools
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ...logs import get_logger
from ...registrations import registrations
from .. import capture_store
from ..graph_inputs import InputReader, NotLocated, build_output, call_arguments, locate_inputs, output_builder, output_fields
from ..inductor_cache import CacheUse
from . import cpp_step, kept_step

try:  # what dynamo knows of a frame's side effects as it compiles (torch 2.13's names; `_stores` says None without)
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._dynamo.variables import ConstantVariable, TensorVariable
    from torch._dynamo.variables.base import AttributeMutationExisting, AttributeMutationNew, ValueMutationNew
except ImportError:  # pragma: no cover
    InstructionTranslator = None

logger = get_logger(__name__)

ENV = "TENSORSHARD_DIRECT_STEP"  # "0": every call through dynamo's frame


_watched = threading.local()  # .seen: while a call is watched (`DirectSteps.watching`), the graphs it ran
_backends: dict[str, "_Backend"] = {}  # one per backend settings, shared by every model of the process


class _Backend:
    """The compile config's backend, built as torch.compile builds it, each compiled graph wrapped by `_Graph`.
    One object per backend settings, so that transformers' comparison of compile configs (dataclass equality,
    `copy.deepcopy` in `to_dict`) sees the same config from one generate() to the next. It holds no model: torch
    keeps every backend it was given for the rest of the process (each model's step is compiled on code of its own,
    decoding.py, whose graphs die with the model: engines/own_code.py)."""

    def __init__(self, backend: Any, mode: str | None, options: dict | None, dynamic: bool | None) -> None:
        if backend == "inductor":
            self.inner = torch._TorchCompileInductorWrapper(mode, options, dynamic)
        else:
            self.inner = torch._TorchCompileWrapper(backend, mode, options, dynamic)
        self.__name__ = getattr(self.inner, "compiler_name", "backend")  # (torch.compile names a backend by it)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        stores = _stores()  # (while dynamo's translator of this frame is current)
        files = capture_store.traced_files(TracingContext.get_traced_code() or ())  # (kept_step.py's entry lists them)
        graph = _Graph(self.inner(gm, example_inputs), _sizes(gm, example_inputs), stores, self.again(gm))
        graph.gm, graph.files = gm, files  # what kept_step.py saves once the kind is learnt
        return graph.wrapper()

    def again(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, dict] | None:
        """Inductor's graphs keep their FX graph and settings: a learnt step may build it again with the C++ wrapper."""
        return (gm, self.inner.config) if isinstance(self.inner, torch._TorchCompileInductorWrapper) else None

    def compile_kept(self, gm: torch.fx.GraphModule, inputs: list) -> Callable[..., Any]:
        """`gm` (a graph kept on disk, kept_step.py) compiled as this backend compiles dynamo's graphs, for `inputs`
        (a call's real graph inputs) seen with static shapes, as dynamo passes them (inductor's cache then finds the
        graph it compiled for dynamo's trace)."""
        mode = FakeTensorMode(shape_env=ShapeEnv())
        fake = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in inputs]
        with tracing(TracingContext(mode)):
            return self.inner(gm, fake)

    def reset(self) -> None:
        reset = getattr(self.inner, "reset", None)
        if callable(reset):
            reset()

    def __deepcopy__(self, memo: dict) -> "_Backend":
        return self


def _sizes(gm: torch.fx.GraphModule, example_inputs: list) -> list[tuple[int, int, str, int | None]] | None:
    """The graph's int inputs (a dynamic size, stride or offset of another input, dynamic shapes) as (their index,
    the tensor input's index, "size" / "stride" / "storage_offset", the dimension), from the sources dynamo notes
    on its placeholders; None where an int input is not such a property of a tensor input."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    sources = [getattr(node.meta.get("grapharg"), "source", None) for node in placeholders]
    sizes = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            continue
        source = sources[i] if i < len(sources) and len(sources) == len(example_inputs) else None
        prop, base = getattr(source, "prop", None), getattr(source, "base", None)
        if not isinstance(x, (int, torch.SymInt)) or prop is None or base is None or base not in sources:
            return None
        j = sources.index(base)
        if not isinstance(example_inputs[j], torch.Tensor):
            return None
        sizes.append((i, j, prop.method_name(), getattr(source, "idx", None)))
    return sizes


def _stores() -> list[tuple[Any, str, Any]] | None:
    """The Python side effects dynamo's code replays after this graph, as (object, attribute, constant) stores on
    objects that existed before the call (SmolLM2's step: transformers' output-capturing context reset to None and
    False, the engine's traced-call state to None); None where there are others (a list or dict changed, a value
    that is not a constant, a hook: that graph stays with dynamo). What the call makes anew (its output) and the
    tensors it changes in place (inside the graph) are not side effects to replay."""
    try:
        effects = InstructionTranslator.current_tx().output.side_effects
        if effects.tensor_hooks or effects.save_for_backward:
            return None
        stores = []
        for var in effects._get_modified_vars():
            changed = effects.store_attr_mutations.get(var, {})
            if isinstance(var, TensorVariable) and not changed:
                continue  # changed in place: an operation of the graph
            if isinstance(var.mutation_type, (AttributeMutationNew, ValueMutationNew)):
                continue  # made by the call
            if not isinstance(var.mutation_type, AttributeMutationExisting) or not hasattr(var, "value"):
                return None
            for name, value in changed.items():
                if not isinstance(value, ConstantVariable):
                    return None
                stores.append((var.value, name, value.as_python_constant()))
        return stores
    except Exception:  # another torch's dynamo: nothing known, nothing called directly
        return None


class _Graph:
    """One compiled graph as dynamo calls it, noting its inputs and outputs while a call is watched."""

    def __init__(self, compiled: Callable[..., Any], sizes: list | None, stores: list | None,
                 again: tuple[torch.fx.GraphModule, dict] | None = None) -> None:
        self.compiled, self.sizes, self.stores = compiled, sizes, stores
        self.again = again  # (the FX graph, inductor's settings): what cpp_step.py builds with the C++ wrapper
        self.gm: torch.fx.GraphModule | None = None  # dynamo's graph, and the source files it traced: kept_step.py
        self.files: set[str] = set()

    def wrapper(self) -> Callable[..., Any]:
        compiled = self.compiled

        def run(*inputs: Any) -> Any:
            out = compiled(*inputs)
            seen = getattr(_watched, "seen", None)
            if seen is not None:
                seen.append((self, inputs, out))
            return out

        try:
            return functools.wraps(compiled)(run)
        except (AttributeError, TypeError):  # (a callable object without a name)
            return run


class DirectSteps:
    """The kinds of call of one generating model whose compiled graph is called directly (see the module doc)."""

    def __init__(self, model: nn.Module, state, guard=None) -> None:
        self.model, self.state, self.guard = model, state, guard  # (guard: the group's; None: nothing kept on disk)
        self.steps: dict[Hashable, DirectStep] = {}
        self.refused: set[Hashable] = set()
        self._registrations = registrations()  # when the steps were learnt (their keys hold it: unguarded.py)
        self.backend: _Backend | None = None  # the compile config's, as `capturing` last handed it to transformers
        self.settings: tuple = ()  # ... and its settings, for the entries kept on disk
        self.names: dict[Hashable, str | None] = {}  # each kind's entry on disk (kept_step.py), named at its first call

    # -- the compile ------------------------------------------------------------------------------------------

    def sees_graphs(self) -> bool:
        """Whether the graphs this model's step runs are ours to watch (`capturing` hands dynamo our backend)."""
        return self.state.mesh.device_type == "cpu" and hasattr(torch, "_TorchCompileInductorWrapper")

    def capturing(self, compile_config):
        """`compile_config` with our backend in place of its backend, mode and options (theirs, inside it); the
        config itself where calling the graph directly does not apply (GPU ranks keep CUDA graphs and functional
        collectives)."""
        if not self.sees_graphs():
            return compile_config
        settings = (compile_config.backend, compile_config.mode, compile_config.options, compile_config.dynamic)
        name = repr(settings)
        if name not in _backends:
            _backends[name] = _Backend(*settings)
        ours = copy.copy(compile_config)
        ours.backend, ours.mode, ours.options = _backends[name], None, None
        self.backend, self.settings = _backends[name], (*settings, getattr(compile_config, "fullgraph", None))
        return ours

    # -- learning a kind --------------------------------------------------------------------------------------

    @contextmanager
    def watching(self):
        """Note the graphs run by the call inside, in this thread (the list yielded: (graph, inputs, outputs))."""
        _watched.seen = seen = []
        try:
            yield seen
        finally:
            _watched.seen = None

    def learn(self, key: Hashable, seen: list, args: tuple, kwargs: dict, out: Any) -> None:
        """After a call of `key` run with every guard that compiled nothing (`seen`: the graphs it ran; the local
        views still in place): its graph is this kind's, called directly from the next call on."""
        self._forget_old()
        if key in self.steps or key in self.refused or not enabled():
            return
        try:
            if len(seen) != 1:
                raise _NotDirect(f"the call ran {len(seen)} compiled graphs (one is needed)")
            graph, inputs, outputs = seen[0]
            if graph.sizes is None:
                raise _NotDirect("an int input of the graph is not a size, stride or offset of a tensor input")
            if graph.stores is None:
                raise _NotDirect("the step has Python side effects other than attributes set to constants")
            arguments = call_arguments(args, kwargs)
            # each split weight's layout, by its module's table and name: the graph read its local view
            layouts = {(id(getattr(owner, table)), name): layout
                       for _, entries in self.state.views.swaps for owner, table, name, layout, _ in entries}
            sources = locate_inputs(self.model, arguments, inputs, local_views=layouts, mesh=self.state.mesh,
                                    sizes={i for i, *_ in graph.sizes})
            name = type(self.model).__name__
            dtypes, fields = [_dtype(x) for x in inputs], output_fields(out, outputs, arguments)
            self.steps[key] = DirectStep(graph.compiled, InputReader(sources), graph.sizes, graph.stores, dtypes,
                                         fields, type(out), name=name,
                                         pending=cpp_step.candidate(graph.again, inputs, dynamic=bool(graph.sizes),
                                                                    name=name))
        except (_NotDirect, NotLocated) as why:
            self.refused.add(key)
            logger.debug("the compiled decode step of %s stays with dynamo for this kind of call: %s",
                         type(self.model).__name__, why)
            return
        entry = self.names.get(key)
        if entry is not None and graph.gm is not None and not graph.sizes and graph.files:
            try:  # (a later process builds this kind's step from it: `from_store`)
                payload = kept_step.portable(self.model, self.state, self.guard, graph.gm, sources, graph.stores,
                                             dtypes, fields, type(out))
            except Exception as error:  # (a graph or source the store cannot write: traced again next time)
                logger.debug("the decode graph of %s is not kept on disk: %s: %s", type(self.model).__name__,
                             type(error).__name__, error)
            else:
                capture_store.save(entry, payload, graph.files)

    # -- a kind kept on disk by an earlier process (kept_step.py) --------------------------------------------------

    def may_keep(self, key: Hashable) -> bool:
        """Whether `key`'s first call looks for its step on disk (`from_store`): a kind not seen yet, on CPU ranks,
        direct calls on, the engine's group known. The same on every rank (`from_store` is collective)."""
        return (self.guard is not None and key not in self.names and key not in self.steps and enabled()
                and self.backend is not None and self.sees_graphs())

    def from_store(self, key: Hashable, kind: Hashable, args: tuple, kwargs: dict) -> Any:
        """The first call of `key` (`kind`: its description that outlives the process), run by the step an earlier
        process kept on disk, without dynamo; None (nothing ran) where there is none on some rank, or it failed to
        load, build or compile (dropped, logged: the kind is traced as before). Collective: every rank of the group
        calls it at the same call (`may_keep`), and they agree before any runs its step (kept_step.agree)."""
        self._forget_old()
        model, started, cache = self.model, time.perf_counter(), CacheUse()
        entry = step = self.names[key] = None  # (tried: never again for this key, on any rank, whatever happens)
        try:
            entry = self.names[key] = kept_step.entry_name(model, self.state, self.guard, self.settings, kind)
            payload = capture_store.load(entry) if entry is not None else None
            if payload is not None:
                name = type(model).__name__
                pieces = kept_step.restored(payload, model, self.state, self.guard, self.backend,
                                            call_arguments(args, kwargs), name=name)
                step = DirectStep(pieces["compiled"], pieces["read"], [], pieces["stores"], pieces["dtypes"],
                                  pieces["fields"], pieces["output_type"], name=name, pending=pieces["pending"])
        except Exception as error:  # an entry that does not fit after all: dropped, traced (and kept) again
            logger.info("the decode graph of %s kept on disk was not used (%s: %s); tracing it again",
                        type(model).__name__, type(error).__name__, error)
            if entry is not None:
                capture_store.discard(entry)
        if not kept_step.agree(step is not None, self.guard):
            if step is not None:
                logger.info("the decode graph of %s kept on disk was not used: another rank has none for this kind "
                            "of call; tracing it on every rank", type(model).__name__)
            return None
        self.steps[key] = step
        out = step(args, kwargs)
        if out is None:  # (an input not as the step reads it after all: nothing ran, dynamo's path decides)
            del self.steps[key]
        elif _rank0():
            logger.info("compiled the decode step of %s from its graph kept on disk (%s), without tracing (%s): "
                        "first call in %.1f s", type(model).__name__, capture_store.folder(), cache.since(),
                        time.perf_counter() - started)
        return out

    def run(self, key: Hashable, args: tuple, kwargs: dict) -> Any:
        """The call through the graph learnt for `key`; None (nothing ran) where there is none or it does not
        apply now."""
        self._forget_old()
        step = self.steps.get(key)
        if step is None or not enabled():
            return None
        return step(args, kwargs)

    def forget(self) -> None:
        """Drop every step learnt (transformers compiled anew, for another compile config: its graphs are others)."""
        self.steps.clear()
        self.refused.clear()
        self.names.clear()

    def _forget_old(self) -> None:
        """Steps learnt before a registration never run again (their keys hold the count): dropped, with the weights
        they keep (a weight replaced by assignment would otherwise stay alive in them)."""
        if registrations() != self._registrations:
            self.forget()
            self._registrations = registrations()


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


class _NotDirect(Exception):
    """Why a kind of call keeps dynamo's path."""


class DirectStep:
    """One kind of call's compiled graph, how to find its inputs again, and how to build the call's output
    (engines/graph_inputs.py)."""

    def __init__(self, compiled: Callable[..., Any], read: InputReader, sizes: list, stores: list, dtypes: list,
                 fields: dict[str, Any], output_type: type, *, name: str, pending: tuple | None) -> None:
        self.compiled, self.read, self.sizes, self.stores, self.dtypes = compiled, read, sizes, stores, dtypes
        self.fields, self.output_type = output_builder(fields), output_type
        self.name = name  # the model's class name, for the log
        self.cpp: Callable[..., Any] | None = None  # the same graph built with inductor's C++ wrapper (cpp_step.py)
        self.pending = pending  # what cpp_step.build builds it from (a `cpp_step.candidate`), until built or failed
        self.calls = 0  # direct calls while it is pending

    def graph(self) -> Callable[..., Any]:
        """The compiled graph a call runs now: the C++-wrapper one where it was built and is not switched off."""
        return self.cpp if self.cpp is not None and cpp_step.enabled() else self.compiled

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        """The call (the caller checked, as for skipping the guards, that the local views could be put in place:
        no gradients, no split module training); None, with nothing run, where an input is not as learnt."""
        arguments = call_arguments(args, kwargs)
        inputs = self.read(arguments)
        # (`None in inputs` would compare every tensor with None through torch's __eq__: milliseconds)
        dtypes = [x.dtype for x in inputs] if not self.sizes else [_dtype(x) for x in inputs]
        if any(x is None for x in inputs) or dtypes != self.dtypes:
            return None  # a weight of another mesh, or a dtype changed (`.half()`): dynamo's path decides
        for i, j, prop, dim in self.sizes:  # dynamic shapes: a size (stride, offset) of a tensor input
            inputs[i] = getattr(inputs[j], prop)() if dim is None else getattr(inputs[j], prop)(dim)
        if self.pending is not None and cpp_step.enabled():
            self.calls += 1
            if self.calls > cpp_step.BUILD_AFTER:  # a kind in use: its C++ wrapper's graph, built once (cpp_step.py)
                self.cpp, self.pending = cpp_step.build(self.pending, inputs, name=self.name), None
        outputs = self.graph()(*inputs)
        for owner, name, value in self.stores:  # what dynamo's code sets after the graph
            setattr(owner, name, value)
        return build_output(self.output_type, self.fields, outputs, arguments)


def _dtype(x: Any) -> Any:
    return x.dtype if isinstance(x, torch.Tensor) else type(x)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
