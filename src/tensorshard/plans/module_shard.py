"""`ModuleShard`: what a plan does to one module (its style, head groups and tensor splits), shared by
plans/sharding.py, which builds them, and plans/validate.py, which checks neighbouring ones agree."""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.interface import Comm
from ..partition import HeadGroups
from ..styles.style import ShardContext, Splits, Style


@dataclass
class ModuleShard:
    """What the plan does to one module."""

    name: str
    pattern: str
    style: Style
    heads: HeadGroups | None
    splits: Splits
    plain_sizes: tuple[int, ...] | None = None  # a balanced split's sizes for its plain blocks (plans/balance.py)

    def context(self, rank: int, world_size: int, comm: Comm) -> ShardContext:
        return ShardContext(rank=rank, world_size=world_size, name=self.name, comm=comm, heads=self.heads,
                            plain_sizes=self.plain_sizes)
