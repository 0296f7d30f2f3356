"""Lightning with a split model compiled in `configure_model` (Lightning's place for torch.compile), the unsplit
compiled model's losses: in one process (every shard compiled in its own thread: engines/inprocess/compiled_shards.py;
Lightning's single-device strategy on CPU), and under torchrun (`ModelParallelStrategy`, 2 gloo ranks of the process
pool: `tp.parallelize` on the strategy's mesh, then torch.compile; the collectives are graph operators,
comm/dist_ops.py). aot_eager as the backend (forward and backward graphs, no generated code)."""

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

        self.batches = []

    def configure_model(self):
        if self.devices == "torchrun":
            tp.parallelize(self.model, self.device_mesh["tensor_parallel"], check_inputs=0)
        elif self.devices > 1:
            self.model = tp.tensor_parallel(self.model, ["cpu"] * self.devices)
        self.model = torch.compile(self.model, backend="aot_eager")

    def training_step(self, batch):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        self.batches.append(batch.clone())
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


def torchrun_task() -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch._dynamo.reset()
    ref = tiny_llama.build().train()
    lit = CompiledLlama(copy.deepcopy(ref), "torchrun")
    L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(lit)
    unsplit = torch.compile(ref, backend="aot_eager")  # the same steps on the batches the Trainer fed
    optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for batch in lit.batches:
        loss = unsplit(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    return {"got": lit.losses, "want": want}


def test_lightning_compiles_a_model_parallelized_under_torchrun_with_the_unsplit_losses(pool2):
    for out in pool2.run(torchrun_task, timeout=280):
        assert len(out["got"]) == 3 and out["got"] == pytest.approx(out["want"], rel=1e-5)
