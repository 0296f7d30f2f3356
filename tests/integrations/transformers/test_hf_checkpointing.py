"""transformers' gradient checkpointing on a split model, enabled before or after splitting: every shard
recomputes its decoder layers in its own backward pass; loss and gradients match the unsplit model with
the same checkpointing."""

import copy
import warnings

import pytest
import torch
import transformers as T

import tensorshard as tp
from support.helpers import rel_err
from support.hf_configs import VOCAB, tiny_model
from support.hf_parity import gathered_grads, unsplit_state

pytestmark = pytest.mark.timeout(120)


def enable(model, reentrant: bool = False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def counted_step(model, ids):
    with tp.count_collectives() as counted:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss, counted


@pytest.mark.parametrize("when", ["before", "after", "before, reentrant"])
@pytest.mark.parametrize("n", [2, 3])
def test_gradient_checkpointing_matches_the_unsplit_model(when, n, gen):
    ref = tiny_model("llama").train()
    plain = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n)  # in train mode: ZeRO-3 partitions the norms
    unsplit = copy.deepcopy(ref)
    reentrant = when.endswith("reentrant")  # transformers 4's default
    if when.startswith("before"):  # the usual order: from_pretrained, gradient_checkpointing_enable(), split
        enable(ref, reentrant)
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n)
    if when == "after":
        enable(model)
    enable(unsplit, reentrant)
    assert all(layer.gradient_checkpointing for shard in model.module_shards for layer in shard.model.layers)
    ids = torch.randint(1, VOCAB, (2, 10), generator=gen)
    loss, counted = counted_step(model, ids)
    ref_loss = unsplit(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert rel_err(loss, ref_loss) < 1e-5
    grads = gathered_grads(model)
    assert grads.keys() == {k for k, p in unsplit.named_parameters()}
    worst = max(rel_err(grads[k], p.grad) for k, p in unsplit.named_parameters())
    assert worst < 1e-5, worst
    # Without checkpointing the split model computes the same gradients, to the bit, with the same backward
    # collectives (2 per layer and the head's); checkpointing adds the recomputed layers' forward all-reduces
    # and the gathers of their ZeRO-3 partitioned norm weights.
    plain_loss, plain_counted = counted_step(plain, ids)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, grads[k]) for k, g in gathered_grads(plain).items())
    assert plain_counted.backward == counted.backward
    layers = ref.config.num_hidden_layers
    assert 0 < counted.forward["all_reduce"] - plain_counted.forward["all_reduce"] <= 2 * layers
    assert 0 < counted.forward["all_gather"] - plain_counted.forward["all_gather"] <= 2 * layers


def train(model, ids, folder) -> list[float]:
    """Three AdamW steps of transformers' Trainer with gradient_checkpointing=True; the logged losses."""
    args = T.TrainingArguments(
        str(folder), gradient_checkpointing=True, use_cpu=True, max_steps=3, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = T.Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_with_gradient_checkpointing_matches_the_unsplit_model(gen, tmp_path):
    ref = tiny_model("llama").train()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2)
    ids = torch.randint(1, VOCAB, (12, 10), generator=gen)
    losses = train(model, ids, tmp_path / "split")
    assert all(layer.gradient_checkpointing for shard in model.module_shards for layer in shard.model.layers)
    ref_losses = train(ref, ids, tmp_path / "unsplit")
    assert len(losses) == 3 and all(abs(a - b) < 1e-4 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    weights = unsplit_state(model)
    assert max(rel_err(weights[k], p) for k, p in ref.named_parameters()) < 1e-4


@pytest.mark.parametrize("order", ["lora then split", "split then lora", "lora, split, then enabled"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_lora_with_gradient_checkpointing_matches_the_unsplit_model(order, reentrant, gen, tmp_path):
    """LoRA factors with partial gradients (A beside column-parallel layers, B beside row-parallel ones) keep
    their sums when their blocks are recomputed in backward: three AdamW steps track the unsplit run."""
    from peft import LoraConfig, PeftModel, get_peft_model

    def lora(model):
        torch.manual_seed(1)  # init_lora_weights=False: B is random too, so the adapter matters from the first step
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))

    def enable_with_inputs(model):
        enable(model, reentrant)
        model.enable_input_require_grads()  # as PEFT does for reentrant checkpointing: the embeddings stay frozen

    base = tiny_model("llama").train()
    if order == "lora, split, then enabled":  # through the PeftModel, which hands both calls to the model inside
        ref = lora(copy.deepcopy(base))
        model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2)
        for m in (ref, model):
            enable_with_inputs(m)
        assert all(layer.gradient_checkpointing for shard in model.module_shards
                   for layer in shard.get_base_model().model.layers)
    else:
        enable_with_inputs(base)
    if order == "lora then split":
        ref = lora(copy.deepcopy(base))
        model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2)
    elif order == "split then lora":  # the adapters follow the split; the unsplit run loads the same adapter
        model = lora(tp.tensor_parallel(copy.deepcopy(base), ["cpu"] * 2))
        model.save_pretrained(tmp_path / "adapter")  # PEFT's own, on the PeftModel around the split model
        ref = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter", is_trainable=True)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, ref)]
    for step in range(3):
        ids = torch.randint(1, VOCAB, (2, 10), generator=gen)
        with tp.count_collectives() as counted:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        assert rel_err(loss, ref_loss) < 1e-4, (step, loss, ref_loss)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    # Non-reentrant recomputation only refills saved tensors: the factors' gradients are summed once per pass, as
    # without checkpointing. Reentrant recomputation builds the blocks' graphs anew: each module holding factors
    # sums its own, once per recomputed block.
    sums = [w for phase, kind, _, w in counted.log if w.startswith("partial gradients")]
    if reentrant:
        assert len(sums) >= base.config.num_hidden_layers and all(w.endswith("(recomputed)") for w in sums), sums
    else:
        assert sums == ["partial gradients"]
