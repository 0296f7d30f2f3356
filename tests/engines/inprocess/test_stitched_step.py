"""Stitching shards' graphs into one (engines/inprocess/stitched_step.py), on hand-made graphs: each collective
operator becomes what the eager collective computes (the rank-ordered sum, the pieces put in place), and graphs
that differ are refused before anything runs. No split model, no compiler: the stitched graph runs as it is."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from tensorshard.comm import thread_ops as collectives
from tensorshard.comm.reduce import sum_on
from tensorshard.engines.inprocess.stitched_step import Capture, StitchError, stitch
from tensorshard.partition import Partition

pytestmark = pytest.mark.timeout(60)


class _Comm:
    """What stitching asks of a shard's ThreadComm: its rank (to check each graph calls its own shard's)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


def _capture(fn, handle: int, rank: int = 0) -> Capture:
    graph = fx.symbolic_trace(lambda x: fn(x, handle, rank))
    return Capture(graph, [lambda kwargs: kwargs["x"]], fields={"y": 0}, output_type=dict)


def _reduce_then_gather(partition: Partition):
    layout = collectives.layout_of(partition)

    def step(x, handle, rank):
        total = torch.ops.tensorshard.threads_all_reduce.default(x * 3.0, handle, "block.down_proj")
        piece = total[..., : partition.local_size(rank)] + 1.0
        return (torch.ops.tensorshard.threads_all_gather.default(piece, handle, -1, layout, "lm_head"),)

    return step


def test_collectives_become_the_eager_sum_and_gather():
    """3 shards, uneven pieces (3, 2, 2 columns): the all-reduce is the rank-ordered sum, bit for bit the eager
    one (comm/reduce.py's sum_on), and the all-gather puts each shard's piece at its place."""
    comms = [_Comm(r) for r in range(3)]
    handles = [collectives.handle_of(c) for c in comms]
    partition = Partition(7, (((0, 3),), ((3, 5),), ((5, 7),)))
    step = _reduce_then_gather(partition)
    stitched = stitch([_capture(step, h, r) for r, h in enumerate(handles)], ["cpu"] * 3, src=1)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 7, generator=g) for _ in range(3)]
    got = stitched.module(*xs)[0]
    total = sum_on([x * 3.0 for x in xs], torch.device("cpu"))
    expected = torch.cat([total[..., :n] + 1.0 for n in (3, 2, 2)], -1)
    assert torch.equal(got, expected)
    assert [kind for kind, _, _ in stitched.collectives] == ["all_reduce", "all_gather"]


def test_graphs_with_different_collectives_are_refused():
    comms = [_Comm(r) for r in range(2)]
    handles = [collectives.handle_of(c) for c in comms]

    def with_reduce(x, handle, rank):
        return (torch.ops.tensorshard.threads_all_reduce.default(x, handle, "a"),)

    def without(x, handle, rank):
        return (x * 2.0,)

    with pytest.raises(StitchError, match="shard 1 has 0 collectives, shard 0 has 1"):
        stitch([_capture(with_reduce, handles[0]), _capture(without, handles[1])], ["cpu", "cpu"], src=0)

    def elsewhere(x, handle, rank):
        return (torch.ops.tensorshard.threads_all_reduce.default(x, handle, "b"),)

    with pytest.raises(StitchError, match="differs from shard 0's"):
        stitch([_capture(with_reduce, handles[0]), _capture(elsewhere, handles[1])], ["cpu", "cpu"], src=0)


def test_a_graph_calling_another_shards_collectives_is_refused():
    comms = [_Comm(r) for r in range(2)]
    handles = [collectives.handle_of(c) for c in comms]

    def step(x, handle, rank):
        return (torch.ops.tensorshard.threads_all_reduce.default(x, handle, "a"),)

    with pytest.raises(StitchError, match="graph 1 calls the collectives of rank 0"):
        stitch([_capture(step, handles[0]), _capture(step, handles[0])], ["cpu", "cpu"], src=0)


def test_gpus_are_not_stitched():
    with pytest.raises(StitchError, match="only CPU slots"):
        stitch([], ["cuda:0", "cuda:1"], src=0)


def test_each_shard_gets_its_own_copy_of_a_collectives_result():
    """A shard changing the all-reduce's result in place (Falcon's `mlp_output += attention_output`) changes only its
    own copy, as with the eager collective: on one shared tensor both shards' `+=` would land in every shard."""
    comms = [_Comm(r) for r in range(2)]
    handles = [collectives.handle_of(c) for c in comms]

    def step(x, handle, rank):
        y = torch.ops.tensorshard.threads_all_reduce.default(x, handle, "mlp")
        return (y.add_(1.0),)  # (dynamo records Falcon's `+=` as operator.iadd: the same in-place change)

    captures = [_capture(step, h, r) for r, h in enumerate(handles)]
    x0, x1 = torch.ones(3), torch.full((3,), 2.0)
    for src in (0, 1):
        out = stitch(captures, ["cpu", "cpu"], src=src).module(x0, x1)[0]
        assert torch.equal(out, torch.full((3,), 4.0)), f"shard {src}'s result: {out}"


def test_a_stitched_step_refuses_inputs_of_another_dtype_before_running():
    """Inductor's code checks its inputs' sizes and strides, not their dtypes: a stitched step compiled for float32
    refuses float64 inputs (a model cast after stitching) with StitchError, before running anything."""
    comms = [_Comm(r) for r in range(2)]
    handles = [collectives.handle_of(c) for c in comms]
    step = _reduce_then_gather(Partition(6, (((0, 3),), ((3, 6),))))
    stitched = stitch([_capture(step, h, r) for r, h in enumerate(handles)], ["cpu"] * 2, src=0)
    per_rank = [{"x": torch.randn(2, 6, generator=torch.Generator().manual_seed(r))} for r in range(2)]
    stitched.compile(per_rank)
    assert torch.equal(stitched(per_rank)["y"], stitched.module(*[k["x"] for k in per_rank])[0])
    with pytest.raises(StitchError, match="changed its dtype"):
        stitched([{"x": k["x"].double()} for k in per_rank])


def test_the_input_reader_finds_what_each_source_finds_and_sees_a_replaced_weight():
    """`InputReader` reads a graph's inputs in one pass (weights from their modules' tables, cache tensors from the
    cache's layers, the rest through their sources): the same tensors as calling every source, in order, and a
    weight replaced in its module's table is the new one at the next call."""
    from types import SimpleNamespace

    from tensorshard.engines.graph_inputs import Argument, CacheTensor, InputReader, Item, Weight

    linear = torch.nn.Linear(3, 2)
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1), values=torch.ones(1)) for _ in range(2)])
    kwargs = {"ids": torch.tensor([[4]]), "mask": {"full": torch.ones(1, 1)}, "cache": cache}
    sources = [Argument("ids"), Weight(linear._parameters, "weight"), CacheTensor("cache", 1, "values"),
               Item("mask", "full"), Weight(linear._parameters, "bias"), CacheTensor("cache", 0, "keys"),
               lambda kw: kw["ids"]]  # (any other function of the arguments)
    read = InputReader(sources)
    assert all(a is b for a, b in zip(read(kwargs), [s(kwargs) for s in sources], strict=True))
    assert [s.steady for s in sources[:-1]] == [False, True, True, False, True, True]
    linear.weight = torch.nn.Parameter(torch.zeros(2, 3))
    assert read(kwargs)[1] is linear.weight
