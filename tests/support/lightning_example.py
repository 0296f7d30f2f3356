"""The Lightning tensor-parallel guide's example, with tensorshard in `configure_model`.

Used by the Trainer / Fabric tests in the process pool and by the script Lightning launches itself.
"""

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch.utils.data import DataLoader, DistributedSampler

import tensorshard as tp
from support.models import FeedForward

# The plan tensorshard infers for FeedForward, written out (the Fabric test passes it explicitly).
PLAN = {"w1": tp.ColwiseParallel(), "w2": tp.RowwiseParallel(), "w3": tp.ColwiseParallel()}


class LitModel(L.LightningModule):
    def __init__(self, dim: int = 256):
        super().__init__()
        self.model = FeedForward(dim, dim)
        self.data = RandomDataset(dim, 64)  # made here (not in train_dataloader) so a test can replay it

    def configure_model(self):
        if self.device_mesh is None:
            return
        tp.parallelize(self.model, self.device_mesh["tensor_parallel"])  # no plan: inferred and self-checked

    def training_step(self, batch):
        return self.model(batch).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)

    def train_dataloader(self):
        # The strategy's sampler gives every tensor-parallel rank the same batches.
        return DataLoader(self.data, batch_size=8)


def trainer(**kwargs) -> L.Trainer:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsplit weights of a parallelized FeedForward (DTensor.full_tensor of each parameter)."""
    return {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}


def lightning_batches(data, epochs: int) -> list[torch.Tensor]:
    """The batches the Trainer feeds: its DistributedSampler over the data-parallel replicas (one here)
    shuffles with seed 0, reseeded by epoch."""
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out += list(DataLoader(data, batch_size=8, sampler=sampler))
    return out


def train_unsplit(model: torch.nn.Module, batches) -> dict[str, torch.Tensor]:
    """The same training in one process without tensor parallelism: the weights it ends with."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in batches:
        opt.zero_grad()
        model(batch).sum().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
