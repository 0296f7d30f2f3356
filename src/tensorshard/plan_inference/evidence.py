"""What one traced pass found: the records the rest of plan inference reads (trace.py makes them).

- `LayerInfo`: a supported layer (Linear, HF Conv1D, Conv, Embedding), the roles it played in each call
  (`LayerCall`), the ids of its output features once it ran as a column, uses of its parameters elsewhere;
- `Poison`: split features read in a way a split model cannot reproduce, with the reason and the module;
- `Sync`: whole parameters that split computations read, whose gradient each device would see only part of;
- `Trace`: all of it for one pass, with the feature classes, each module's captured inputs and call order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..layers import LayerKind
from .features import FeatureSet, Ids


@dataclass
class LayerCall:
    role: str  # "column" | "row" | "through" | "embedding" | "soft" | "whole" (layer_roles.py)
    input_id: int  # id() of the input tensor (columns reading the same tensor share one backward all-reduce)
    row_ids: Ids | None = None  # the input's shadow, for rows


@dataclass
class LayerInfo:
    """A supported layer (Linear, HF Conv1D, Conv, Embedding) and what the traced pass did with it."""

    name: str
    module: nn.Module
    kind: LayerKind
    out_ids: Ids | None = None  # ids of its output features, once it ran as a column
    calls: list[LayerCall] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)  # uses of its parameters outside its own forward
    reads_model_input: bool = False  # an embedding looked up with the model's input ids

    @property
    def roles(self) -> set[str]:
        return {c.role for c in self.calls}


@dataclass(eq=False)
class Poison:
    ids: Ids
    reason: str
    where: str
    kind: str = "op"  # "output" when the features reach the model's output, "gradient" (gradient_sources.py)


@dataclass(eq=False)
class Sync:
    """Whole parameters read by split computations: each device would see part of their gradient."""

    params: list[tuple[str, str]]  # (owning module, parameter name)
    ids: Ids  # the split features they meet


@dataclass
class Trace:
    """What one traced pass found. `fs` holds the final classes of the column features."""

    fs: FeatureSet
    layers: dict[str, LayerInfo]
    poisons: list[Poison]
    captures: dict[str, tuple[tuple, dict] | None]  # module -> (args, kwargs) of its first call
    call_order: list[str]  # modules in the order they were first called
    inputs: tuple[tuple, dict]
    syncs: list[Sync] = field(default_factory=list)
    split_outputs: dict[str, list[Ids | None]] = field(default_factory=dict)  # module -> shadow per output
    channels: dict[str, Ids] = field(default_factory=dict)  # channel-wise module -> ids of the channels it got
    fixed_counts: list = field(default_factory=list)  # head_counts.FixedCount: reshapes by an explicit head count
