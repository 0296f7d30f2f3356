"""Every shard's decode step compiled on its own and run on its own thread, at the same time as the others.

A stitched step (stitched_step.py) does every shard's arithmetic on the calling thread: right for a small model,
whose token is dispatch, but a model whose token is reading its weights (SmolLM2-135M: ~540 MB a token) then reads
all of them on one core, and splitting cannot beat the unsplit model. Here each shard's graph, as dynamo captured
it (a `Capture`), is compiled with inductor on its own and run on the shard's thread while the other shards run
theirs: each core reads its device's share of the weights.

    shard 0's thread:  seg0 -> native_all_reduce(a0) -> seg1 -> ... -> native_all_gather(l0) -> out
    shard 1's thread:  seg0 -> native_all_reduce(a1) -> seg1 -> ... -> native_all_gather(l1)

What keeps the threads from taking turns on the GIL:
- the collectives: each `tensorshard::threads_*` operator of the captured graph (a rendezvous in Python) becomes
  the native operator (comm/native/: C++, a barrier and a rank-ordered sum over a buffer the shards share, the
  GIL released while it waits): the same sums, bit for bit, with no Python per collective. An all-gather whose
  pieces are not one range per rank in rank order (a fused projection's interleaved heads) keeps the Python one;
  where the native library is unavailable every collective does (the same numbers, slower);
- the kernels: each shard's graph is compiled with inductor's C++ wrapper, which releases the GIL from its first
  kernel to its last, its inputs held for the call so that freeing one never reaches Python (comm/native/
  cpp_graphs.py); with the Python collectives (no native library) the default Python wrapper is kept, whose lines
  and small fused kernels hold the GIL a few microseconds each;
- no dynamo frame per shard and token: the graph is called with its inputs found again as the stitched step finds
  them (`Capture.sources`), under the same checks (stitched_decode.py);
- no engine call per token where every collective is native: the caller's thread reads each rank's inputs, wakes
  each other rank's parked thread of this step (step_threads.py) and runs rank 0's graph itself; each rank's inputs
  keep their extra C++ references from one token to the next while they are the same tensors (`cpp_graphs.Held`).

The collectives read the calling thread's rank (`native_set_thread_rank`, set by `run`), and ints that differ
between the shards' graphs only as a vocabulary range (`_one_graph`) become inputs: shards of an even split run
one compiled graph, compiled once.

A failing shard aborts the native group, so the other shards' waits raise at once; the step is then dropped
(stitched_decode.py) and that kind of call runs per shard under `torch.compile` from then on.
"""

from __future__ import annotations

import operator
import threading
from typing import Any, Callable, Sequence

import torch
from torch import fx

from ...comm import thread_ops
from ...comm.native import cpp_graphs
from ...comm.native import ops as native
from ...switches import switched_on
from ..graph_inputs import InputReader, build_output, output_builder
from .step_threads import StepThreads
from .stitched_step import Capture, StitchError


# Inductor's C++ wrapper for each shard's graph (with the native collectives; see the docstring). TENSORSHARD_CPP_WRAPPER=0
# keeps the Python wrapper, to compare: on a quiet 2-core machine, SmolLM2's shape at 2 devices, 30.7 ms per token
# with the C++ wrapper against 39.7 with the Python one (docs/generation.md); a cold compile costs more.
CPP_WRAPPER = switched_on("TENSORSHARD_CPP_WRAPPER")
# A step whose collectives are all native runs its shards on threads of its own (step_threads.py), not through the
# engine's call. TENSORSHARD_STEP_THREADS=0 keeps the engine's call, to compare (docs/generation.md).
STEP_THREADS = switched_on("TENSORSHARD_STEP_THREADS")


