"""When the torchrun engine's traced collectives are torch's functional ones (comm/graph_collectives.py), which CUDA
graphs capture: only inside the decode step's block, on CUDA tensors of an NCCL group, without autograd. A pure
decision, checked without a process group or a GPU (the collectives themselves: test_torchrun_compile.py on gloo,
tests/gpu/test_gpu_decoding.py on NCCL)."""

from __future__ import annotations

import pytest
import torch

from tensorshard.comm import graph_collectives
from tensorshard.comm.graph_collectives import applies, backend_of, capturing_decode



class _OnCuda:
    """What `applies` reads of a tensor: its device and whether it needs a gradient."""

    def __init__(self, requires_grad: bool = False) -> None:
        self.device, self.requires_grad = torch.device("cuda", 0), requires_grad


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"])
def test_inside_the_decode_block_cuda_tensors_of_an_nccl_group_take_them(backend):
    with torch.no_grad(), capturing_decode():
        assert applies(_OnCuda(), backend) == graph_collectives.available()
    with torch.no_grad():
        assert not applies(_OnCuda(), backend)  # outside the block: the guarded operators


def test_cpu_tensors_gloo_groups_and_gradients_keep_the_guarded_operators():
    with torch.no_grad(), capturing_decode():
        assert not applies(torch.zeros(2), "gloo") and not applies(torch.zeros(2), "cpu:gloo,cuda:nccl")
        assert not applies(_OnCuda(), "gloo") and not applies(_OnCuda(), "cpu:gloo")
    with torch.enable_grad(), capturing_decode():
        assert not applies(_OnCuda(requires_grad=True), "nccl")  # autograd: comm/dist_ops.py's, with backward


def test_blocks_nest_and_restore():
    with capturing_decode() as outer:
        with capturing_decode() as inner:
            assert graph_collectives._notes is inner
        assert graph_collectives._notes is outer and graph_collectives._capturing == graph_collectives.available()
    assert graph_collectives._notes is None and graph_collectives._capturing is False


def test_the_backend_of_a_device_type():
    assert backend_of("nccl", "cuda") == "nccl" and backend_of("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_of("cpu:gloo", "cuda") == ""
