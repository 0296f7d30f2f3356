"""Two GPUs in one process: the in-process engine's collectives between distinct GPUs go through NCCL
(`torch.cuda.nccl`), or through peer copies with TENSOR_PARALLEL_USE_NATIVE=1 (comm/reduce.py). Both paths give
the unsplit model's outputs and training, and every device the same result of a reduction."""

import copy

import pytest
import torch
import torch.cuda.nccl as nccl

import tensorshard as tp
from support import plans
from support.gpu import TWO_GPUS, assert_on_their_devices
from support.helpers import check_training_parity, rel_err
from support.hf_configs import VOCAB, tiny_model
from support.models import Transformer

pytestmark = TWO_GPUS + [pytest.mark.timeout(300)]

DEVICES = ["cuda:0", "cuda:1"]


@pytest.fixture
def nccl_calls(monkeypatch):
    """How many times the engine called NCCL's all-reduce."""
    calls = []
    real = nccl.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(nccl, "all_reduce", counting)
    return calls


@pytest.mark.parametrize("native", [False, True], ids=["nccl", "peer-copies"])
def test_transformer_trains_like_unsplit_on_either_path(native, nccl_calls, monkeypatch, gen):
    monkeypatch.setenv("TENSOR_PARALLEL_USE_NATIVE", "1" if native else "0")
    torch.manual_seed(0)
    ref = Transformer(n_heads=8, n_kv_heads=2)
    model = tp.tensor_parallel(copy.deepcopy(ref), DEVICES, plan=plans.transformer(8, 2), sharded=False)
    assert_on_their_devices(model, DEVICES)
    check_training_parity(ref, model, lambda: torch.randint(0, 96, (2, 7), generator=gen), forward_tol=1e-4, train_tol=1e-3)
    assert (len(nccl_calls) == 0) if native else (len(nccl_calls) > 0)


def test_both_paths_agree_and_every_device_gets_the_same_sum(monkeypatch, gen):
    from tensorshard.comm.reduce import sum_to_all

    parts = [torch.randn(1000, generator=gen).to(d) for d in DEVICES]
    results = {}
    for native in ("0", "1"):
        monkeypatch.setenv("TENSOR_PARALLEL_USE_NATIVE", native)
        outs = sum_to_all(parts, [torch.device(d) for d in DEVICES])
        assert [o.device for o in outs] == [torch.device(d) for d in DEVICES]
        assert torch.equal(outs[0].cpu(), outs[1].cpu())  # bit-identical on every device
        results[native] = outs[0].cpu()
    # two addends: a + b in either order is the same float, whichever path adds them
    assert torch.equal(results["0"], results["1"])
    assert torch.equal(results["0"], parts[0].cpu() + parts[1].cpu())


@pytest.mark.parametrize("native", [False, True], ids=["nccl", "peer-copies"])
def test_llama_greedy_decoding_and_training_on_two_gpus(native, monkeypatch, gen):
    monkeypatch.setenv("TENSOR_PARALLEL_USE_NATIVE", "1" if native else "0")
    ref = tiny_model("llama")
    model = tp.tensor_parallel(copy.deepcopy(ref), DEVICES)
    ids = torch.randint(1, VOCAB, (2, 9), generator=gen)
    with torch.no_grad():
        assert rel_err(model(input_ids=ids.to(model.device)).logits, ref(input_ids=ids).logits) < 1e-4
    generate = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1].to(model.device), **generate).cpu(), ref.generate(ids[:1], **generate))
    model.train(), ref.train()
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    for _ in range(3):
        x = torch.randint(1, VOCAB, (2, 8), generator=gen)
        losses = []
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            loss = m(input_ids=x.to(m.device), labels=x.to(m.device)).loss
            loss.backward()
            o.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-4)
