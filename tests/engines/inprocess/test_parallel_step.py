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

    def shard(rank):
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
