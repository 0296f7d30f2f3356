"""The demo: split a small transformer over CPU slots and show that it computes what the unsplit one does."""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

import tensorshard as tp


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2, help="number of CPU slots")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = Attention(96, 9, 3)
    plan = tp.Plan({
        "": tp.Heads(num_heads=9, num_kv_heads=3, attrs={"n_heads": "heads", "n_kv_heads": "kv_heads"}),
        "wq": tp.ColwiseParallel(blocks=("q",)),
        "w[kv]": tp.ColwiseParallel(blocks=("kv",)),
        "wo": tp.RowwiseParallel(blocks=("q",)),
    })
    print(plan)
    ref = copy.deepcopy(model)
    split = tp.tensor_parallel(model, ["cpu"] * args.devices, plan=plan)
    x = torch.randn(2, 5, 96)
    print("max difference to the unsplit model:", (split(x) - ref(x)).abs().max().item())
    print("memory per device:", tp.memory_per_device(split))


if __name__ == "__main__":
    main()
