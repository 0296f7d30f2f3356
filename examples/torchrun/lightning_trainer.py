"""The Lightning tensor-parallel guide's example, with tensorshard in `configure_model`.

    python examples/torchrun/lightning_trainer.py               # CPU: 2 processes, FeedForward(256, 256)
    python examples/torchrun/lightning_trainer.py --dim 8192 --accelerator cuda

Lightning starts the processes itself. The run trains one epoch, saves a distributed checkpoint, and a
new Trainer resumes from it for a second epoch.
"""

import argparse
import os
import tempfile

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch import nn
from torch.utils.data import DataLoader

import tensorshard as tp
from tensorshard.integrations.lightning import TensorParallelStrategy


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))




class LitModel(L.LightningModule):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.model = FeedForward(dim, dim)

    def configure_model(self):
        if self.device_mesh is None:
            return
        # No plan: inferred (w1, w3 column-parallel, w2 row-parallel) and self-checked; plan={...} to choose.
        tp.parallelize(self.model, self.device_mesh["tensor_parallel"])

    def training_step(self, batch):
        return self.model(batch).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)

    def train_dataloader(self):
        # The strategy's sampler gives every tensor-parallel rank the same batches
        return DataLoader(RandomDataset(self.dim, 64), batch_size=8)


def trainer(args, epochs):
    return L.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=TensorParallelStrategy(), max_epochs=epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "tensorshard-lightning.ckpt"))
    args = parser.parse_args()
    L.seed_everything(0)

    first = trainer(args, epochs=1)
    first.fit(LitModel(args.dim))
    first.save_checkpoint(args.checkpoint)  # a folder: one shard file per rank (torch.distributed.checkpoint)

    second = trainer(args, epochs=2)
    model = LitModel(args.dim)
    second.fit(model, ckpt_path=args.checkpoint)  # resumes at epoch 1 with the saved weights and AdamW state
    local = model.model.w1.weight.to_local()
    second.print(f"resumed and trained to epoch {second.current_epoch}; rank 0 holds w1 {tuple(local.shape)} of {tuple(model.model.w1.weight.shape)}")
