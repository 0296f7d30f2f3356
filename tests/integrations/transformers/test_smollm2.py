"""SmolLM2-135M-Instruct, the real model of the demo: 9 query heads in 3 KV groups, so 2 devices split
the heads unevenly (6 + 3, KV 2 + 1) and 3 devices hold one KV group each."""

import copy

import pytest
import torch

from tensorshard import demo
import tensorshard as tp
from tensorshard.integrations.transformers import rank_caches

pytestmark = pytest.mark.timeout(300)


def test_twenty_greedy_tokens_identical_on_a_chat_prompt(smollm2):
    model, tokenizer = smollm2
    ids = demo.chat_ids(tokenizer, "Name three colors.")
    generate = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)  # 20 tokens, past the answer's end
    expected = model.generate(ids, **generate)
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 2)
    out = split.generate(ids, **generate, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    # The answer in FACTS.md; min_new_tokens holds back the end-of-turn token, so the model goes on.
    assert tokenizer.decode(out.sequences[0, ids.shape[1]:]).startswith("1. Red\n2. Blue\n3. Green\n")
    kv_heads = [c.layers[0].keys.shape[1] for c in rank_caches(out.past_key_values)]
    assert kv_heads == [2, 1]
    assert demo.heads_per_device(split) == "6+3 query heads (KV 2+1)"


def test_demo_prints_answer_identity_losses_and_memory(smollm2):
    model, tokenizer = smollm2
    lines = []
    runs = demo.run_demo(
        model, tokenizer, prompt="Name three colors.", devices=[["cpu"] * 3], max_new_tokens=14, steps=2,
        fast=False, out=lines.append,  # compiling SmolLM2's shards takes minutes here; test_static_cache.py compiles

    )
    text = "\n".join(lines)
    assert "1. Red\n  2. Blue\n  3. Green" in text
    assert "token-identical to the unsplit model: yes" in text
    assert "Fine-tuning: 2 AdamW steps" in text and "Memory per device" in text and "tokens/s" in text
    unsplit, split = runs
    for a, b in zip(split.losses, unsplit.losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert max(split.memory.values()) < 0.36 * sum(unsplit.memory.values())  # one third, plus the norms


def test_demo_arguments():
    args = demo.parse_args(["--prompt", "Hi", "--devices", "2", "cpu,cpu,cpu", "--max-new-tokens", "5", "--steps", "1"])
    assert (args.prompt, args.max_new_tokens, args.steps) == ("Hi", 5, 1)
    assert demo.device_lists(args.devices) == [["cpu", "cpu"], ["cpu", "cpu", "cpu"]]  # no GPU here
    assert args.fast and not demo.parse_args(["--no-fast"]).fast
    with pytest.raises(SystemExit):
        demo.parse_args(["--steps", "0"])
