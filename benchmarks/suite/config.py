"""What the benchmarks run: the two models, their sizes (full and --quick), the inputs, and which
parameters count as "split weights". Plain PyTorch only: the tensor_parallel peer's environment
(transformers 4.31) imports this file too.

Models:
- ``ff``: the Lightning tensor-parallel guide's ``FeedForward(8192, 8192)`` (w1, w3 -> silu-gated -> w2),
  trained with AdamW on a (8, 8192) batch, loss = output.sum(), as in the guide.
- ``llama``: a Llama-style decoder (transformers' LlamaConfig, random weights) of ~104M parameters whose
  sizes divide by 8 (16 query heads, 8 KV heads, MLP 2816, vocabulary 16384), so every system can split it
  evenly over 1, 2, 4 and 8 devices; trained on (4, 128) token batches with the language-model loss.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """The guide's toy MLP: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass(kw_only=True)
class FFSize:
    """FeedForward(dim, hidden) trained on a (batch, dim) input."""

    dim: int = 8192
    hidden: int = 8192
    batch: int = 8


@dataclass(kw_only=True)
class LlamaSize:
    """A LlamaConfig and the batch shapes used to train it and to generate with it."""

    vocab_size: int = 16384
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 6
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    batch: int = 4  # training batch: (batch, seq) tokens
    seq: int = 128
    prompt: int = 16  # generation: one prompt of this many tokens, then `new_tokens` greedy tokens
    new_tokens: int = 48

    def config_kwargs(self, layers: int | None = None) -> dict:
        return dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers if layers is None else layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=2048, tie_word_embeddings=False,
        )


@dataclass(kw_only=True)
class Sizes:
    """Everything size-dependent in one object (serialised into the results)."""

    ff: FFSize = field(default_factory=FFSize)
    llama: LlamaSize = field(default_factory=LlamaSize)
    worlds: tuple[int, ...] = (1, 2, 4, 8)  # device counts for the memory comparison
    speed_worlds: tuple[int, ...] = (1, 2)
    repeats: int = 5  # timed repetitions per measurement (after one warm-up)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Sizes":
        return cls(
            ff=FFSize(**d["ff"]), llama=LlamaSize(**d["llama"]), worlds=tuple(d["worlds"]),
            speed_worlds=tuple(d["speed_worlds"]), repeats=d["repeats"],
        )


FULL = Sizes()
QUICK = Sizes(
    ff=FFSize(dim=1024, hidden=1024, batch=8),
    llama=LlamaSize(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, batch=2, seq=32, prompt=8, new_tokens=16),
    worlds=(1, 2, 4),
    repeats=5,
)


# --- the "split weights": the parameters our plan splits (norms stay whole) -----------------------------

SPLIT_PATTERNS = {
    "ff": r"^w[123]\.weight$",
    "llama": r"(embed_tokens|[qkvo]_proj|gate_proj|up_proj|down_proj|lm_head)\.weight$",
}


def canonical_name(name: str) -> str:
    """A parameter's name in the unsplit model, from its name in any system's wrapper."""
    name = re.sub(r"^(module\.)?module_shards\.\d+\.", "", name)  # tensorshard / tensor_parallel in-process
    name = name.replace("tp_wrapped_module.", "")  # tensor_parallel's wrappers
    name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
    return name


def is_split_weight(model: str, name: str) -> bool:
    return re.search(SPLIT_PATTERNS[model], canonical_name(name)) is not None


def ff_batch(size: FFSize, device="cpu") -> torch.Tensor:
    return torch.randn(size.batch, size.dim, generator=torch.Generator().manual_seed(0)).to(device)


def llama_batch(size: LlamaSize, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, size.vocab_size, (size.batch, size.seq), generator=g).to(device)


def llama_prompt(size: LlamaSize, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, size.vocab_size, (1, size.prompt), generator=g).to(device)
