"""`memory_per_device(model)`: bytes of parameters and buffers each device holds."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from . import quant


def memory_per_device(model: nn.Module) -> dict[str, int]:
    """``{device label: bytes of parameters and buffers held there}``.

    For a TensorParallel model: one entry per device slot, in order ('cpu[0]', 'cpu[1]' for repeated
    CPU slots). Quantized weights count their packed data and their quantization state (absmax, scales).
    For any other module: one entry per device its tensors are on (under torchrun, the
    local shards of this rank). Tied tensors count once.
    """
    if hasattr(model, "memory_per_device"):
        return model.memory_per_device()
    out: dict[str, int] = OrderedDict()
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[str(local.device)] = out.get(str(local.device), 0) + local.numel() * local.element_size()
    for mod in model.modules():  # quantization state beside quantized weights (absmax, row scales)
        extra = quant.module_bytes(mod)
        if extra:
            device = str(mod.weight.device)
            out[device] = out.get(device, 0) + extra
    return dict(out)
