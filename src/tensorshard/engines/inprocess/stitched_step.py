"""Every shard's compiled decode step stitched into one graph, run from the caller's thread: no hand-offs.

compiled_steps.py compiles each shard's forward on its own; per token each shard then runs in its thread, and at
every collective (18 per token for an 8-block Llama) the shards' threads hand the GIL to one another, which on CPU
slots costs more than the compiled kernels themselves (BENCHMARKS.md, section 5). Here the shards' graphs, as
dynamo captured them (the collectives inside as `tensorshard::threads_*` operators, comm/thread_ops.py), become ONE
graph that computes every shard's step:

    shard 0:  seg0 -> all_reduce(a0) -> seg1 -> ... -> all_gather(l0)      stitched:  seg0(s0) seg0(s1)
    shard 1:  seg0 -> all_reduce(a1) -> seg1 -> ... -> all_gather(l1)      ------->   r = a0 + a1
                                                                                       seg1(s0, r) seg1(s1, r) ...

each collective replaced by what it computes (the rank-ordered sum for an all-reduce, as comm/reduce.py's `sum_on`;
the pieces put in place for an all-gather, as `Partition.assemble`), then compiled with inductor once and called
per token with every shard's inputs (weights, the token's tensors, each shard's static cache, mutated in place).

Built from a `Capture` of each shard (its dynamo graph, where each graph input comes from, which graph output each
field of its output is), made while the per-shard path runs the first call of a kind. `stitch` refuses (StitchError,
with the reason) whatever it cannot prove it reproduces: graphs of different structure, a collective not in the
same place on every shard, an input it cannot find again next call, devices that are not all CPU slots.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn

from ...comm import thread_ops as collectives
from ...comm.counter import record
from ...comm.native.cpp_graphs import inductor_compile
from ..graph_inputs import Argument, InputReader, Source, build_output, output_builder

_ALL_REDUCE, _ALL_GATHER = collectives.all_reduce, collectives.all_gather


class StitchError(RuntimeError):
    """The shards' graphs cannot be stitched into one (the reason is the message); the per-shard path runs."""


@dataclass
class Capture:
    """One shard's decode step as dynamo captured it: `graph` (a GraphModule), `sources` (per graph input, how to
    find it again from the shard and its call's keyword arguments: engines/graph_inputs.py) and `fields` (per field
    of the shard's output, the graph output index, or the argument it is: graph_inputs.py's `output_fields`)."""

    graph: fx.GraphModule
    sources: list[Source]
    fields: dict[str, int | Argument] = field(default_factory=dict)
    output_type: type | None = None
    last_outputs: Any = None  # the graph's outputs at its latest run (to match them with the shard's output)


def stitch(captures: Sequence[Capture], devices: Sequence[torch.device], src: int) -> "StitchedStep":
    """One graph computing every shard's step (see the module doc); StitchError where that cannot be proved."""
    if any(torch.device(d).type != "cpu" for d in devices):
        raise StitchError("only CPU slots are stitched (on GPUs each shard's kernels are queued asynchronously)")
    cut = [segments(c.graph) for c in captures]
    _check_alike(cut, captures)
    graph = fx.Graph()
    env: list[dict[fx.Node, fx.Node]] = [{} for _ in captures]
    for rank, capture in enumerate(captures):
        for node in capture.graph.graph.find_nodes(op="placeholder"):
            env[rank][node] = graph.placeholder(f"s{rank}_{node.name}")
            env[rank][node].meta = dict(node.meta)
    collectives_done: list[tuple[str, int, str]] = []
    for k in range(len(cut[0])):
        for rank, capture in enumerate(captures):
            for node in cut[rank][k][0]:
                env[rank][node] = graph.node_copy(node, lambda n, r=rank: env[r][n])
        ends = [cut[rank][k][1] for rank in range(len(captures))]
        if ends[0] is None:
            break
        pieces = [env[rank][end.args[0]] for rank, end in enumerate(ends)]
        if ends[0].target is _ALL_REDUCE:
            total = graph.call_function(operator.add, (pieces[0], pieces[1]))
            for piece in pieces[2:]:
                total = graph.call_function(operator.add, (total, piece))  # rank order: as comm/reduce.py's sum_on
            kind = "all_reduce"
        else:
            _, _, dim, layout, _ = ends[0].args
            total = graph.call_function(_assemble, (list(layout), dim, *pieces))
            kind = "all_gather"
        for rank, end in enumerate(ends):
            # Every shard gets its own copy, as from the eager collective: model code may change the result in place
            # (Falcon's `mlp_output += attention_output`, an `iadd` node, or through a view), which on one shared
            # tensor would reach the other shards. Made here, before any shard's next segment runs.
            env[rank][end] = total if rank == 0 else graph.call_method("clone", (total,))
        collectives_done.append((kind, _nbytes(ends[0]), ends[0].args[-1]))
    for capture in captures:
        capture.last_outputs = None  # (the outputs of the last per-shard run: no longer needed)
    out_node = captures[src].graph.graph.find_nodes(op="output")[0]
    graph.output(fx.map_arg(out_node.args[0], lambda n: env[src][n]))
    module = fx.GraphModule(nn.Module(), graph)  # (no attributes: graphs holding any are refused, `segments`)
    return StitchedStep(module, [c.sources for c in captures], captures[src], src, collectives_done)


