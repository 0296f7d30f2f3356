"""Models no preset knows, written the way people write them. No parallelism in here."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MixerBlock(nn.Module):
    """MLP-Mixer: an MLP across tokens (on the transposed input), then one across channels."""

    def __init__(self, tokens: int, channels: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.token_fc1 = nn.Linear(tokens, token_hidden)
        self.token_fc2 = nn.Linear(token_hidden, tokens)
        self.norm2 = nn.LayerNorm(channels)
        self.channel_fc1 = nn.Linear(channels, channel_hidden)
        self.channel_fc2 = nn.Linear(channel_hidden, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, tokens, channels)
        y = self.norm1(x).transpose(1, 2)  # (B, C, T)
        x = x + self.token_fc2(F.gelu(self.token_fc1(y))).transpose(1, 2)
        return x + self.channel_fc2(F.gelu(self.channel_fc1(self.norm2(x))))


class MLPMixer(nn.Module):
    def __init__(self, patch: int = 12, tokens: int = 10, channels: int = 32, depth: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(patch, channels)
        self.blocks = nn.ModuleList(MixerBlock(tokens, channels, 22, 66) for _ in range(depth))
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # (B, tokens, patch)
        x = self.embed(patches)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


class FusedAttention(nn.Module):
    """Causal self-attention with one fused projection. layout="blocks": [q | k | v] (GPT-2);
    layout="interleaved": q, k, v of each head side by side (GPT-NeoX)."""

    def __init__(self, dim: int, heads: int, layout: str = "blocks") -> None:
        super().__init__()
        self.heads, self.head_dim, self.layout = heads, dim // heads, layout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        if self.layout == "blocks":
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        else:
            q, k, v = self.qkv(x).view(B, T, self.heads, 3 * self.head_dim).transpose(1, 2).split(self.head_dim, -1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, nh, T, T)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.proj(y)


class FusedBlock(nn.Module):
    def __init__(self, dim: int, heads: int, layout: str) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = FusedAttention(dim, heads, layout)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class FusedGPT(nn.Module):
    def __init__(self, vocab: int = 80, dim: int = 48, heads: int = 6, depth: int = 2, layout: str = "blocks") -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(FusedBlock(dim, heads, layout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class QKNormAttention(nn.Module):
    """Attention with an RMS norm over each head's query and key (Qwen3, OLMo): the norm's weight is whole
    on every device but reads split heads, so its gradient must be summed."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.q_norm = nn.RMSNorm(self.head_dim)
        self.k_norm = nn.RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class TemperatureAttention(nn.Module):
    """Built to fool the structural guess: its data flow is ordinary attention, so inference localises
    `n_heads` as a head count, but the forward also uses n_heads as a softmax temperature, which a device
    holding fewer heads then gets wrong. Only running it shows that."""

    def __init__(self, dim: int = 32, n_heads: int = 4) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = (q @ k.transpose(-2, -1)) * (self.n_heads / 2.0)  # temperature from the head count
        y = att.softmax(-1) @ v  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def build_mixer() -> MLPMixer:
    """For `tensorshard plan custom_models:build_mixer`."""
    return MLPMixer()

