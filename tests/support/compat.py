"""Models and rules the tensorshard.compat tests share: a small network with an embedding, an MLP block and
an output head (tied or not), a fused q|k|v attention, and the tensor_parallel rules of an MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

W = 2  # devices the compat tests split over


class MLP(nn.Module):
    def __init__(self, dim: int = 24, hidden: int = 50) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    """Embedding -> MLP block -> output head, optionally tied to the embedding."""

    def __init__(self, vocab: int = 40, dim: int = 24, tied: bool = False, head_bias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = MLP(dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=head_bias)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.mlp(h)
        return self.head(self.norm(h))


class FusedAttention(nn.Module):
    """Self-attention with q|k|v in one Linear (as GPT-2's c_attn) and an `n_heads` its forward reshapes with."""

    def __init__(self, dim: int = 40, n_heads: int = 5) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


MLP_RULES = {
    r"mlp\.fc1\.(weight|bias)$": "split 0",  # column: output features
    r"mlp\.fc2\.weight$": "split 1",  # row: input features
    r"mlp\.fc2\.bias$": "scale",  # added once over the sum
}


def ids(gen, n=3, t=6, vocab=40):
    return torch.randint(0, vocab, (n, t), generator=gen)
