"""Past two devices: 4 and 8 CPU slots give the unsplit model's numbers, including the collectives that CPU slots
compute together (an all-reduce of 256 KiB or more: each shard sums one chunk into every shard's result)."""

import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err, split_copy, train_causal_lms
from support.models import FeedForward
from tensorshard.comm.reduce import EACH_MIN_BYTES, sum_chunk_into, sum_on

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("numel", [1, 15, 17, 16 * 8 + 3, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_sums_are_the_rank_ordered_sum_to_the_bit(n, numel, dtype, gen):
    inputs = [torch.randn(numel, generator=gen).to(dtype) for _ in range(n)]
    outputs = [torch.full((numel,), float("nan"), dtype=dtype) for _ in range(n)]
    for rank in range(n):  # the shards' parts, in any order: each writes only its own chunk
        sum_chunk_into(inputs, outputs, n - 1 - rank)
    expected = sum_on(inputs, torch.device("cpu"))
    assert all(torch.equal(out, expected) for out in outputs)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_training_with_large_collectives_matches_unsplit(n, gen):
    dim, hidden, tokens = 256, 512, 300  # (300, 256) float32 activations: 300 KiB, above EACH_MIN_BYTES
    assert tokens * dim * 4 >= EACH_MIN_BYTES
    torch.manual_seed(0)
    ref = FeedForward(dim, hidden)
    model = split_copy(ref, n)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]  # the split one steps per shard
    for _ in range(3):
        x = torch.randn(tokens, dim, generator=gen, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        outs = []
        for m, opt, inp in ((ref, opts[0], x), (model, opts[1], x2)):
            out = m(inp)
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
            outs.append(out)
        assert rel_err(outs[1], outs[0]) < 1e-5  # float rounding: the sums run in another order
        assert rel_err(x2.grad, x.grad) < 1e-5
    with tp.save_tensor_parallel(model):
        trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert trained.keys() == ref.state_dict().keys()
    assert all(rel_err(trained[k], v) < 1e-4 for k, v in ref.state_dict().items())


@pytest.mark.parametrize("n", [4, 8])
def test_a_llama_at_many_devices_decodes_and_trains_as_unsplit(n, gen):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(  # 8 query heads over 2 KV heads (each KV head on 4 devices at 8), an uneven vocabulary
        hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=301, max_position_embeddings=64,
    )
    ref = LlamaForCausalLM(config).eval()
    model = split_copy(ref, n)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=gen)
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref(ids).logits) < 1e-5
        prompt = ids[:1, :5]
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False),
                           ref.generate(prompt, max_new_tokens=8, do_sample=False))
    ref.train(), model.train()
    losses = [list(run) for run in zip(*train_causal_lms((ref, model), [ids] * 3))]  # per model: its 3 losses
    assert losses[0][-1] != losses[0][0]  # it trained
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(*losses))
