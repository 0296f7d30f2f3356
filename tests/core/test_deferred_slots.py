"""The numbers that name partial-gradient parameters in compiled graphs (comm/dist_ops.deferred_slot): an entry
lives as long as its module, so splitting and dropping models in a long session does not grow the registry."""

from __future__ import annotations

import gc

from torch import nn

from tensorshard.comm import dist_ops


class _Bucket:
    """What a slot holds of the bucket: a weak reference."""


def test_a_slot_goes_with_its_module():
    bucket, owner = _Bucket(), nn.Linear(2, 2)
    slot = dist_ops.deferred_slot(bucket, owner, "_parameters", "bias")
    assert dist_ops._deferred[slot][1]() is owner
    del owner
    gc.collect()
    assert slot not in dist_ops._deferred
