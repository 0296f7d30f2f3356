"""Balanced splits (``balance=True``): even out each device's weights over every transformer block.

Attention heads stay whole, so KV heads that do not divide the device count give the devices unequal
attention weights: SmolLM2-135M's 3 KV heads over 2 devices put 6 query heads on device 0 and 3 on
device 1. Every block ends in an all-reduce, where the lighter devices wait for the heaviest, so a token
costs the sum over blocks of the slowest device's share. The MLP beside the attention is split evenly by
default; a balanced split gives its plain (feature-unit) layers per-device sizes that make up the
difference:

    per device r:  load[r] = fixed[r] + per_unit * sizes[r]        (weight elements of the block)
    fixed[r]:      the elements of r's slices of everything else in the block (the attention, ...)
    per_unit:      the elements one MLP feature brings (gate row + up row + down column: 3 x hidden)
    sizes:         water-filled: the lowest peak load with sum(sizes) = the MLP width, each size >= 1 unit

SmolLM2's shape at 2 devices: fixed = 589,824 / 294,912 elements, per_unit 1,728, width 1536: sizes
688 / 848 (multiples of 16, for the kernels' vector width, when that still lowers the peak), loads
1.78M / 1.76M elements instead of 1.92M / 1.62M.

Which layers: for every module holding a `Heads` entry whose head groups give the devices unequal
attention weights, the split layers under its parent module (the block) and outside any attention, whose
style declares plain blocks only (ColwiseParallel, RowwiseParallel, and the adapter styles beside them)
and whose blocks all have one length, the MLP width (a fused gate|up declares ``(n, n)``). Every such
layer gets the same sizes (`ModuleShard.plain_sizes`, handed to `block_partition` through the style's
`ShardContext`), so a column layer and the row layer reading it agree, and an adapter added later splits
like its base. Blocks whose attention splits evenly, and every split with ``balance=False``, are
unchanged.
"""

from __future__ import annotations

from torch import nn

from .. import quant
from ..logs import get_logger
from ..partition import Partition, parse_block, split_evenly
from ..styles.heads import Heads
from .module_shard import ModuleShard

logger = get_logger(__name__)

ALIGN = 16  # sizes in multiples of this many features (the kernels' vector width) ...
SLACK = 0.01  # ... when their peak load is within 1% of the best split's


def balanced_sizes(fixed: list[int], per_unit: int, units: int, *, align: int = ALIGN) -> tuple[int, ...]:
    """Per-device unit counts summing to `units` that make the peak of ``fixed[r] + per_unit * sizes[r]`` as low
    as possible, each device keeping a unit or more; multiples of `align` (the remainder to the lightest device)
    when their peak is within `SLACK` of that. Returns the even split when nothing lowers its peak.

    ([589824, 294912], 1728, 1536) -> (688, 848): SmolLM2's block at 2 devices (683 / 853 unaligned)."""
    world = len(fixed)
    even = split_evenly(units, world)

    def peak(sizes) -> int:
        return max(f + per_unit * s for f, s in zip(fixed, sizes))

    if units < world:
        return tuple(even)  # block_partition refuses such a layer anyway
    best = _fill(fixed, per_unit, units, 1)
    aligned = _fill(fixed, per_unit, units, align) if align > 1 and units >= align * world else None
    if aligned is not None and peak(aligned) <= peak(best) * (1 + SLACK):
        best = aligned
    return tuple(best) if peak(best) < peak(even) else tuple(even)


