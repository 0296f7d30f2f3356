"""Small models in plain PyTorch that the tests split. No parallelism in here. (Models no preset knows,
for inferred plans, are in custom_models.py.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class FeedForward(nn.Module):
    """The SwiGLU feed-forward of the Lightning tensor-parallel guide."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    """Causal self-attention with grouped key/value heads."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int | None = None, bias: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = head_dim or dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads, n_kv_heads, bias=bias)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """A pre-norm decoder: embedding, blocks, final norm, output head."""

    def __init__(self, vocab=96, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden=176, bias=False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, hidden, bias) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class ConvNet(nn.Module):
    """Conv2d pairs (split output channels -> split input channels), a Conv1d pair, a classifier."""

    def __init__(self, channels: int = 12, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv1d(channels, 2 * channels, 1)
        self.conv4 = nn.Conv1d(2 * channels, channels, 1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.conv2(F.relu(self.conv1(x))))  # (B, C, H, W)
        x = x.flatten(2)  # (B, C, H*W)
        x = x + self.conv4(F.gelu(self.conv3(x)))
        return self.head(x.mean(-1))


class ResidualMLP(nn.Module):
    """x + down(relu(up(norm(x)))): the block of the checkpoint memory tests."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ResidualStack(nn.Module):
    """Residual MLP blocks; `reentrant` True or False runs each through torch.utils.checkpoint (recomputed in
    backward) with that use_reentrant."""

    def __init__(self, dim: int, hidden: int, layers: int, reentrant: bool | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualMLP(dim, hidden) for _ in range(layers))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return x


class TwoBlocks(nn.Module):
    """Two column -> row pairs: the forward all-reduces at b1, then at b2."""

    def __init__(self):
        super().__init__()
        self.a1, self.b1 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.a2, self.b2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b2(self.a2(self.b1(self.a1(x))))


class TwoPairs(nn.Module):
    """Two column -> row pairs with a residual, and a norm the plan (plans.TWO_BLOCKS) leaves whole."""

    def __init__(self):
        super().__init__()
        self.a1, self.b1 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.a2, self.b2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = x + self.b1(torch.relu(self.a1(x)))
        return self.b2(torch.relu(self.a2(self.norm(h))))


class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation: channel weights from the pooled input, through a bottleneck."""

    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.expand = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        s = F.adaptive_avg_pool2d(x, 1)  # (B, C, 1, 1)
        return x * torch.sigmoid(self.expand(F.silu(self.reduce(s))))


class MBConv(nn.Module):
    """MobileNetV2 / EfficientNet block: 1x1 expansion, BatchNorm, depthwise 3x3, BatchNorm, squeeze-and-
    excitation, 1x1 projection, BatchNorm, residual."""

    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.expand = nn.Conv2d(channels, hidden, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.depthwise = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False)
        self.bn2 = nn.BatchNorm2d(hidden)
        self.se = SqueezeExcite(hidden, 4)
        self.project = nn.Conv2d(hidden, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu6(self.bn1(self.expand(x)))
        h = F.relu6(self.bn2(self.depthwise(h)))
        return x + self.bn3(self.project(self.se(h)))


class TinyEfficientNet(nn.Module):
    def __init__(self, channels: int = 8, hidden: int = 28, depth: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(MBConv(channels, hidden) for _ in range(depth)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, channels, H, W)
        return self.head(self.blocks(x).mean((2, 3)))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    def __init__(self, width: int = 14, depth: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.blocks = nn.Sequential(*(BasicBlock(width) for _ in range(depth)))
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W)
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))
