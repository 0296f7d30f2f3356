"""Generation under torchrun: greedy decoding and seeded sampling give the same tokens on every rank
(and greedy gives the unsplit model's tokens)."""

import copy

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
