"""Sequence parallelism and a vocabulary-parallel loss on a small random Llama, under torchrun.

    torchrun --nproc_per_node=2 examples/torchrun/llama_sequence_parallel.py

Prints the collectives of one training step: per layer two all-gathers and two reduce-scatters each way
(no all-reduce), and a loss computed from vocabulary shards (the logits are never gathered).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import tensorshard as tp
from llama_plans import llama_plan

if __name__ == "__main__":
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1024)
    model = LlamaForCausalLM(config)
    model = tp.parallelize(model, mesh, plan=llama_plan(model, sequence_parallel=True, loss_parallel=True))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # A learnable stream: counting up from a random token.
    gen = torch.Generator().manual_seed(0)  # the same seed on every rank: the same batches
    for step in range(30):
        start = torch.randint(0, config.vocab_size, (4, 1), generator=gen)
        ids = (start + torch.arange(128)) % config.vocab_size
        with tp.count_collectives() as counts:
            logits = model(ids).logits  # a DTensor: each rank holds (4, 128, 1024 / N)
            loss = tp.vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:])
            opt.zero_grad()
            loss.backward()
        opt.step()
        if dist.get_rank() == 0 and step % 10 == 9:
            print(f"step {step}: loss {loss.item():.3f}")
    if dist.get_rank() == 0:
        print(f"local logits {tuple(logits.to_local().shape)}; collectives of the last step: forward "
              f"{dict(counts.forward)}, backward {dict(counts.backward)}")
        largest = max(counts.log, key=lambda entry: entry[2])
        print(f"largest transfer: {largest[1]} of {largest[2] / 2**10:.0f} KiB at {largest[3]} "
              f"(the whole logits would be {logits.numel() * 4 / 2**10:.0f} KiB)")
    dist.barrier()  # let every rank finish before the group goes away
    dist.destroy_process_group()
