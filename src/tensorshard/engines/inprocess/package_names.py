"""The tensor_parallel package's names for what an in-process split model holds (docs/migrating.md).

    model.tensor_parallel_config       # the plan, bound to the model (convert_state_dict reads its layout)
    model.sharding_manager             # what ZeRO-3 partitions, or None
    model.wrapped_model.module_shards  # the shards, through the original's wrapper level

`TensorParallel` (engine.py) inherits them; `apply_sharding`, which does something rather than name it, stays
with the engine. tensorshard's own names (`plan`, `zero_splits`, the model itself) mean the same.
"""

from __future__ import annotations

from ...plans.plan import BoundPlan, Plan
from .zero import ZeroSharding


class PackageNames:
    """Read-only properties a `TensorParallel` answers to under the tensor_parallel package's names."""

    @property
    def tensor_parallel_config(self) -> Plan:
        """The plan, bound to this model (equal to `plan`; `convert_state_dict` reads the layout from it)."""
        return BoundPlan(self.plan, self)

    @property
    def sharding_manager(self) -> ZeroSharding | None:
        """What ZeRO-3 partitions (`apply_sharding`, ``sharded=True``), or None when it is off."""
        zero = getattr(self, "zero_splits", None)
        return ZeroSharding(tuple(zero), self.world_size) if zero else None

    @property
    def wrapped_model(self):
        """The model itself: the original's TensorParallelPreTrainedModel held its TensorParallel under this name;
        here the split model is both (``model.wrapped_model.module_shards`` still reads the shards)."""
        return self