def segments(gm: fx.GraphModule) -> list[tuple[list[fx.Node], fx.Node | None]]:
    """The graph's computing nodes cut at its collectives: [(nodes before collective k, collective k)], the last
    segment ending with None (the nodes before the output)."""
    out, run = [], []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            raise StitchError(f"graph holds a constant attribute ({node.target}); not stitched")
        if node.op == "call_function" and node.target in (_ALL_REDUCE, _ALL_GATHER):
            if node.kwargs:
                raise StitchError(f"a collective called with keyword arguments ({node.format_node()}); not stitched")
            out.append((run, node))
            run = []
        else:
            run.append(node)
    out.append((run, None))
    return out


def _check_alike(segments: list, captures: Sequence[Capture]) -> None:
    """The same collectives in the same order on every shard, with the same place (`where`), shape and layout."""
    first = [end for _, end in segments[0]]
    for rank, segs in enumerate(segments[1:], start=1):
        ends = [end for _, end in segs]
        if len(ends) != len(first):
            raise StitchError(f"shard {rank} has {len(ends) - 1} collectives, shard 0 has {len(first) - 1}")
        for a, b in zip(first, ends):
            if a is None and b is None:
                continue
            if a.target is not b.target or a.args[-1] != b.args[-1] or _shape(a) != _shape(b):
                raise StitchError(f"shard {rank}'s collective at {b.args[-1]!r} differs from shard 0's at {a.args[-1]!r}")
            if a.target is _ALL_GATHER and tuple(a.args[2:4]) != tuple(b.args[2:4]):
                raise StitchError(f"shard {rank}'s all-gather at {b.args[-1]!r} has another layout than shard 0's")
            if collectives.comm_of(b.args[1]).rank != rank:
                raise StitchError(f"graph {rank} calls the collectives of rank {collectives.comm_of(b.args[1]).rank}")


def _shape(node: fx.Node) -> tuple:
    value = node.meta.get("example_value")
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else ()


def _nbytes(node: fx.Node) -> int:
    value = node.meta.get("example_value")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _assemble(layout: list[int], dim: int, *pieces: torch.Tensor) -> torch.Tensor:
    """The all-gather's result: each rank's piece at its place along `dim` (comm/threads.py's eager_all_gather)."""
    return collectives.partition_of(layout).assemble(list(pieces), dim)


class StitchedStep:
    """The stitched graph, compiled with inductor on the first call, and how to feed it and read its output."""

    def __init__(self, module: fx.GraphModule, sources: list[list[Source]], src: Capture, rank: int, done: list) -> None:
        self.module, self.sources, self.src, self.rank, self.collectives = module, sources, src, rank, done
        self.readers = [InputReader(s) for s in sources]
        self.fields = output_builder(src.fields)
        self.compiled: Callable[..., Any] | None = None
        self.dtypes: list[torch.dtype] = []  # of the inputs it was compiled for
        self.registrations = 0  # registrations.py's count when stitched: the graph is good while it stays

    def inputs(self, per_rank_kwargs: Sequence[dict]) -> list[torch.Tensor]:
        return [x for read, kwargs in zip(self.readers, per_rank_kwargs) for x in read(kwargs)]

    def compile(self, per_rank_kwargs: Sequence[dict], *, config_patches: dict | None = None) -> None:
        """Compile the graph with inductor for these inputs' shapes (no run: nothing changes)."""
        inputs = self.inputs(per_rank_kwargs)
        self.compiled = inductor_compile(self.module, inputs, config_patches)  # (through inductor's caches)
        self.dtypes = [x.dtype for x in inputs]

    def __call__(self, per_rank_kwargs: Sequence[dict]) -> Any:
        """Every shard's step (each shard's keyword arguments, its own cache among them); shard `rank`'s output.
        StitchError, before anything runs, if an input's dtype changed since `compile` (``split.half()``): inductor's
        code checks sizes and strides, not dtypes."""
        if self.compiled is None:
            raise RuntimeError("a stitched step runs after `compile`")
        inputs = self.inputs(per_rank_kwargs)
        if [x.dtype for x in inputs] != self.dtypes:
            raise StitchError("a weight, buffer or cache changed its dtype since the step was stitched")
        outs = self.compiled(*inputs)
        for kind, nbytes, where in self.collectives:  # what the eager collectives report, once per call each
            record(kind, nbytes, "forward", where)
        return build_output(self.src.output_type, self.fields, outs, per_rank_kwargs[self.rank])