def _fill(fixed: list[int], per_unit: int, units: int, step: int) -> list[int]:
    """Water-filling in chunks of `step` units, each device one chunk at least: the level that `units // step`
    chunks reach, floored to whole chunks; the chunks that flooring leaves, then the units left over (fewer than
    `step`), one at a time to the device whose load is lowest (ties: the lower rank)."""
    world = len(fixed)
    chunks, rest = divmod(units, step)
    cost = per_unit * step
    active = list(range(world))  # devices below the level; the others keep their one chunk
    while True:
        level = (sum(fixed[r] for r in active) + cost * (chunks - (world - len(active)))) / len(active)
        above = [r for r in active if level - fixed[r] < cost]
        if not above or len(above) == len(active):
            break
        active = [r for r in active if r not in above]
    sizes = [step * (max(1, int((level - fixed[r]) // cost)) if r in active else 1) for r in range(world)]
    for amount, times in ((step, chunks - sum(sizes) // step), (1, rest)):
        for _ in range(times):
            r = min(range(world), key=lambda i: (fixed[i] + per_unit * sizes[i], i))
            sizes[r] += amount
    return sizes


def balanced_layers(by_name: dict[str, nn.Module], modules: dict[str, ModuleShard], world_size: int) -> dict[str, tuple[int, ...]]:
    """Module name -> the per-device sizes of its plain blocks, for every layer a balanced split resizes (see the
    module docstring); `modules` holds the even split of every module, as `shard_plan` made it first."""
    owners = [n for n, ms in modules.items() if isinstance(ms.style, Heads) and ms.heads is not None and n]
    by_parent: dict[str, list[str]] = {}
    for owner in owners:
        by_parent.setdefault(owner.rpartition(".")[0], []).append(owner)
    out: dict[str, tuple[int, ...]] = {}
    for parent, attentions in by_parent.items():
        inside = [n for n in modules if n != parent and _inside(n, parent)]
        attention = _loads([n for n in inside if any(_inside(n, h) for h in attentions)], by_name, modules, world_size)
        if len(set(attention)) == 1:
            continue  # the heads split evenly: so does the block
        fixed = [0] * world_size
        by_length: dict[int, list[str]] = {}
        for name in inside:
            length = None if any(_inside(name, h) for h in owners) else _plain_length(modules[name])
            if length is None:
                fixed = [a + b for a, b in zip(fixed, _loads([name], by_name, modules, world_size))]
            else:
                by_length.setdefault(length, []).append(name)
        if not by_length:
            continue
        width = max(by_length, key=lambda n: (_elements(by_length[n], by_name, modules), n))
        for length, names in by_length.items():
            if length != width:  # another width than the MLP's: left even, and counted as such
                fixed = [a + b for a, b in zip(fixed, _loads(names, by_name, modules, world_size))]
        layers = by_length[width]
        if any(quant.weight_kind(t) for n in layers for t in _split_tensors(n, by_name, modules)):
            logger.info("%s: quantized layers keep their even split (balance=True cuts no quantization block)", parent)
            continue
        per_unit = _elements(layers, by_name, modules) // width
        sizes = balanced_sizes(fixed, per_unit, width)
        if list(sizes) == split_evenly(width, world_size):
            continue
        out.update(dict.fromkeys(layers, sizes))
        logger.debug("%s: %s split %s of %d features (block weights per device %s)", parent, ", ".join(layers),
                     "/".join(map(str, sizes)), width, [f + per_unit * s for f, s in zip(fixed, sizes)])
    return out


def _plain_length(ms: ModuleShard) -> int | None:
    """The one length of the module's plain blocks, if its style declares only plain blocks (None: no blocks,
    one plain block) and splits along them only; else None."""
    if not ms.splits or not hasattr(ms.style, "blocks"):
        return None
    blocks = ms.style.blocks
    parts: list[Partition] = [part for _, part in ms.splits.values()]
    if any(part.overlapping for part in parts):
        return None
    if blocks:
        parsed = [parse_block(b) for b in blocks]
        if any(kind != "plain" for kind, _ in parsed) or len({n for _, n in parsed}) != 1:
            return None
        length = parsed[0][1]
        return length if all(part.size == length * len(parsed) for part in parts) else None
    sizes = {part.size for part in parts}
    return sizes.pop() if len(sizes) == 1 else None


def _split_tensors(name: str, by_name: dict[str, nn.Module], modules: dict[str, ModuleShard]):
    module = by_name[name]
    for tname in modules[name].splits:
        t = module._parameters.get(tname)
        yield t if t is not None else module._buffers[tname]


def _elements(names: list[str], by_name: dict[str, nn.Module], modules: dict[str, ModuleShard]) -> int:
    """Weight elements of the split tensors of `names`, whole (a quantized weight: the values it stands for)."""
    return sum(quant.logical_shape(t).numel() for n in names for t in _split_tensors(n, by_name, modules))


def _loads(names: list[str], by_name: dict[str, nn.Module], modules: dict[str, ModuleShard], world: int) -> list[int]:
    """Per device, the elements of its slices of the split tensors of `names`."""
    loads = [0] * world
    for name in names:
        for t, (_, part) in zip(_split_tensors(name, by_name, modules), modules[name].splits.values()):
            per_index = quant.logical_shape(t).numel() // part.size
            for rank in range(world):
                loads[rank] += per_index * part.local_size(rank)
    return loads


def _inside(name: str, parent: str) -> bool:
    return parent == "" or name == parent or name.startswith(parent + ".")


def check_balance(balance: object) -> bool:
    """`balance` as given to tensor_parallel / parallelize, refused unless it is a bool."""
    if not isinstance(balance, bool):
        raise TypeError(
            f"balance must be True or False, got {balance!r} ({type(balance).__name__}); pass balance=True to even out "
            "each device's weights over blocks whose attention heads split unevenly (docs/plans.md), or leave it out"
        )
    return balance
