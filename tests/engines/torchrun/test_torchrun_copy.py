"""copy.deepcopy of a parallelized model (engines/torchrun/copies.py): a second split model on the same mesh and
process group, with its own state and modules. Training the copy matches the unsplit model trained alike (losses
within 1e-5: the same math, only the reduction order differs) and leaves the original bit-identical; an EMA copy
takes the original's state dict. GPT-2 with 9 heads (uneven over 2 ranks) and its tied embedding / lm_head."""

import copy
import threading

import pytest
import torch
import torch.distributed as dist
import transformers as T
from torch import nn

import tensorshard as tp
from support.harness import world_mesh

pytestmark = pytest.mark.timeout(180)


def gpt2() -> T.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = T.GPT2Config(vocab_size=96, n_layer=2, n_positions=32, n_embd=72, n_head=9, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0)
    return T.GPT2LMHeadModel(config).train()


def ids(step: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(step))


def train(model, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = model(input_ids=ids(step), labels=ids(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def local_tensors(model) -> dict[str, torch.Tensor]:
    return {n: (t.to_local() if hasattr(t, "to_local") else t).detach().clone() for n, t in model.state_dict().items()}


def copy_and_train_task() -> dict:
    ref = gpt2()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh())
    before = local_tensors(model)
    twin = copy.deepcopy(model)
    state, twin_state = model.tensorshard, twin.tensorshard
    shared = {id(p) for p in model.parameters()} & {id(p) for p in twin.parameters()}
    got = train(twin)
    after = local_tensors(model)
    return {
        "got": got,
        "reference": train(ref),
        "original_changed": [n for n in before if not torch.equal(before[n], after[n])],
        "twin_moved": any(not torch.equal(after[n], t) for n, t in local_tensors(twin).items()),
        "shared_parameters": len(shared),
        "own_state": twin_state is not state and twin_state.comm is not state.comm,
        "same_group": twin_state.comm.group is state.comm.group and twin_state.mesh == state.mesh,
        "tied": twin.lm_head.weight is twin.transformer.wte.weight,
        "original_still_runs": model(input_ids=ids(0)).logits.shape == (2, 12, 96),
    }


def test_deepcopy_of_a_parallelized_model_trains_like_the_unsplit_model(pool2):
    for r in pool2.run(copy_and_train_task):
        assert r["got"] == pytest.approx(r["reference"], rel=1e-5)
        assert r["original_changed"] == []  # training the copy leaves the original alone
        assert r["twin_moved"] and r["shared_parameters"] == 0
        assert r["own_state"] and r["same_group"] and r["tied"] and r["original_still_runs"]


def ema_task() -> float:
    model = tp.parallelize(gpt2(), world_mesh())
    ema = copy.deepcopy(model).eval()
    train(model, steps=1)
    ema.load_state_dict(model.state_dict())  # the usual EMA start: the copy takes the trained weights
    model.eval()
    with torch.no_grad():
        return (ema(input_ids=ids(5)).logits - model(input_ids=ids(5)).logits).abs().max().item()


def test_an_ema_copy_loads_the_originals_state_dict(pool2):
    assert pool2.run(ema_task) == [0.0, 0.0]


class Locked(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.lock = threading.Lock()  # cannot be deep-copied

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def uncopyable_task() -> str:
    model = tp.parallelize(Locked(), world_mesh(), plan={"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()})
    model(torch.randn(2, 8, generator=torch.Generator().manual_seed(0)))  # parallelize still works
    try:
        copy.deepcopy(model)
    except TypeError as e:
        dist.barrier()
        return str(e)
    return "copied"


def test_a_model_that_cannot_be_copied_names_the_fix(pool2):
    for message in pool2.run(uncopyable_task):
        assert "could not be deep-copied before splitting" in message and "lock" in message
        assert "Copy the model before tp.parallelize" in message
