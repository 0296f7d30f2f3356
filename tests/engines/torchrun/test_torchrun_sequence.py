"""Sequence parallelism and the vocabulary-parallel loss on a tiny Llama: the same losses as the unsplit
model, norms on sequence shards (reduce-scatter + all-gather instead of all-reduce), norm gradients
reduced in one bucket per step, and logits never gathered whole."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import tensorshard as tp
from support import tiny_llama
from support.harness import world_mesh
from support.helpers import rel_err

pytestmark = pytest.mark.timeout(120)

LAYERS, BATCH, SEQ = 2, 2, 8



def sequence_parallel_task() -> dict:
    ref = tiny_llama.build()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=tiny_llama.sequence_parallel_plan(), check_inputs=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    out = {"losses": []}
    for _ in range(3):
        ids = torch.randint(0, tiny_llama.VOCAB, (BATCH, SEQ), generator=gen)
        opt.zero_grad()
        ref_opt.zero_grad()
        with tp.count_collectives() as fwd, CommDebugMode() as torch_fwd:
            logits = model(ids).logits
            loss = tp.vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:])
        with tp.count_collectives() as bwd, CommDebugMode() as torch_bwd:
            loss.backward()
        opt.step()
        ref_loss = F.cross_entropy(ref(ids).logits[:, :-1].reshape(-1, tiny_llama.VOCAB), ids[:, 1:].reshape(-1))
        ref_loss.backward()
        ref_opt.step()
        out["losses"].append((loss.item(), ref_loss.item()))
    out["logits"] = (type(logits).__name__, tuple(logits.placements), tuple(logits.to_local().shape))
    out["forward"], out["backward"] = fwd.counts, bwd.counts
    out["largest_gather"] = max(n for _, kind, n, _ in fwd.log + bwd.log if kind == "all_gather")
    out["largest_forward"] = max(n for _, _, n, _ in fwd.log)
    out["buckets"] = [w for phase, kind, _, w in bwd.log if w.startswith("partial gradients")]
    out["torch_totals"] = (torch_fwd.get_total_counts(), torch_bwd.get_total_counts())
    with torch.no_grad():
        probe = torch.randint(0, tiny_llama.VOCAB, (BATCH, SEQ), generator=gen)
        out["after_training"] = rel_err(model(probe).logits.full_tensor(), ref(probe).logits)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tiny_llama_trains_alike_without_gathering_logits(pool2, pool4, world):
    out = (pool2 if world == 2 else pool4).run(sequence_parallel_task)[0]
    for split, single in out["losses"]:
        assert abs(split - single) <= 1e-5 * abs(single)  # fp32, 3 AdamW steps
    assert out["after_training"] < 1e-4
    assert out["logits"] == ("DTensor", (Shard(2),), (BATCH, SEQ, tiny_llama.VOCAB // world))
    # Each layer: its two norms' outputs gathered, o_proj and down_proj reduce-scattered; the final norm
    # gathered for the head; the embedding all-reduced; the loss: two all-reduces of per-token numbers.
    assert out["forward"] == {"all_gather": 2 * LAYERS + 1, "reduce_scatter": 2 * LAYERS, "all_reduce": 1 + 2}
    tie = 2 * LAYERS if world == 4 else 0  # 2 KV heads on 4 ranks: k and v weight gradients summed in pairs
    assert out["backward"] == {"reduce_scatter": 2 * LAYERS + 1, "all_gather": 2 * LAYERS + 1, "all_reduce": 1 + tie}
    assert out["buckets"] == ["partial gradients (5 tensors)"]  # 2 norms per layer + the final norm, once
    # Never the whole logits: the largest activation on the wire is a (batch, seq, hidden) one.
    assert out["largest_gather"] == out["largest_forward"] == BATCH * SEQ * 64 * 4 < BATCH * SEQ * tiny_llama.VOCAB * 4
    # CommDebugMode sees exactly our collectives: no DTensor redistribution hides in the logits slicing.
    assert out["torch_totals"] == (sum(out["forward"].values()), sum(out["backward"].values()))


def cross_entropy_task(vocab: int) -> list[float]:
    """Against F.cross_entropy on the whole logits: values and gradients, ignore_index, reductions."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, vocab, generator=gen)
    target = torch.randint(0, vocab, (3, 5), generator=gen)
    target[0, :2] = -100
    errors = []
    for reduction in ("mean", "sum", "none"):
        logits = distribute_tensor(full.clone(), world_mesh(), [Shard(2)]).requires_grad_()
        loss = tp.vocab_parallel_cross_entropy(logits, target, reduction=reduction)
        whole = full.clone().requires_grad_()
        expected = F.cross_entropy(whole.reshape(-1, vocab), target.reshape(-1), reduction=reduction)
        expected = expected.view(3, 5) if reduction == "none" else expected
        loss.sum().backward()
        expected.sum().backward()
        errors += [rel_err(loss, expected), rel_err(logits.grad.full_tensor(), whole.grad)]
    # torch's own loss_parallel() reads the same sharded logits
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        logits = distribute_tensor(full.clone(), world_mesh(), [Shard(2)])
        theirs = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    errors.append(rel_err(theirs.full_tensor(), tp.vocab_parallel_cross_entropy(logits, target)))
    return errors


@pytest.mark.parametrize("vocab", [128, 10])  # 10 over 4: torch.chunk's 3/3/3/1
def test_vocab_parallel_cross_entropy_matches_torch(pool4, vocab):
    assert max(max(e) for e in pool4.run(cross_entropy_task, vocab)) < 1e-6


def odd_length_task() -> str:
    model = tp.parallelize(tiny_llama.build(), world_mesh(), plan=tiny_llama.sequence_parallel_plan())
    with pytest.raises(ValueError, match="length 7.*multiple of 2"):
        model(torch.zeros(1, 7, dtype=torch.long))
    return "ok"


def test_sequence_length_must_divide(pool2):
    assert pool2.run(odd_length_task) == ["ok", "ok"]


def test_in_process_engine_refuses_torchrun_only_styles():
    model = tiny_llama.build()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(NotImplementedError, match="only the torchrun engine implements.*SequenceParallel"):
        tp.tensor_parallel(model, ["cpu"] * 2, plan=tiny_llama.sequence_parallel_plan())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the model is left as it was
