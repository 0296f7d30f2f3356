"""Generation under torchrun: greedy decoding and seeded sampling give the same tokens on every rank
(and greedy gives the unsplit model's tokens)."""

import copy
import inspect

import pytest
import torch
import torch.distributed as dist

import tensorshard as tp
from support import tiny_llama
from support.harness import world_mesh

pytestmark = pytest.mark.timeout(120)


def generate_task() -> dict:
    ref = tiny_llama.build()
    mesh = world_mesh()
    model = tp.parallelize(copy.deepcopy(ref), mesh, plan=tiny_llama.plan())
    prompt = torch.randint(0, tiny_llama.VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=8, pad_token_id=0)
    with torch.no_grad():
        greedy = model.generate(prompt, do_sample=False, **settings)
        expected = ref.generate(prompt, do_sample=False, **settings)
        torch.manual_seed(dist.get_rank())  # ranks' generators differ ...
        seed = tp.synchronize_rng(mesh)  # ... until TP rank 0's seed is shared
        sampled = model.generate(prompt, do_sample=True, top_k=0, **settings)
    return {"greedy": greedy.tolist(), "expected": expected.tolist(), "sampled": sampled.tolist(), "seed": seed}


@pytest.mark.parametrize("world", [2, 4])
def test_greedy_and_sampled_tokens_agree_on_every_rank(pool2, pool4, world):
    results = (pool2 if world == 2 else pool4).run(generate_task)
    first = results[0]
    assert first["greedy"] == first["expected"]
    assert len(first["sampled"][0]) == 5 + 8
    for other in results[1:]:
        assert other == first


def left_padded_gpt2_task() -> dict:
    """GPT-2's positions are absolute: generate() must see position_ids in the forward's signature to build them
    from the attention mask of a left-padded row (it read (*args, **kwargs) and left them out)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, pad_token_id=0,
                                     eos_token_id=1, bos_token_id=1)
    ref = transformers.GPT2LMHeadModel(config).eval()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh()).eval()
    ids = torch.randint(2, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    ids[0, :2] = 0
    settings = dict(attention_mask=(ids != 0).long(), pad_token_id=0, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        first = [m.generate(ids, output_logits=True, return_dict_in_generate=True, **settings).logits[0] for m in (model, ref)]
        beams = [m.generate(ids, num_beams=3, **settings).tolist() for m in (model, ref)]
    return {"logits": ((first[0] - first[1]).abs().max() / first[1].abs().max()).item(), "beams": beams,
            "names": "position_ids" in inspect.signature(model.forward).parameters}


def test_left_padded_generation_of_an_absolute_position_model_is_the_unsplit_ones(pool2):
    for out in pool2.run(left_padded_gpt2_task):
        assert out["names"] and out["logits"] < 1e-5
        assert out["beams"][0] == out["beams"][1]
