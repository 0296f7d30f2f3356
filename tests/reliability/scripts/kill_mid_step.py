"""Run by test_torchrun_faults.py under `torchrun --nproc_per_node=2`: training steps on a split model;
rank 1 kills itself (SIGKILL) inside the third step, between the forward's two all-reduces."""

import os
import signal
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tensorshard as tp
from support import plans
from support.models import TwoBlocks


def kill_self(*_):
    print(f"rank 1 killing itself at {time.monotonic()}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tp.parallelize(TwoBlocks(), init_device_mesh("cpu", (dist.get_world_size(),)), plan=plans.TWO_BLOCKS)
    gen = torch.Generator().manual_seed(0)
    for i in range(4):
        if i == 2 and rank == 1:
            model.b2.register_forward_pre_hook(kill_self)
        model(torch.randn(4, 8, generator=gen)).sum().backward()
        print(f"rank {rank} step {i}", flush=True)
    print(f"rank {rank} finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
