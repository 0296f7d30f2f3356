"""Replicated parameters whose gradients are partial sums, in the in-process engine.

Some parameters stay whole on every device but see only part of the computation: the A matrix of a LoRA
adapter beside a column-parallel layer (each device's B reads only its output slice), the B matrix beside a
row-parallel one (each device's A reads only its input slice). Each copy's gradient is then a partial sum;
the true gradient is their sum over the devices.

Rather than one all-reduce per parameter as it is used, every shard passes all such parameters, at the
start of each forward call, through one identity node, and autograd calls its backward once every use
has contributed: comm/functions.py's `SumGrads`. When every shard owns its graph (the default), that node is the
shard's own (`OneShard`, comm/thread_collectives.py): its backward meets the other shards' at the rendezvous of
the backward pass, where the last to arrive sums each parameter's gradients in rank order (counted as one
``all_reduce`` at "partial gradients") and every shard takes the bit-identical sum. When one graph spans
the shards (debug mode on a GPU), the node is ONE across them (`AllShards`), with the same sums.
The copies stay identical and match the unsplit model; gradient accumulation and ZeRO-3 compose (the
node reads the gathered tensors, whose backward then keeps each device's rows).

A module recomputed in backward (activation checkpointing) runs outside the whole shard's forward: with
its parameters, not the node's views. A module holding such parameters therefore routes its own through a
node of its own when it runs in a backward pass (one more all-reduce per recomputed module, at
"partial gradients <name> (recomputed)"); a non-reentrant checkpoint, whose recomputation only refills
saved tensors, never runs that node's backward. The torchrun engine does the same job with its
`PartialGradBucket` (comm/grad_bucket.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .functions import SumGrads
from .thread_collectives import AllShards, OneShard

WHERE = "partial gradients"


class PartialGrads:
    """The parameters with partial gradients of every shard, and the hooks that route them through one node."""

    def __init__(self, group) -> None:
        self.group = group
        self._shards = [OneShard(group, rank) for rank in range(group.world_size)]  # each shard owning its graph
        self._all_shards = AllShards(group.devices)  # one graph spanning the shards
        self.owners: list[list[tuple[nn.Module, str]]] = [[] for _ in range(group.world_size)]
        self.names: set[str] = set()  # their names in the shards (ZeRO-3 and checkpoints know them by name)
        self._saved: list[list[torch.Tensor] | None] = [None] * group.world_size
        self._depth = [0] * group.world_size  # nested hooked calls (a view's module inside the root's call) route once
        self._installed: set[int] = set()  # ids of the shards, views and modules hooked
        self._recomputing: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(group.world_size)]

    def register(self, module: nn.Module, names: Sequence[str], rank: int, where: str) -> None:
        self.owners[rank].extend((module, n) for n in names)
        self.names.update(f"{where}.{n}" if where else n for n in names)

    def install(self, shards: Sequence[nn.Module]) -> None:
        """Hook every shard's forward (or a view's modules: TensorParallel.view), after ZeRO-3's hooks so the
        node reads gathered tensors, and (each shard owning its graph) every module holding such parameters,
        for its recomputation in backward; idempotent."""
        for rank, shard in enumerate(shards):
            if id(shard) not in self._installed:
                shard.register_forward_pre_hook(self._before(rank))
                shard.register_forward_hook(self._after(rank), prepend=True, always_call=True)  # before ZeRO-3 releases
                self._installed.add(id(shard))
            if not self.group.own_graphs:
                continue  # one graph across the shards: nothing can be recomputed in backward (rendezvous.py)
            names = {id(m): n for n, m in shard.named_modules()}
            for module, _ in self.owners[rank]:
                if id(module) not in self._installed and id(module) in names:
                    module.register_forward_pre_hook(self._recomputed(rank, module, names[id(module)]))
                    module.register_forward_hook(self._after_recomputed(rank, module), prepend=True, always_call=True)
                    self._installed.add(id(module))

    def _recomputed(self, rank: int, module: nn.Module, name: str):
        where = f"{WHERE} {name} (recomputed)"

        def hook(mod, args):
            if self._depth[rank] > 0 or not torch.is_grad_enabled() or not self.group.in_backward(rank):
                return  # inside the whole shard's call (routed there), or not recomputing for a backward pass
            mine = [n for m, n in self.owners[rank] if m is module and module._parameters[n].requires_grad]
            if not mine:
                return
            current = [module._parameters[n] for n in mine]
            self._recomputing[rank][id(module)] = list(zip(mine, current))
            for n, v in zip(mine, SumGrads.apply(self._shards[rank], where, len(current), *current)):
                module._parameters[n] = v

        return hook

    def _after_recomputed(self, rank: int, module: nn.Module):
        def hook(mod, args, output):
            for n, p in self._recomputing[rank].pop(id(module), None) or ():
                module._parameters[n] = p

        return hook

    def _before(self, rank: int):
        def hook(module, args):
            self._depth[rank] += 1
            if self._depth[rank] > 1 or not torch.is_grad_enabled():
                return
            # only the trainable ones, as they are now (PEFT's set_adapter switches them on every device alike)
            owners = [(m, n) for m, n in self.owners[rank] if m._parameters[n].requires_grad]
            if not owners:
                return
            current = [m._parameters[n] for m, n in owners]
            self._saved[rank] = list(zip(owners, current))
            if self.group.own_graphs:
                views = SumGrads.apply(self._shards[rank], WHERE, len(current), *current)
            else:
                views = self.group.exchange(rank, "partial_grads", WHERE, current, self._route)
            for (m, n), v in zip(owners, views):
                m._parameters[n] = v

        return hook

    def _after(self, rank: int):
        def hook(module, args, output):
            self._depth[rank] = max(self._depth[rank] - 1, 0)
            if self._depth[rank] > 0:
                return
            saved, self._saved[rank] = self._saved[rank], None
            for (m, n), p in saved or ():
                m._parameters[n] = p

        return hook

    def _route(self, payloads: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Runs once per call, in the last shard to arrive."""
        count = len(payloads[0])
        outs = SumGrads.apply(self._all_shards, WHERE, count, *[p for per_rank in payloads for p in per_rank])
        return [list(outs[r * count:(r + 1) * count]) for r in range(len(payloads))]