class ParallelStep:
    """Each shard's captured graph, its collectives native where they can be, compiled on its own; run on the
    step's own threads (`threads`, step_threads.py) when every collective is native, else by `run_modules` (the
    engine's call: the shards' threads, together). Per rank: `inputs` (read from its arguments), `graph` (in its
    thread), `output` (its model output); `run` is the three."""

    def __init__(self, captures: Sequence[Capture], world: int, timeout: float, labels: Sequence[str] = ()) -> None:
        self.captures = list(captures)
        self.group = native.ThreadGroup(world, timeout=timeout) if native.available() else None
        self.modules = [_with_native_collectives(c.graph, self.group) for c in self.captures]
        # Each rank's numbers lifted out of the graphs (one graph for all shards; `_one_graph`), given as last inputs.
        self.numbers: list[list[torch.Tensor]] = [[] for _ in self.captures]
        if self.group is not None and len(self.modules) > 1:
            merged = _one_graph(self.modules)
            if merged is not None:
                one, self.numbers = merged
                self.modules = [one] * len(self.modules)
        self.compiled: list[Callable[..., Any]] | None = None
        self.dtypes: list[list[torch.dtype]] = []
        self.registrations = 0  # registrations.py's count when built (stitched_decode.py checks it)
        self.native = self.group is not None
        # The C++ wrapper only pays with native collectives (a Python one inside it takes the GIL back anyway).
        self.cpp_wrapper = CPP_WRAPPER and self.native
        self.shared = 0  # shards that run another shard's compiled graph (the same graph, the same input shapes)
        self.readers = [InputReader(c.sources) for c in self.captures]
        self.fields = [output_builder(c.fields) for c in self.captures]
        # Each rank's inputs held across calls (C++ wrapper), in two parts: those that stay the same tensors from one
        # token to the next (weights, the cache, the rank's numbers: held again only when one changes) and the
        # token's own (input ids, positions, mask: held anew per call, a few tensors instead of every input).
        self._held = [(cpp_graphs.Held(), cpp_graphs.Held()) for _ in self.captures]
        self._steady = [[i for i, s in enumerate(c.sources) if getattr(s, "steady", False)] + list(range(len(c.sources), len(c.sources) + len(n)))
                        for c, n in zip(self.captures, self.numbers)]
        self._changing = [[i for i, s in enumerate(c.sources) if not getattr(s, "steady", False)] for c in self.captures]
        self._ranks = threading.local()  # on this step's own threads: the native rank each set once (`_own_thread`)
        # Every collective native (no Python one left in any graph): nothing a shard runs per token needs the engine's
        # rendezvous, so the shards run on threads of this step's own (step_threads.py), rank 0 in the caller's.
        self.threads = (
            StepThreads(world, labels or [f"rank {r}" for r in range(world)], setup=self._own_thread)
            if STEP_THREADS and self.native and not any(_python_collectives(m) for m in self.modules) else None
        )

    def compile(self, per_rank_kwargs: Sequence[dict], *, config_patches: dict | None = None) -> None:
        """Compile every shard's graph with inductor for these inputs' shapes, one after another in this thread
        (torch.compile is not thread-safe); nothing runs. A shard whose graph and input shapes are another's (an
        even split: its collectives read the thread's rank) runs that shard's compiled graph."""
        compiled, dtypes, seen = [], [], {}
        for module, capture, kwargs, numbers in zip(self.modules, self.captures, per_rank_kwargs, self.numbers):
            inputs = [read(kwargs) for read in capture.sources] + numbers
            key = _graph_key(module, inputs)
            if key is not None and key in seen:
                compiled.append(seen[key])
            else:
                if self.cpp_wrapper:  # (`graph` holds the inputs while it runs: no GIL inside it)
                    compiled.append(cpp_graphs.compile_graph(module, inputs, config_patches, hold=False))
                else:
                    compiled.append(cpp_graphs.inductor_compile(module, inputs, config_patches))
                if key is not None:
                    seen[key] = compiled[-1]
            dtypes.append([x.dtype for x in inputs[:len(capture.sources)]])
        self.compiled, self.dtypes = compiled, dtypes
        self.shared = len(compiled) - len({id(c) for c in compiled})

    def check(self, per_rank_kwargs: Sequence[dict]) -> None:
        """StitchError, before anything runs, if an input's dtype changed since `compile` (``split.half()``):
        inductor's code checks sizes and strides, not dtypes."""
        self.check_inputs([self.inputs(rank, kwargs) for rank, kwargs in enumerate(per_rank_kwargs)])

    def check_inputs(self, per_rank_inputs: Sequence[list]) -> None:
        """`check`, on every rank's inputs as `inputs` read them."""
        for inputs, dtypes in zip(per_rank_inputs, self.dtypes):
            if [x.dtype for x in inputs[:len(dtypes)]] != dtypes:
                raise StitchError("a weight, buffer or cache changed its dtype since the step was compiled")

    def _own_thread(self, rank: int) -> None:
        """In each of the step's own threads (`threads`), once: its native rank, which nothing else run there
        changes (the caller's thread, and the engine's, set theirs per call)."""
        if self.group is not None:
            torch.ops.tensorshard.native_set_thread_rank(self.group.handle, rank)
            self._ranks.rank = rank

    def inputs(self, rank: int, kwargs: dict) -> list:
        """Shard `rank`'s graph inputs for a call (`kwargs`: its own arguments, its cache among them)."""
        return self.readers[rank](kwargs) + self.numbers[rank]

    def graph(self, rank: int, inputs: list) -> Any:
        """Shard `rank`'s compiled graph on its inputs, in its thread: the graph's outputs."""
        if self.group is not None and getattr(self._ranks, "rank", None) != rank:  # (set once on the step's threads)
            torch.ops.tensorshard.native_set_thread_rank(self.group.handle, rank)
        if self.cpp_wrapper:  # (no input's last C++ reference drops inside the graph: no GIL there)
            steady, changing = self._held[rank]
            steady.hold([inputs[i] for i in self._steady[rank]])
            changing.hold([inputs[i] for i in self._changing[rank]])
        return self.compiled[rank](*inputs)

    def output(self, rank: int, outs: Any, kwargs: dict) -> Any:
        """Shard `rank`'s output (its model output type) from its graph's outputs and its arguments."""
        return build_output(self.captures[rank].output_type, self.fields[rank], outs, kwargs)

    def run(self, rank: int, kwargs: dict) -> Any:
        """Shard `rank`'s step, in its thread (`kwargs`: its own arguments, its cache among them): its output."""
        return self.output(rank, self.graph(rank, self.inputs(rank, kwargs)), kwargs)

    def abort(self, rank: int, error: BaseException) -> None:
        """Shard `rank` failed in its step: the other shards, waiting in a native collective, raise at once."""
        if self.group is not None:
            self.group.abort(rank, f"{type(error).__name__}: {error}")

    def close(self) -> None:
        for held in self._held:
            for part in held:
                part.release()
        if self.threads is not None:
            self.threads.close()
        if self.group is not None:
            self.group.close()


