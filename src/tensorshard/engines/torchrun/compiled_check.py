"""The identical-input check of a compiled model's first training calls: data.py's check, run from the graph.

torch.compile traces the root forward without its host-side work (engine.py), so a compiled model used to skip
`check_same_inputs`: a Trainer with `torch_compile=True` and no `TensorParallelSampler` trained on mixed
batches without a word. In training mode the traced forward calls `tensorshard::check_inputs` with its tensor
inputs: an operator whose Python body runs at every call of the graph. While the model has checks left
(`parallelize(..., check_inputs=N)`, counted with the eager calls) it compares the inputs across the group, as
the eager path does, and raises `InputMismatchError` naming the input; later calls return at once. The
operator is registered with an ordered side effect, so the graph keeps it although it returns nothing. Graphs
traced in eval mode (compiled decoding, scoring) do not hold it: a decode step stays free of Python.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op  # private; torch >= 2.4

from .data import check_same_inputs

_models: dict[str, weakref.ref] = {}  # key -> the model's TorchrunState (checks_left, comm)
_keys = itertools.count()


def register(state: Any) -> str:
    """The key a traced forward passes to the operator for `state`, the model's TorchrunState."""
    key = str(next(_keys))
    _models[key] = weakref.ref(state, lambda _, key=key: _models.pop(key, None))
    return key


def call(key: str, where: str, names: list[str], args: tuple, kwargs: dict) -> None:
    """From the traced forward: the operator over the call's top-level tensor inputs (named after the
    forward's parameters; nested structures such as a KV cache are left out, as they vary by design)."""
    named = [(names[i] if i < len(names) else f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    tensors = [(n, v) for n, v in named if isinstance(v, torch.Tensor)]
    if tensors:
        torch.ops.tensorshard.check_inputs([v for _, v in tensors], "\n".join(n for n, _ in tensors), key, where)


@torch.library.custom_op("tensorshard::check_inputs", mutates_args=())
def _check_inputs(inputs: list[torch.Tensor], names: str, key: str, where: str) -> None:
    ref = _models.get(key)
    state = ref() if ref is not None else None
    if state is None or state.checks_left <= 0:
        return
    state.checks_left -= 1
    check_same_inputs(dict(zip(names.split("\n"), inputs)), state.comm.group, where=where)


@_check_inputs.register_fake
def _(inputs, names, key, where) -> None:
    return None


_register_effectful_op(torch.ops.tensorshard.check_inputs.default, _EffectType.ORDERED)
