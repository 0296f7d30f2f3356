"""Hand-placed column/row pairs around one op each: what a given plan's pair check (plan_inference/plancheck.py)
must refuse at split time, and what it must let through. Shared by the in-process and the torchrun tests.

Each case: a model factory (seeded), its plan, and whether the pair is exact when split ("exact") or refused
("refused": an op between the two layers mixes the features the column layer splits)."""

from __future__ import annotations

import torch
from torch import nn

import tensorshard as tp

WIDTH, HIDDEN = 16, 48  # 48 features: 24 / 16 per device at 2 / 3 devices


class Between(nn.Module):
    """up -> mid -> down, with `mid` any module (or function of the hidden features)."""

    def __init__(self, mid: nn.Module) -> None:
        super().__init__()
        self.up, self.mid, self.down = nn.Linear(WIDTH, HIDDEN), mid, nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return self.down(self.mid(self.up(x)))


class MixHeads(nn.Module):
    """Makes 'heads' of the hidden features the wrong way round: head h holds features h, h + 4, h + 8, ...
    (a reshape to (..., head_dim, heads) then a transpose), then a softmax within each head."""

    def forward(self, h):
        shape = h.shape
        heads = h.view(*shape[:-1], HIDDEN // 4, 4).transpose(-1, -2)  # (..., 4 heads, 12)
        return heads.softmax(-1).transpose(-1, -2).reshape(shape)


class UnknownOp(nn.Module):
    """A custom module whose op has no inference rule (a Bessel function: element-wise, but nothing says so)."""

    def forward(self, h):
        return torch.special.i1(h)


class GatedMLP(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)), with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.down(self.drop(nn.functional.silu(self.gate(x)) * self.up(x)))


class Attention(nn.Module):
    """Self-attention with 6 heads of 8 features, split by heads with a Heads entry."""

    def __init__(self, heads: int = 6, head_dim: int = 8) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, head_dim
        dim = heads * head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, head_dim)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


PAIR = {"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()}
GATED = {"gate": tp.ColwiseParallel(), "up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()}
HEADS = {"": tp.Heads(num_heads=6, attrs={"n_heads": "heads"}), "[qkv]": tp.ColwiseParallel(blocks=("q",)),
         "o": tp.RowwiseParallel(blocks=("q",))}

# name -> (factory, plan, "exact" | "refused", the op the refusal names)
CASES = {
    "softmax": (lambda: Between(nn.Softmax(-1)), PAIR, "refused", "softmax"),
    "layernorm": (lambda: Between(nn.LayerNorm(HIDDEN)), PAIR, "refused", "layer_norm"),
    "rmsnorm": (lambda: Between(nn.RMSNorm(HIDDEN)), PAIR, "refused", "rms_norm"),
    "heads reshape": (lambda: Between(MixHeads()), PAIR, "refused", "softmax"),
    "unknown op": (lambda: Between(UnknownOp()), PAIR, "refused", "special_i1"),
    "gelu": (lambda: Between(nn.GELU()), PAIR, "exact", ""),
    "silu": (lambda: Between(nn.SiLU()), PAIR, "exact", ""),
    "dropout": (lambda: Between(nn.Dropout(0.2)), PAIR, "exact", ""),
    "gate * up": (GatedMLP, GATED, "exact", ""),
    "attention with Heads": (Attention, HEADS, "exact", ""),
}


def build(name: str) -> tuple[nn.Module, dict, str, str]:
    factory, plan, verdict, op = CASES[name]
    torch.manual_seed(0)
    model = factory().eval()
    return model, plan, verdict, op


def example(name: str) -> torch.Tensor:
    dim = 48 if name == "attention with Heads" else WIDTH
    return torch.randn(2, 5, dim, generator=torch.Generator().manual_seed(1))


def split_layers(name: str) -> list[str]:
    """The column layers of the case's plan (whole when the pair is kept whole)."""
    return [k for k, v in CASES[name][1].items() if isinstance(v, tp.ColwiseParallel)] if name != "attention with Heads" else ["q"]
