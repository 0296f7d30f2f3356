"""What the tests look at after a failure: which worker threads are busy, and whether a model is unchanged; and how
they set the collective timeout of a split model between calls."""

from __future__ import annotations

import sys
import time

import torch
from torch import nn


def set_timeout(model, seconds: float) -> None:
    """The seconds a shard of `model` (in-process) waits at a collective from the next call on: short only for the
    call where a test makes a shard miss one, long for every other call (a loaded machine can hold a healthy shard
    back for longer than a fraction of a second)."""
    model.timeout = model._group.timeout = seconds


def wait_until_idle(model) -> None:
    """Return once no worker thread of `model` runs a shard (a released straggler meets its ended call and stops);
    bounded by the test's own timeout, not by a clock of this function's."""
    while busy_workers(model):
        time.sleep(0.01)


def busy_workers(model) -> list[str]:
    """Names of `model`'s worker threads that are running a shard (not idle, waiting for the next call)."""
    frames = sys._current_frames()
    busy = []
    for thread in model._pool._threads.values():
        frame = frames.get(thread.ident)
        while frame is not None:
            if frame.f_code.co_name == "_execute":
                busy.append(thread.name)
                break
            frame = frame.f_back
    return busy


def snapshot(model: nn.Module) -> dict:
    """Everything of `model` a failed tensor_parallel() must leave as it was."""
    return {
        "tensors": {
            name: (id(t), t.detach().clone(), t.device, t.dtype, t.requires_grad, type(t))
            for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        },
        "attrs": {
            name: {k: v for k, v in vars(m).items() if isinstance(v, (int, float, str, bool, tuple)) and not k.startswith("_")}
            for name, m in model.named_modules()
        },
        "overrides": {name for name, m in model.named_modules() if "forward" in vars(m)},
        "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["tensors"].keys() == before["tensors"].keys()
    for name, (ident, value, device, dtype, grad, kind) in before["tensors"].items():
        ident2, value2, device2, dtype2, grad2, kind2 = after["tensors"][name]
        assert not value2.is_meta, f"{name} was left on the meta device"
        assert (ident2, device2, dtype2, grad2, kind2) == (ident, device, dtype, grad, kind), name
        assert torch.equal(value2, value), f"{name} changed"
    assert after["attrs"] == before["attrs"]
    assert after["overrides"] == before["overrides"] and after["hooks"] == before["hooks"]
