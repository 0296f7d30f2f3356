"""Layers with a forward of their own: split by output channels, output gathered, when that alone is exact.

A subclass of Linear or Conv that overrides ``forward`` may transform its weight before using it, and
the trace does not see how. A weight-standardized convolution (BiT's ``WeightStandardizedConv2d``)
standardizes each output channel's filter over its input channels and kernel window:

    w'[o] = (w[o] - mean(w[o])) / std(w[o])        mean, std over (in, kh, kw)

so a row-parallel split (input channels cut) changes every mean and std, and the self-check refuses it
(the pair stays whole, and so does every pair it would have ended). Cutting *output* channels keeps each
filter whole on one device: each device computes its channels exactly, and an all-gather makes the
output whole again. That costs one all-gather per layer forward (and its slice backward), more than a
column -> row pair's one all-reduce, but it divides the layer's weights over the devices.

After inference, each such layer that was kept whole gets ``ColwiseParallel(gather_output=True)`` if the
self-check passes it on its own (its captured input, fresh weights, outputs and gradients compared);
otherwise it stays whole, as before. Plain Linear/Conv layers are left to the pairs: gathering them
everywhere would trade a pair's one all-reduce for one all-gather per layer.
"""

from __future__ import annotations


from torch import nn

from .. import quant
from ..layers import CONV, LINEAR, layer_kind
from ..logs import get_logger
from ..styles import ColwiseParallel
from .evidence import Trace
from .groups import Group, validate_entries
from .selfcheck import check_entries

logger = get_logger(__name__)

_BASE_FORWARDS = {nn.Linear.forward, nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward}


def owns_forward(module: nn.Module) -> bool:
    """A Linear or an ungrouped Conv whose class replaces the base forward (it may transform its weight);
    quantized layers (bitsandbytes') are not: their own forward is the quantized matmul quant/ knows."""
    kind = layer_kind(module)
    if kind not in (LINEAR, CONV) or kind is CONV and module.groups != 1 or quant.weight_kind(module.weight):
        return False
    return type(module).forward not in _BASE_FORWARDS


def gathered_own_forward(module: nn.Module, trace: Trace, whole: dict[str, str], world_size: int,
                         verdicts: dict) -> list[Group]:
    """One "gathered" group per layer in `whole` (kept whole by inference, name -> reason) that owns its
    forward and passes the self-check split by output channels with its output gathered."""
    groups = []
    for name in whole:
        if name not in trace.layers or trace.captures.get(name) is None:
            continue
        layer = module.get_submodule(name)
        if not owns_forward(layer):
            continue
        entries = {name: ColwiseParallel(gather_output=True)}
        problem = validate_entries(module, entries, world_size)
        verdict = problem or check_entries(module, trace, entries, world_size, verdicts)
        if verdict is not None:
            logger.debug("%s (%s) stays whole: %s", name, type(layer).__name__, verdict)
            continue
        g = Group([name], [])
        g.outcome, g.entries = "gathered", entries
        groups.append(g)
    if groups:
        logger.info("%d layer(s) with a forward of their own split by output channels, output gathered (%s, ...)",
                    len(groups), groups[0].columns[0])
    return groups
