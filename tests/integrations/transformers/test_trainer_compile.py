"""transformers.Trainer with `torch_compile=True` on an in-process split model: the Trainer compiles the model it
is given (`torch.compile(model, backend=...)`), which compiles every shard in its own thread
(engines/inprocess/compiled_shards.py); the split run logs the unsplit compiled run's losses. aot_eager traces
forward and backward graphs as inductor does, without generating code (seconds, not a minute)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import tensorshard as tp
from support.hf_configs import FAMILIES

pytestmark = pytest.mark.timeout(300)


def _losses(model, folder) -> list[float]:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    rows = [{"input_ids": (x := torch.randint(0, 96, (8,), generator=gen)), "labels": x} for _ in range(6)]
    args = TrainingArguments(
        output_dir=str(folder), use_cpu=True, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
        logging_steps=1, report_to=[], save_strategy="no", torch_compile=True, torch_compile_backend="aot_eager",
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_torch_compile_trains_a_split_model_with_the_unsplit_losses(tmp_path):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(FAMILIES["llama"][0]())
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"])
    want = _losses(ref, tmp_path / "unsplit")
    got = _losses(split, tmp_path / "split")
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-5)
