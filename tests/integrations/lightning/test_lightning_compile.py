"""Lightning with an in-process split model compiled in `configure_model` (Lightning's place for torch.compile):
every shard compiled in its own thread (engines/inprocess/compiled_shards.py), the unsplit compiled model's
losses. One process, Lightning's single-device strategy on CPU; aot_eager as the backend (forward and backward
graphs, no generated code)."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import tensorshard as tp
from support import tiny_llama

pytestmark = pytest.mark.timeout(300)


class CompiledLlama(L.LightningModule):
    def __init__(self, model, devices: int) -> None:
        super().__init__()
        self.model, self.devices, self.losses = model, devices, []

    def configure_model(self):
        if self.devices > 1:
            self.model = tp.tensor_parallel(self.model, ["cpu"] * self.devices)
        self.model = torch.compile(self.model, backend="aot_eager")

    def training_step(self, batch):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def train_dataloader(self):
        ids = torch.randint(0, tiny_llama.VOCAB, (6, 12), generator=torch.Generator().manual_seed(3))
        return DataLoader(ids, batch_size=2)


def _fit(model, devices: int) -> list[float]:
    torch._dynamo.reset()
    lit = CompiledLlama(model, devices)
    L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(lit)
    return lit.losses


def test_lightning_compiles_a_split_model_in_configure_model_with_the_unsplit_losses():
    ref = tiny_llama.build().train()
    want = _fit(copy.deepcopy(ref), 1)
    got = _fit(ref, 2)
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-5)
