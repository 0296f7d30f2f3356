"""transformers.Trainer driving a split model (in-process engine), with default TrainingArguments (use_cpu=True).

The split run must log the unsplit run's training and evaluation losses (1e-4 relative; gradient clipping is on
by default, so the gradient norm must be exact too), write checkpoints and a final model that unsplit models
load with the same outputs, and resume from a checkpoint with the same losses. Also: outputs modifiable in
place and save_pretrained's options. Activation checkpointing under the Trainer: test_hf_checkpointing.py.
"""

from __future__ import annotations

import copy
import shutil
import sys
import threading

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import tensorshard as tp
from support.hf_configs import FAMILIES
from support.helpers import rel_err

pytestmark = pytest.mark.timeout(120)


def tiny():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES["llama"][0]())


def dataset(n: int = 12):
    gen = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(n):
        x = torch.randint(0, 96, (8,), generator=gen)
        rows.append({"input_ids": x, "labels": x})
    return rows


def train(model, folder, *, resume=None):
    """4 steps, a checkpoint and an evaluation every 2; returns (training losses, evaluation losses)."""
    args = TrainingArguments(
        output_dir=str(folder), use_cpu=True, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2,
        save_steps=2, eval_strategy="steps", eval_steps=2, logging_steps=1, report_to=[],
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset(4))
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(folder / "final"))
    history = trainer.state.log_history
    return [h["loss"] for h in history if "loss" in h], [h["eval_loss"] for h in history if "eval_loss" in h]


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= 1e-4 * abs(w) for g, w in zip(got, want))


def lora(model):
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "o_proj", "gate_proj", "down_proj"],
                                            init_lora_weights=False, modules_to_save=["lm_head"]))


@pytest.fixture(scope="module")
def unsplit_run(tmp_path_factory):
    """The unsplit model's run, once for every device count: (losses, its folder)."""
    folder = tmp_path_factory.mktemp("trainer") / "unsplit"
    return train(tiny(), folder), folder


@pytest.mark.parametrize("n", [1, 2, 3])
def test_trainer_trains_evaluates_saves_and_resumes(tmp_path, n, monkeypatch, unsplit_run):
    original = tiny()
    want, unsplit_folder = unsplit_run
    stepped = set()  # the threads that ran the Trainer's AdamW update on some parameters
    adam = sys.modules[torch.optim.Adam.__module__]

    def recording(params, *args, _update=adam.adam, **kwargs):
        if params:
            stepped.add(threading.current_thread().name)
        return _update(params, *args, **kwargs)

    monkeypatch.setattr(adam, "adam", recording)
    got = train(tp.tensor_parallel(copy.deepcopy(original), ["cpu"] * n), tmp_path / "split")
    # the Trainer's own optimizer stepped every device's parameters in that device's thread (default_step.py)
    assert stepped == {threading.current_thread().name, *(f"tensorshard-{r}" for r in range(1, n))}
    assert close(got[0], want[0]) and close(got[1], want[1])
    ids = dataset(1)[0]["input_ids"][None]
    for folder in ("checkpoint-2", "final"):  # checkpoints are plain transformers checkpoints
        with torch.no_grad():
            reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "split" / folder).eval()
            expected = AutoModelForCausalLM.from_pretrained(unsplit_folder / folder).eval()
            assert rel_err(reloaded(ids).logits, expected(ids).logits) < 1e-4  # after training: the loss tolerance
    resumed = train(tp.tensor_parallel(copy.deepcopy(original), ["cpu"] * n), tmp_path / "split", resume=tmp_path / "split" / "checkpoint-2")
    assert close(resumed[0], want[0]) and close(resumed[1], want[1])