def _python_collectives(gm: fx.GraphModule) -> bool:
    """Whether `gm` calls a tensorshard operator other than the native collectives (a Python collective)."""
    return any(
        node.op == "call_function" and getattr(node.target, "namespace", None) == "tensorshard"
        and not node.target.name().startswith("tensorshard::native_")
        for node in gm.graph.nodes
    )


def _with_native_collectives(gm: fx.GraphModule, group: native.ThreadGroup | None) -> fx.GraphModule:
    """A copy of `gm` whose Python collectives are the native ones of `group` (kept where they cannot be), called
    with group and rank -1: the calling thread's (`run` sets them), so that shards of an even split have the same
    graph, and a graph names no group (inductor's cache finds it again for another split model, or process)."""
    rank = here = -1
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if group is not None and node.op == "call_function" and node.target is thread_ops.all_reduce and not node.kwargs:
            x, _, where = node.args
            env[node] = graph.call_function(torch.ops.tensorshard.native_all_reduce.default, (env[x], here, rank, where))
        elif group is not None and node.op == "call_function" and node.target is thread_ops.all_gather and not node.kwargs:
            x, _, dim, layout, where = node.args
            sizes = _rank_ordered_sizes(thread_ops.partition_of(list(layout)))
            if sizes is None:
                env[node] = graph.node_copy(node, env.__getitem__)
            else:
                env[node] = graph.call_function(torch.ops.tensorshard.native_all_gather.default, (env[x], here, rank, dim, sizes, where))
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
        env[node].meta = dict(node.meta)
    return fx.GraphModule(gm, graph)


# Calls whose int argument may differ between shards (a vocabulary-parallel embedding's range: `ids < 48`,
# `ids - 48`): exact with a 0-d int64 tensor in its place.
_LIFTABLE = {operator.lt, operator.le, operator.gt, operator.ge, operator.sub, operator.add,
             torch.lt, torch.le, torch.gt, torch.ge, torch.sub, torch.add}


