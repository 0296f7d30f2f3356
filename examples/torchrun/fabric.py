"""Fabric with `ModelParallelStrategy(parallelize_fn=...)`: tensor parallelism from tensorshard.

    python examples/torchrun/fabric.py               # CPU: Fabric starts 2 processes
"""

import os
import tempfile

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn

from tensorshard import ColwiseParallel, RowwiseParallel
from tensorshard.integrations.lightning import parallelize_fn


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


if __name__ == "__main__":
    plan = {"w[13]": ColwiseParallel(), "w2": RowwiseParallel()}
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(parallelize_fn=parallelize_fn(plan)))
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup(FeedForward(256, 256))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    for _ in range(5):
        batch = torch.randn(8, 256)  # same seed on every rank: the same batch
        loss = model(batch).sum()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    path = os.path.join(tempfile.gettempdir(), "tensorshard-fabric-ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 5})
    state = {"model": model, "optimizer": optimizer}
    rest = fabric.load(path, state)
    fabric.print(f"saved and reloaded at step {rest['step']}; loss {loss.item():.1f}")
