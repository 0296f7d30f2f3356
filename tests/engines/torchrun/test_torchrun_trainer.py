"""transformers.Trainer under torchrun trains a model split by tp.parallelize, compiled or not, with the unsplit
model's losses.

The split model tells the Trainer it owns its placement and gradient reduction (integrations/hf_trainer.py), so
accelerate does not wrap it in DistributedDataParallel across the tensor-parallel ranks; DDP itself refuses it
naming the fix (engines/torchrun/ddp_refusal.py). Every rank of the group must see the same batch: the Trainer's
own sampler gives each rank its own, which the input check refuses naming the fix (tp.TensorParallelSampler from
`get_train_dataloader`); compiled, that check does not run (a graph holds no host-side work). `save_model` gathers
on every rank and rank 0 writes the unsplit weights. The reference is the unsplit model's Trainer run in this process, on the same batches.
aot_eager traces the forward and backward graphs as inductor would, without generating code."""

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import tensorshard as tp
from tensorshard.comm.objects import gather_objects
from support import tiny_llama
from support.harness import world_mesh

pytestmark = pytest.mark.timeout(600)
STEPS = 3


def _rows() -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    return [{"input_ids": (x := torch.randint(0, tiny_llama.VOCAB, (8,), generator=gen)), "labels": x} for _ in range(8)]


def _args(folder: str, compiled: bool):
    from transformers import TrainingArguments

    compile_args = {"torch_compile": True, "torch_compile_backend": "aot_eager"} if compiled else {}
    return TrainingArguments(  # a torch_compile_backend alone switches torch_compile on: only when compiled
        output_dir=folder, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2,
        logging_steps=1, report_to=[], save_strategy="no", **compile_args,
    )


def _train(model, rows, compiled: bool, sampler=None, save: str | None = None) -> tuple[list[float], str]:
    """STEPS Trainer steps; `sampler`: batches drawn by it (the Trainer's own sampler if None); `save`: a folder
    the Trainer saves the model to at the end (its weights only)."""
    from transformers import Trainer

    class SameBatches(Trainer):
        def get_train_dataloader(self):
            return DataLoader(self.train_dataset, batch_size=self._train_batch_size, sampler=sampler,
                              collate_fn=self.data_collator)

    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as folder:
        trainer = (Trainer if sampler is None else SameBatches)(model=model, args=_args(folder, compiled),
                                                               train_dataset=rows)
        trainer.train()
        if save is not None:
            trainer.save_model(save)  # every rank joins the gathers, rank 0 writes
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], type(trainer.model_wrapped).__name__


def trainer_task(compiled: bool) -> dict:
    from transformers import AutoModelForCausalLM

    rows, mesh = _rows(), world_mesh()
    model = tp.parallelize(tiny_llama.build().train(), mesh, plan=tiny_llama.plan())
    with tempfile.TemporaryDirectory() as folder:
        folder = gather_objects(folder, mesh.get_group(), what="the save folder")[0]  # rank 0's
        losses, wrapper = _train(model, rows, compiled, tp.TensorParallelSampler(rows, mesh, seed=0), save=folder)
        dist.barrier()
        saved_error = None
        if dist.get_rank() == 0:  # the saved model, unsplit, gives the split model's logits
            saved = AutoModelForCausalLM.from_pretrained(folder).eval()
        model.eval()
        ids = torch.stack([row["input_ids"] for row in rows[:2]])
        with torch.no_grad():
            logits = model(ids).logits
        if dist.get_rank() == 0:
            with torch.no_grad():
                saved_error = (saved(ids).logits - logits).abs().max().item()
        dist.barrier()
    try:
        torch.nn.parallel.DistributedDataParallel(model)
        refused = None
    except tp.engines.torchrun.ddp_refusal.DDPRefusedError as e:
        refused = str(e)
    mismatch = None
    if not compiled:  # compiled, the input check does not run (docs/finetuning.md)
        try:  # the Trainer's own sampler: each rank its own batch
            _train(tp.parallelize(tiny_llama.build().train(), mesh, plan=tiny_llama.plan()), rows, compiled)
        except tp.InputMismatchError as e:
            mismatch = str(e)
    return {"losses": losses, "wrapper": wrapper, "refused": refused, "mismatch": mismatch, "saved": saved_error}


@pytest.mark.parametrize("compiled", [False, True])
def test_trainer_under_torchrun_trains_a_split_model_with_the_unsplit_losses(pool2, compiled):
    rows = _rows()  # the unsplit model here, one process, the same batches (one replica of the same sampler)
    sampler = DistributedSampler(rows, num_replicas=1, rank=0, seed=0)
    want, wrapper = _train(tiny_llama.build().train(), rows, compiled, sampler)
    assert len(want) == STEPS
    outs = pool2.run(trainer_task, compiled, timeout=540)
    assert outs[0]["saved"] < 1e-5  # rank 0 loaded what the Trainer saved (unsplit): the split model's logits
    for out in outs:
        assert out["losses"] == pytest.approx(want, rel=1e-5)
        # no DDP around the split model: compiled (accelerate's torch.compile) or the model itself
        assert out["wrapper"] == wrapper == ("OptimizedModule" if compiled else "LlamaForCausalLM")
        assert "split over 2 tensor-parallel ranks" in out["refused"] and "FSDP2" in out["refused"]
        if not compiled:
            assert out["mismatch"] is not None and "TensorParallelSampler" in out["mismatch"]
            assert "get_train_dataloader" in out["mismatch"]
