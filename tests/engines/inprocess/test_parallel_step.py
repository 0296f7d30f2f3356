"""Each shard's captured step with native collectives (engines/inprocess/parallel_step.py), on hand-made graphs run
in threads, one per shard, at the same time: the Python collective operators become the native ones, whose
all-reduce is the eager rank-ordered sum bit for bit; an all-gather the native operator cannot express (pieces
not in rank order) keeps the Python one. No split model, no compiler: the graphs run as they are."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import fx

from tensorshard.comm import thread_ops as collectives
from tensorshard.comm.native import ops as native
from tensorshard.comm.reduce import sum_on
from tensorshard.engines.inprocess.parallel_step import ParallelStep, _rank_ordered_sizes
from tensorshard.engines.inprocess.stitched_step import Capture
from tensorshard.partition import Partition

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not native.available(), reason="the native collectives cannot be built here"),
]


def _capture(partition: Partition, rank: int) -> Capture:
    layout = collectives.layout_of(partition)

    def step(x):
        total = torch.ops.tensorshard.threads_all_reduce.default(x * 3.0, 7, "block.down_proj")
        piece = total[..., : partition.local_size(rank)] + 1.0
        return (torch.ops.tensorshard.threads_all_gather.default(piece, 7, -1, layout, "lm_head"),)

    return Capture(fx.symbolic_trace(step), [lambda kwargs: kwargs["x"]], fields={"y": 0}, output_type=dict)


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and "tensorshard" in str(n.target)]


def test_collectives_become_native_and_give_the_eager_bits_in_threads():
    """3 shards at the same time, uneven pieces (3, 2, 2 columns)."""
    partition = Partition(7, (((0, 3),), ((3, 5),), ((5, 7),)))
    step = ParallelStep([_capture(partition, r) for r in range(3)], 3, timeout=30.0)
    assert all(_targets(m) == [torch.ops.tensorshard.native_all_reduce.default, torch.ops.tensorshard.native_all_gather.default] for m in step.modules)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 7, generator=g) for _ in range(3)]
    got: list = [None] * 3

    def shard(rank):  # (the graphs' collectives read the thread's rank, as ParallelStep.run sets it)
        torch.ops.tensorshard.native_set_thread_rank(step.group.handle, rank)
        got[rank] = step.modules[rank](xs[rank])[0]

    threads = [threading.Thread(target=shard, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    total = sum_on([x * 3.0 for x in xs], torch.device("cpu"))
    expected = torch.cat([total[..., :n] + 1.0 for n in (3, 2, 2)], -1)
    assert all(torch.equal(y, expected) for y in got)
    step.close()


def test_an_all_gather_out_of_rank_order_keeps_the_python_operator():
    partition = Partition(4, (((2, 4),), ((0, 2),)))  # rank 1 holds the first columns
    assert _rank_ordered_sizes(partition) is None
    assert _rank_ordered_sizes(Partition(4, (((0, 3),), ((3, 4),)))) == [3, 1]
    step = ParallelStep([_capture(partition, r) for r in range(2)], 2, timeout=30.0)
    assert all(_targets(m) == [torch.ops.tensorshard.native_all_reduce.default, collectives.all_gather] for m in step.modules)
    step.close()


def test_shards_of_an_even_split_share_one_compiled_graph(monkeypatch):
    """Shards whose graphs and input shapes are the same (an even split: the collectives read the thread's rank,
    not a rank written into the graph) are compiled once, with inductor's C++ wrapper, and run that one graph in
    their threads at the same time, each with its own rank's numbers; an uneven split compiles each shard's own."""
    compiled: list = []

    def inductor(gm, inputs, config_patches=None):  # stands in for inductor: records, runs the graph as it is
        compiled.append(config_patches)
        return gm

    monkeypatch.setattr(torch._dynamo, "lookup_backend", lambda name: inductor)
    even = Partition(4, (((0, 2),), ((2, 4),)))
    step = ParallelStep([_capture(even, r) for r in range(2)], 2, timeout=30.0)
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    step.compile([{"x": x} for x in xs])
    assert len(compiled) == 1 and step.shared == 1 and step.compiled[0] is step.compiled[1]
    assert compiled[0] == {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
    got: list = [None, None]
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, step.run(r, {"x": xs[r]}))) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    total = sum_on([x * 3.0 for x in xs], torch.device("cpu"))
    expected = torch.cat([total[..., :2] + 1.0] * 2, -1)  # (each rank's piece: the first 2 columns, plus 1)
    assert all(torch.equal(g["y"], expected) for g in got), got
    step.close()

    compiled.clear()
    uneven = ParallelStep([_capture(Partition(7, (((0, 3),), ((3, 5),), ((5, 7),))), r) for r in range(3)], 3, timeout=30.0)
    uneven.compile([{"x": torch.randn(2, 7)}] * 3)
    assert len(compiled) == 2 and uneven.shared == 1  # ranks 1 and 2 hold 2 columns each: one graph for both
    uneven.close()


def test_graphs_that_differ_by_a_vocabulary_range_become_one_with_each_ranks_numbers():
    """A vocabulary-parallel embedding writes its range into each shard's graph (`ids < 48`, `ids - 48`) and its
    padding_idx (only rank 0 holds the padding row): those ints become inputs, each rank's own, the padding_idx
    None (no forward value changes), and the shards run one graph with their own numbers."""
    weight = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))

    def capture(rank: int) -> Capture:
        start, stop, padding = 4 * rank, 4 * rank + 4, 0 if rank == 0 else None

        def step(ids, w):
            outside = (ids < start) | (ids >= stop)
            y = torch.nn.functional.embedding((ids - start).masked_fill(outside, 0), w, padding)
            y = y.masked_fill(outside.unsqueeze(-1), 0.0)
            return (torch.ops.tensorshard.threads_all_reduce.default(y, 7, "embed"),)

        return Capture(fx.symbolic_trace(step), [lambda kwargs: kwargs["ids"], lambda kwargs, r=rank: weight[4 * r: 4 * r + 4]],
                       fields={"y": 0}, output_type=dict)

    step = ParallelStep([capture(r) for r in range(2)], 2, timeout=30.0)
    assert step.modules[0] is step.modules[1]
    assert [[int(n) for n in numbers] for numbers in step.numbers] == [[0, 4, 0], [4, 8, 4]]  # (lt, ge, sub)
    ids = torch.tensor([[0, 3, 5, 7, 2]])
    got: list = [None, None]

    def shard(rank):
        torch.ops.tensorshard.native_set_thread_rank(step.group.handle, rank)
        got[rank] = step.modules[rank](ids, weight[4 * rank: 4 * rank + 4], *step.numbers[rank])[0]

    threads = [threading.Thread(target=shard, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert torch.equal(got[0], torch.nn.functional.embedding(ids, weight)) and torch.equal(got[1], got[0])
    step.close()
