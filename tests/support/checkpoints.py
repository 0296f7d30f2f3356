"""What the checkpoint tests share: their model, a probe of its outputs, its unsplit weights, a comparison
of weights to the bit, and a sharded safetensors checkpoint of `models.ResidualStack` written file by file."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import tensorshard as tp
from support.models import Transformer


def build(seed: int = 0, **kwargs) -> Transformer:
    """The tests' transformer (8 heads over 2 KV heads, with biases); the seed sets the weights only."""
    torch.manual_seed(seed)
    return Transformer(n_heads=8, n_kv_heads=2, bias=True, **kwargs)


def probe(model) -> torch.Tensor:
    """The model's output on a fixed batch of tokens."""
    tokens = torch.randint(0, 96, (3, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(tokens)


def gathered(model) -> dict[str, torch.Tensor]:
    """A copy of the unsplit model's state dict, gathered from a split one (either engine)."""
    with tp.save_tensor_parallel(model):
        return {k: v.clone() for k, v in model.state_dict().items()}


def differ(state: dict, expected: dict) -> list[str]:
    """Names whose tensors differ (in any bit), or that are missing or extra."""
    return sorted(set(state) ^ set(expected)) + [k for k in expected if k in state and not torch.equal(state[k], expected[k])]


def write_stack_checkpoint(folder: Path, *, layers: int, dim: int, hidden: int, files: int,
                           scale: float) -> tuple[int, int]:
    """Random weights (uniform in +-scale) of ResidualStack(dim, hidden, layers) in `files` safetensors files
    plus an index, one file in memory at a time. Returns (total bytes, largest tensor's bytes)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    names = []
    for i in range(layers):
        names += [(f"blocks.{i}.norm.weight", (dim,)), (f"blocks.{i}.norm.bias", (dim,)),
                  (f"blocks.{i}.up.weight", (hidden, dim)), (f"blocks.{i}.down.weight", (dim, hidden))]
    per_file = -(-len(names) // files)
    weight_map, total, largest = {}, 0, 0
    for k in range(files):
        file_name = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        tensors = {n: torch.empty(s).uniform_(-scale, scale, generator=gen) for n, s in names[k * per_file:(k + 1) * per_file]}
        save_file(tensors, Path(folder) / file_name)
        for name, t in tensors.items():
            weight_map[name] = file_name
            total += t.numel() * 4
            largest = max(largest, t.numel() * 4)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index))
    return total, largest
