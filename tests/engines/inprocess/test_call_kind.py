"""The kind of a compiled decode call (engines/inprocess/compiled_steps.py `_call_kind`): read in one pass over
the keyword arguments where each is a leaf (a decode step's: tensors, a cache, flags), through `tree_flatten`
otherwise. It must never merge two calls that the flattened way tells apart (a stitched or parallel step has no
guards: its kind is what picks it), and calls `generate` makes token after token must share one kind."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest
import torch
from torch.utils._pytree import tree_flatten

from tensorshard.engines.inprocess.compiled_steps import _call_kind, _kind
from tensorshard.engines.inprocess.stitched_decode import call_settings

pytestmark = pytest.mark.timeout(60)


class _Cache:
    """What the kind reads of a transformers cache: its class and each layer's fixed length."""

    def __init__(self, length: int, layers: int = 2) -> None:
        self.layers = [SimpleNamespace(max_cache_len=length) for _ in range(layers)]


def _flattened(kwargs: dict) -> tuple:
    leaves, spec = tree_flatten(((), kwargs))
    return _kind(leaves), call_settings(leaves, spec)


def _token(position: int, **changes) -> dict:
    call = {"input_ids": torch.tensor([[position]]), "cache": _Cache(48), "position_ids": torch.tensor([[position]]),
            "attention_mask": torch.ones(1, 1, 1, 48, dtype=torch.bool), "logits_to_keep": 0, "use_cache": True,
            "return_dict": True}
    return {**call, **changes}


CALLS = {
    "token": _token(16),
    "next token": _token(17),
    "batch 2": _token(16, input_ids=torch.tensor([[16], [3]])),
    "int32 ids": _token(16, input_ids=torch.tensor([[16]], dtype=torch.int32)),
    "longer cache": _token(16, cache=_Cache(64)),
    "more layers": _token(16, cache=_Cache(48, layers=3)),
    "no cache use": _token(16, use_cache=False),
    "keep 1 logit": _token(16, logits_to_keep=1),
    "hidden states": _token(16, output_hidden_states=True),
    "another order": dict(reversed(list(_token(16).items()))),
    "another object": _token(16, cache=SimpleNamespace(layers=_Cache(48).layers)),
    "mask per type": _token(16, attention_mask={"full_attention": torch.ones(1, 1, 1, 48, dtype=torch.bool)}),
    "mask per type, longer": _token(16, attention_mask={"full_attention": torch.ones(1, 1, 1, 64, dtype=torch.bool)}),
    "tuple argument": _token(16, extra=(torch.zeros(2), 3)),
    "an enum": _token(16, extra=enum.IntEnum("Mode", "A B").A),
    "another enum value": _token(16, extra=enum.IntEnum("Mode", "A B").B),
}


def test_tokens_share_a_kind_and_nothing_the_flattened_kind_tells_apart_is_merged():
    fast = {name: _call_kind((), call) for name, call in CALLS.items()}
    slow = {name: _flattened(call) for name, call in CALLS.items()}
    assert fast["token"] == fast["next token"]
    for a in CALLS:
        for b in CALLS:
            if slow[a] != slow[b]:
                assert fast[a] != fast[b], (a, b)
            else:  # (and no stricter for these: each pair the flattened kind merges is merged too)
                assert fast[a] == fast[b], (a, b)
    assert len({fast["token"], fast["mask per type"], fast["tuple argument"]}) == 3  # (hashable: a dict key)


def test_cpu_autocast_makes_another_kind():
    plain = _call_kind((), _token(16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _call_kind((), _token(16)) != plain
