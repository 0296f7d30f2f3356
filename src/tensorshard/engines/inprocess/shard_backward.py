"""The in-process engine's backward pass when every shard owns its autograd graph: one backward per shard.

Forward: each shard gets its own leaf copy of every input that needs a gradient, runs its forward in its
thread and builds a graph of its own (collectives are per-shard nodes, comm/thread_collectives.py). The caller gets
the outputs through ONE autograd node, `_Boundary`, whose inputs are the caller's tensors that need a
gradient. Backward: the caller's `backward()` reaches that node; it hands every shard its share of the
output gradient and runs the shards' backward passes at the same time, one per shard thread (as the
forward runs, in the engine's worker threads, under the same call lock, timeout and failure handling),
their collectives meeting at the rendezvous; then it returns the input gradients of one shard (under the
SPMD convention every shard holds the same, full gradient of a replicated input).

Who runs a shard's backward nodes is PyTorch's autograd engine: on CPU the thread that starts that
shard's backward, so the shards' passes run in parallel; on a GPU that device's autograd thread. The
boundary node itself runs in the caller's autograd thread (on a GPU: the output device's), so the shard on
the output device is the one it runs itself; the others' devices have threads of their own.

What the caller asked for is honoured shard by shard: `backward()` accumulates into every shard's
parameters (their hooks fire there, once per parameter and pass); `torch.autograd.grad(out, x)` and
`backward(inputs=[x])` compute input gradients only and leave the parameters alone; `retain_graph=True`
keeps the shards' graphs. Naming the split model's own parameters in `inputs=` / `autograd.grad` is not
supported: they belong to the shards' graphs, not the caller's (compute `.grad` with `backward()`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd import Function

from .boundary import output_leaves
from .workers import ThreadState

_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
_BACKWARD_STATE = ThreadState(grad=False, inference=False, autocast=())  # as in autograd's own threads


class ShardGraphs:
    """What one forward call leaves for its backward pass: each shard's input leaves and output roots."""

    def __init__(self, model: nn.Module, inline: int, *, serial: bool = False) -> None:
        self.model = model
        self.serial = serial  # the backward passes one at a time, as the forward ran (a compiling call)
        self.inline = inline  # the shard whose backward the boundary node runs itself (on the output device)
        self.inputs: list[torch.Tensor] = []  # the caller's tensors that need a gradient
        self.leaves: list[list[torch.Tensor]] | None = [[] for _ in model._placement]  # rank -> its copies
        self.roots: list[list[torch.Tensor | None]] | None = None  # rank -> output (None: needs no gradient)
        self.dropout = None  # the call's dropout keys (dropout.py), for blocks recomputed in backward

    def leaf_copies(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every shard's own leaf copy of input `x` (sharing its storage where on the same device)."""
        self.inputs.append(x)
        copies = []
        for rank, device in enumerate(self.model._placement):
            leaf = (x.detach() if x.device == device else x.detach().to(device)).requires_grad_()
            self.leaves[rank].append(leaf)
            copies.append(leaf)
        return copies

    # -- backward ------------------------------------------------------------------------------------------

    def backward(self, grads: tuple[torch.Tensor | None, ...], accumulate: bool, keep: bool) -> list[torch.Tensor | None]:
        """Run every shard's backward pass from `grads` (one per root, None where unused); the inputs' gradients."""
        model = self.model
        if self.roots is None:
            raise RuntimeError(
                "Trying to backward through the graph of a tensor-parallel call a second time: its shards' graphs "
                "were freed by the first backward. Specify retain_graph=True in the first backward() call."
            )
        if model._group.running_here():
            raise RuntimeError(
                "a backward pass through this TensorParallel model started inside one of its own shards (a hook "
                "running during its forward or backward); run it after the outer call returns"
            )
        none = [None] * len(self.inputs)
        used = [i for i, g in enumerate(grads) if g is not None]
        if not used or not (accumulate or self.inputs):
            return none  # nothing to compute (identically on every shard)
        roots, leaves = self.roots, self.leaves
        if self.dropout is not None:
            model._dropout.begin_backward(self.dropout)  # blocks recomputed in it draw the forward's masks

        def run(rank: int):
            device = model._placement[rank]
            with _BACKWARD_STATE.applied(device):
                pairs = [(roots[rank][i], grads[i]) for i in used if roots[rank][i] is not None]
                outs = [o for o, _ in pairs]
                outs_grads = [g if g.device == device else g.to(device) for _, g in pairs]
                mine = leaves[rank]
                if not outs:
                    return none
                if not accumulate:
                    return list(torch.autograd.grad(outs, mine, outs_grads, retain_graph=keep, allow_unused=True))
                torch.autograd.backward(outs, outs_grads, retain_graph=keep)
                got = [leaf.grad for leaf in mine]
                for leaf in mine:
                    leaf.grad = None
                return got

        results = model._run_shards("backward", run, inline=self.inline, serial=self.serial)
        if not keep:
            self.release()
        return [None if g is None else g.to(x.device) for g, x in zip(results[self.inline], self.inputs)]

    def release(self) -> None:
        """Drop the shards' graphs (what a backward without retain_graph leaves of them)."""
        self.roots = self.leaves = None


class _Boundary(Function):
    """The caller's view of one call: inputs that need a gradient in, the shards' outputs out.

    `probe` (a view of a throwaway leaf) tells backward() from autograd.grad(): only a backward without
    `inputs=` runs every node of the graph, the probe's included."""

    @staticmethod
    def forward(ctx, graphs: ShardGraphs, values: list[torch.Tensor], probe: torch.Tensor, *inputs: torch.Tensor):
        ctx.graphs, ctx.probe = graphs, probe.grad_fn
        ctx.set_materialize_grads(False)
        return tuple(values)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "backward(create_graph=True) through an in-process split model: its shards' backward passes do not "
                "build a graph of their own. Higher-order gradients need the unsplit model."
            )
        accumulate = torch._C._will_engine_execute_node(ctx.probe)
        keep = _keep_graph() if _keep_graph is not None else True  # unknown: keep the graphs (costs memory only)
        input_grads = ctx.graphs.backward(grads, accumulate, keep)
        return (None, None, None, *input_grads)


def join_outputs(graphs: ShardGraphs, outputs: list, src: int, device: torch.device, labels, *, check_equal: bool) -> Any:
    """Shard `src`'s outputs on `device`; those that carry a gradient come out of one `_Boundary` node."""
    items, rebuild = output_leaves(outputs, src, labels, check_equal=check_equal)
    result, differentiable = [], []
    grad = torch.is_grad_enabled()
    for i, (leaf, per_rank) in enumerate(items):
        if per_rank is None:
            result.append(leaf)
            continue
        if grad and any(t.requires_grad for t in per_rank):
            differentiable.append(i)
            leaf = leaf.detach()  # shares the version counter: an in-place change the shard's graph needs is caught
        result.append(leaf if leaf.device == device else leaf.to(device))
    if not differentiable:
        return rebuild(result)
    graphs.roots = [
        [items[i][1][rank] if items[i][1][rank].requires_grad else None for i in differentiable]
        for rank in range(len(outputs))
    ]
    anchor = torch.empty(0, requires_grad=True)
    outs = _Boundary.apply(graphs, [result[i] for i in differentiable], anchor.view_as(anchor), *graphs.inputs)
    for i, out in zip(differentiable, outs):
        result[i] = out
    return rebuild(result)