def _one_graph(modules: Sequence[fx.GraphModule]) -> tuple[fx.GraphModule, list[list[torch.Tensor]]] | None:
    """One graph for every shard when theirs differ only by ints given to comparisons, additions and subtractions
    (a vocabulary-parallel embedding's range) and by an embedding's padding_idx (which changes no forward value,
    only gradients: these graphs run without them): those ints become the graph's last inputs (0-d int64
    tensors, each rank's own), the padding_idx None: `modules[0]`, changed so. Else None, nothing changed."""
    graphs = [list(m.graph.nodes) for m in modules]
    if len({len(nodes) for nodes in graphs}) != 1:
        return None
    index = [{node: i for i, node in enumerate(nodes)} for nodes in graphs]
    lifted: list[tuple[int, int, list[int]]] = []  # (node, argument position, each rank's int)
    unpadded: list[int] = []  # embeddings whose padding_idx differ
    for i, nodes in enumerate(zip(*graphs)):
        first = nodes[0]
        if any(n.op != first.op or n.target != first.target for n in nodes):
            return None
        embedding = first.target is torch.nn.functional.embedding
        args = [fx.node.map_arg(n.args, lambda a, r=r: ("node", index[r][a])) for r, n in enumerate(nodes)]
        kwargs = [fx.node.map_arg(n.kwargs, lambda a, r=r: ("node", index[r][a])) for r, n in enumerate(nodes)]
        if embedding and any(k.get("padding_idx") != kwargs[0].get("padding_idx") for k in kwargs):
            unpadded.append(i)
            kwargs = [{k: v for k, v in kw.items() if k != "padding_idx"} for kw in kwargs]
        if any(k != kwargs[0] for k in kwargs) or any(len(a) != len(args[0]) for a in args):
            return None
        for at, values in enumerate(zip(*args)):
            if all(v == values[0] and type(v) is type(values[0]) for v in values):
                continue
            if first.target in _LIFTABLE and all(type(v) is int for v in values):
                lifted.append((i, at, list(values)))
            elif embedding and at == 2:
                unpadded.append(i)
            else:
                return None
    if not lifted and not unpadded:
        return None
    gm = modules[0]  # (changed in place: `_with_native_collectives` made it for this step; a deep copy of its graph,
    nodes = graphs[0]  # its nodes' fake tensors with it, took most of this function's time)
    last_input = [n for n in nodes if n.op == "placeholder"][-1]
    for k, (i, at, _) in enumerate(lifted):
        with gm.graph.inserting_after(last_input):
            last_input = gm.graph.placeholder(f"rank_number_{k}")
        args = list(nodes[i].args)
        args[at] = last_input
        nodes[i].args = tuple(args)
    for i in unpadded:
        if "padding_idx" in nodes[i].kwargs:
            nodes[i].kwargs = {**nodes[i].kwargs, "padding_idx": None}
        else:
            nodes[i].args = (*nodes[i].args[:2], None, *nodes[i].args[3:])
    gm.graph.lint()
    gm.recompile()
    numbers = [[torch.tensor(values[r], dtype=torch.int64) for _, _, values in lifted] for r in range(len(modules))]
    return gm, numbers


def _graph_key(module: fx.GraphModule, inputs: list) -> tuple | None:
    """What makes two shards' compiled graphs interchangeable: the graph's code and its inputs' shapes, strides
    and dtypes (None, never shared, for a graph that holds tensors of its own or takes a non-tensor input)."""
    if any(node.op == "get_attr" for node in module.graph.nodes) or not all(isinstance(x, torch.Tensor) for x in inputs):
        return None
    return module.code, tuple((tuple(x.shape), x.stride(), x.dtype) for x in inputs)


def _rank_ordered_sizes(partition) -> list[int] | None:
    """Each rank's piece size when the pieces are one range each, in rank order, covering the whole; else None."""
    at, sizes = 0, []
    for ranges in partition.ranges:
        if len(ranges) != 1 or ranges[0][0] != at:
            return None
        sizes.append(ranges[0][1] - ranges[0][0])
        at = ranges[0][1]
    return sizes if at == partition.size else None
