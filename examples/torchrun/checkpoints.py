"""Checkpoints under torchrun: each rank saves its own slices; any rank count (or one process) resumes.

    torchrun --nproc_per_node=2 examples/torchrun/checkpoints.py /tmp/ckpt    # trains 3 steps, saves
    torchrun --nproc_per_node=3 examples/torchrun/checkpoints.py /tmp/ckpt    # resumes at 3 ranks, 3 more
    python examples/torchrun/checkpoints.py /tmp/ckpt --devices 1             # and in one process

Each run loads the checkpoint in /tmp/ckpt if there is one (weights and AdamW state), trains 3 steps,
saves it back (`tp.save_sharded`), and writes the unsplit weights to /tmp/ckpt/unsplit
(`tp.save_gathered`), which a plain model or `tp.from_pretrained` loads.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tensorshard as tp


class Block(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 176) -> None:  # 176 over 3 ranks: 59/59/58
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


PLAN = tp.Plan({"*.up": tp.ColwiseParallel(), "*.down": tp.RowwiseParallel()})


def train(model, folder: Path, steps: int = 3) -> list[float]:
    """Resume from `folder` if it holds a checkpoint, train, save. Every rank calls it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    if (folder / "tensorshard.json").exists():
        tp.load_sharded(model, folder, optimizer=opt)  # any rank count, exact to the bit
        start = int(tp.checkpoint.read_index(folder)["metadata"]["step"])
    losses = []
    for step in range(start, start + steps):
        x = torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(step))  # the same batch on every rank
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    tp.save_sharded(model, folder, optimizer=opt, metadata={"step": str(start + steps)})
    tp.save_gathered(model, folder / "unsplit", progress=False)  # rank 0 writes the real weights
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--devices", type=int, default=None, help="in one process, over this many CPU slots")
    args = parser.parse_args()
    if args.devices:
        model = tp.tensor_parallel(nn.Sequential(Block(), Block()), ["cpu"] * args.devices, plan=PLAN)
        print("losses", train(model, args.folder))
        return
    dist.init_process_group("gloo")  # "nccl" and a device per rank on GPUs
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tp.parallelize(nn.Sequential(Block(), Block()), mesh, plan=PLAN)
    losses = train(model, args.folder)
    if dist.get_rank() == 0:
        print("losses", losses)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
