"""A parallelized module's forward runs on plain local tensors: its DTensor parameters and buffers are swapped
for their local views for the duration of its own forward (engine.py step 4).

A layer wrapper that reads the wrapped layer's tensors in its own forward (layers.py `register_layer_wrapper`,
``reads_inner``: an adapter library's, registered by its integration) gets the views of every tensor below it too
(`swap_wrapper_views`), since it reads them outside their owner's forward.

A compiled call without gradients (generate's decode step, decoding.py) swaps every view in once, outside the
graph, for the whole call (`LocalViews.all_local`): each wrapper then passes straight through, so dynamo neither
traces nor guards the swaps (SmolLM2's shape at 2 ranks: a guard tree of ~6,000 nodes checked per token instead
of ~20,000, and several seconds less to build it at the first call).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...comm.dtensor import Layout
from ...comm.old_torch import to_local
from ...layers import layer_wrapper
from ...plans.sharding import direct_tensors
from ...styles.style import no_grad_chooser, wrap_forward


class LocalViews:
    """Every swap the wrappers of one split model make, so that a call can make them all at once (`all_local`)."""

    def __init__(self) -> None:
        self.swaps: list[tuple[nn.Module, list]] = []  # (the wrapped module, its entries as _wrap keeps them)
        self.active = False  # read by every wrapper: the views are in place, pass straight through

    @contextmanager
    def all_local(self, mesh):
        """For a call without gradients, every wrapped module in eval mode: each DTensor of `mesh` below the model
        replaced by its local view for the duration, the wrappers passing through. Otherwise (gradients on, a
        module training, already inside, a DTensor of another mesh): nothing changes, the wrappers swap as usual."""
        views = self._views(mesh) if self.quiet() else None
        if views is None:
            yield
            return
        for table, name, _, local in views:
            table[name] = local
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for table, name, t, _ in views:
                table[name] = t

    def quiet(self) -> bool:
        """Whether a call now could run on the local views (`all_local`): no gradients, no wrapped module training,
        not inside another such call."""
        return not (self.active or torch.is_grad_enabled() or any(around.training for around, _ in self.swaps))

    def _views(self, mesh) -> list | None:
        """(table, name, DTensor, its local view) for every swap; None where a DTensor of another mesh is among them
        (FSDP2 on a 2-D mesh: the wrappers' own rules decide those)."""
        views = []
        for _, entries in self.swaps:
            for owner, table_name, name, layout, _partial in entries:  # partial: matters with gradients only
                table = getattr(owner, table_name)
                t = table.get(name)
                if isinstance(t, DTensor):
                    if t.device_mesh != mesh:
                        return None
                    views.append((table, name, t, layout.view(t._local_tensor)))
        return views


def swap_local_views(mod: nn.Module, held: dict[tuple[str, str], Layout], state) -> None:
    """Make `mod`'s forward see the local tensors of its DTensor parameters/buffers (`state`: the TorchrunState)."""
    _wrap(mod, [(mod, kind, name, layout) for (kind, name), layout in held.items()], state)


def swap_subtree_views(layer: nn.Module, name: str, state) -> None:
    """Make a layer wrapper's forward (module `name`) see the local tensors of every DTensor below it."""
    entries = []
    for sub_name, sub in layer.named_modules(prefix=name):
        for kind, attr, t in direct_tensors(sub):
            key = f"{sub_name}.{attr}"
            if isinstance(t, DTensor) and key in state.layouts:
                entries.append((sub, kind, attr, state.layouts[key]))
    if entries:
        _wrap(layer, entries, state)


def swap_wrapper_views(root: nn.Module, state, names=None) -> None:
    """`swap_subtree_views` for every layer wrapper of `root` (or those named) that reads its layer's tensors."""
    for name, module in root.named_modules():
        wrapper = layer_wrapper(module)
        if wrapper is not None and wrapper.reads_inner and (names is None or name in names):
            swap_subtree_views(module, name, state)


def _wrap(around: nn.Module, entries: list[tuple[nn.Module, str, str, Layout]], state) -> None:
    comm, mesh = state.comm, state.mesh
    table_of = {"param": "_parameters", "buffer": "_buffers"}
    # a parameter with a partial gradient also gets the number naming it in compiled graphs (comm.deferred_slot)
    entries = [(owner, table_of[kind], name, layout, (id(owner), name) in comm.partial) for owner, kind, name, layout in entries]
    entries = [(*e[:4], comm.deferred_slot(e[0], e[1], e[2]) if e[4] else 0) for e in entries]
    inner = around.forward
    views = state.views
    views.swaps.append((around, entries))

    def forward(*args, **kwargs):
        if views.active:  # LocalViews.all_local put every view in place already
            return inner(*args, **kwargs)
        # in eval mode without autograd, the stored local tensors themselves (see below); otherwise views that keep
        # autograd's link (a forward entered without it may turn it on inside: activation checkpointing, say)
        grad = torch.is_grad_enabled() or around.training
        saved = []
        for owner, table_name, name, layout, slot in entries:
            table = getattr(owner, table_name)
            t = table.get(name)
            if not isinstance(t, DTensor) or (not torch.compiler.is_compiling() and t.device_mesh != mesh):
                # already local (a re-entrant call), or not a tensor of this mesh. Dynamo cannot always read a
                # traced parameter's mesh (an unresolved attribute, seen on one rank of two): compiled code takes
                # every DTensor of the module's own to be the engine's.
                continue
            # to_local() makes a Parameter view per call, which costs a module call in decoding as much as the
            # rest of this wrapper
            local = layout.view(to_local(t) if grad else t._local_tensor)
            if slot:  # a partial gradient
                # FSDP2 reads a managed module's gradients right after its backward: reduce on the spot.
                on_the_spot = getattr(owner, "_is_fsdp_managed_module", False)
                local = comm.defer_grad(local, t, on_the_spot=on_the_spot, slot=slot, where=f"{type(owner).__name__}.{name}")
            saved.append((table, name, t))
            table[name] = local
        try:
            return inner(*args, **kwargs)
        finally:
            for table, name, t in saved:
                table[name] = t

    # while dynamo traces without gradients (engines/cheap_tracing.py), in a call with the views in place (asked at
    # its entry, inside `all_local`, which keeps them for the call): straight to what is wrapped, in the shorter form
    # its style gave it (styles/style.py `wrap_forward`)
    inner_choice = no_grad_chooser(around, inner)

    def no_grad_now():
        if not views.active:
            return None
        return (inner_choice() if inner_choice is not None else None) or inner

    wrap_forward(around, forward, no_grad_now=no_grad_now)