def test_trainer_with_a_split_peft_model(tmp_path):
    original = lora(tiny())
    want = train(copy.deepcopy(original), tmp_path / "unsplit")
    got = train(tp.tensor_parallel(copy.deepcopy(original), ["cpu"] * 2), tmp_path / "split")
    assert close(got[0], want[0]) and close(got[1], want[1])
    ids = dataset(1)[0]["input_ids"][None]
    with torch.no_grad():  # the adapter checkpoint loads into an unsplit model with plain PEFT
        loaded = PeftModel.from_pretrained(tiny(), tmp_path / "split" / "checkpoint-4").eval()
        expected = PeftModel.from_pretrained(tiny(), tmp_path / "unsplit" / "checkpoint-4").eval()
        assert rel_err(loaded(input_ids=ids).logits, expected(input_ids=ids).logits) < 1e-4  # after training
    resumed = train(tp.tensor_parallel(copy.deepcopy(original), ["cpu"] * 2), tmp_path / "split", resume=tmp_path / "split" / "checkpoint-2")
    assert close(resumed[0], want[0])


def test_outputs_allow_in_place_operations():
    model = tp.tensor_parallel(tiny(), ["cpu"] * 2)
    x = dataset(1)[0]["input_ids"][None]
    out = model(input_ids=x, labels=x)
    out.loss *= 0.5  # Trainer.compute_loss does this
    out.loss.backward()
    y = tp.tensor_parallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)), ["cpu"] * 2)(torch.randn(2, 8))
    y *= 2
    y.sum().backward()


def test_save_pretrained_accepts_transformers_options(tmp_path):
    original = tiny().eval()
    model = tp.tensor_parallel(copy.deepcopy(original), ["cpu"] * 3)
    model.save_pretrained(tmp_path, state_dict=None, safe_serialization=True, max_shard_size="100KB", is_main_process=True)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1  # sharded files, as transformers writes them
    x = dataset(1)[0]["input_ids"][None]
    with torch.no_grad():
        assert rel_err(AutoModelForCausalLM.from_pretrained(tmp_path)(x).logits, original(x).logits) < 1e-5


def test_trainer_with_an_adapter_added_after_splitting_saves_reloads_and_resumes(tmp_path):
    """The order people write: split, get_peft_model, Trainer with a checkpoint every step. The run logs the unsplit
    PeftModel's losses (and gradient norms: clipping is on); each checkpoint is PEFT's format, loaded by plain PEFT
    into an unsplit base with the unsplit run's outputs; a fresh split model resumed from a checkpoint
    (resume_from_checkpoint=True) logs the losses the uninterrupted run had."""
    def late():
        torch.manual_seed(1)
        return lora(tp.tensor_parallel(tiny(), ["cpu"] * 2))  # a train-mode split: ZeRO-3 on, as by default

    def run(model, folder, resume=None):
        args = TrainingArguments(output_dir=str(folder), use_cpu=True, max_steps=3, per_device_train_batch_size=2,
                                 learning_rate=1e-2, save_steps=1, logging_steps=1, report_to=[])
        trainer = Trainer(model=model, args=args, train_dataset=dataset())
        trainer.train(resume_from_checkpoint=resume)
        return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]

    model = late()
    model.save_pretrained(tmp_path / "start")  # the adapter the split model adopted, for the unsplit run
    want = run(PeftModel.from_pretrained(tiny(), tmp_path / "start", is_trainable=True), tmp_path / "unsplit")
    got = run(model, tmp_path / "split")
    assert close([loss for loss, _ in got], [loss for loss, _ in want])
    assert close([norm for _, norm in got], [norm for _, norm in want])
    ids = dataset(1)[0]["input_ids"][None]
    for step in (1, 2, 3):
        with torch.no_grad():
            loaded = PeftModel.from_pretrained(tiny(), tmp_path / "split" / f"checkpoint-{step}").eval()
            expected = PeftModel.from_pretrained(tiny(), tmp_path / "unsplit" / f"checkpoint-{step}").eval()
            assert rel_err(loaded(input_ids=ids).logits, expected(input_ids=ids).logits) < 1e-4  # after training
    shutil.rmtree(tmp_path / "split" / "checkpoint-3")  # resume from the newest left, checkpoint-2
    resumed = run(late(), tmp_path / "split", resume=True)
    assert close([loss for loss, _ in resumed], [loss for loss, _ in want])
