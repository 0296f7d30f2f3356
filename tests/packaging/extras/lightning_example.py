"""tensorshard[lightning]: Lightning's Trainer fits a model split in-process over 2 CPU slots, and the strategy
for torchrun-style runs imports."""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import tensorshard as tp
from tensorshard.integrations.lightning import TensorParallelStrategy  # noqa: F401  (Trainer(devices=N) runs)


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        self.net = tp.tensor_parallel(net, ["cpu", "cpu"])

    def training_step(self, batch):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = DataLoader(TensorDataset(torch.randn(32, 16)), batch_size=8)
lit = Lit()
before = lit.net(torch.ones(1, 16)).detach()
L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
          enable_progress_bar=False, enable_model_summary=False).fit(lit, data)
assert not torch.allclose(lit.net(torch.ones(1, 16)), before), "training changed nothing"
print("lightning ok")
