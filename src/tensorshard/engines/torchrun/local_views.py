"""A parallelized module's forward runs on plain local tensors: its DTensor parameters and buffers are swapped
for their local views for the duration of its own forward (engine.py step 4).

Two kinds of module read tensors they do not own, outside their owner's forward, and get the views of those too:
a PEFT adapter layer (DoRA reads its base layer's weight; IA3 its ``ia3_l`` vectors, held in a ParameterDict
that has no forward) and anything PEFT builds while it adds adapters after `parallelize`: `building_views`
shows every layer its local slices until the engine adopts the new adapters (integrations/peft/late_adapters.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...comm.dtensor import Layout
from ...comm.old_torch import to_local
from ...layers import is_adapter_layer
from ...plans.sharding import direct_tensors
from ...styles.style import wrap_forward


def swap_local_views(mod: nn.Module, held: dict[tuple[str, str], Layout], state) -> None:
    """Make `mod`'s forward see the local tensors of its DTensor parameters/buffers (`state`: the TorchrunState)."""
    _wrap(mod, [(mod, kind, name, layout) for (kind, name), layout in held.items()], state)


def swap_subtree_views(layer: nn.Module, name: str, state) -> None:
    """Make an adapter layer's forward (module `name`) see the local tensors of every DTensor below it."""
    entries = []
    for sub_name, sub in layer.named_modules(prefix=name):
        for kind, attr, t in direct_tensors(sub):
            key = f"{sub_name}.{attr}"
            if isinstance(t, DTensor) and key in state.layouts:
                entries.append((sub, kind, attr, state.layouts[key]))
    if entries:
        _wrap(layer, entries, state)


def swap_adapter_layers(root: nn.Module, state, names=None) -> None:
    """`swap_subtree_views` for every PEFT adapter layer of `root` (or those named)."""
    for name, module in root.named_modules():
        if is_adapter_layer(module) and (names is None or name in names):
            swap_subtree_views(module, name, state)


def _wrap(around: nn.Module, entries: list[tuple[nn.Module, str, str, Layout]], state) -> None:
    comm, mesh = state.comm, state.mesh
    table_of = {"param": "_parameters", "buffer": "_buffers"}
    entries = [(owner, table_of[kind], name, layout, (id(owner), name) in comm.partial) for owner, kind, name, layout in entries]
    inner = around.forward

    def forward(*args, **kwargs):
        # in eval mode without autograd, the stored local tensors themselves (see below); otherwise views that keep
        # autograd's link (a forward entered without it may turn it on inside: activation checkpointing, say)
        grad = torch.is_grad_enabled() or around.training
        saved = []
        for owner, table_name, name, layout, partial in entries:
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
            if partial:
                # FSDP2 reads a managed module's gradients right after its backward: reduce on the spot.
                on_the_spot = getattr(owner, "_is_fsdp_managed_module", False)
                local = comm.defer_grad(local, t, on_the_spot=on_the_spot, where=f"{type(owner).__name__}.{name}")
            saved.append((table, name, t))
            table[name] = local
        try:
            return inner(*args, **kwargs)
        finally:
            for table, name, t in saved:
                table[name] = t

    wrap_forward(around, forward)


def building_views(root: nn.Module, state) -> None:
    """While PEFT adds adapter layers to the parallelized `root`: every DTensor parameter is replaced by a plain
    parameter holding this rank's slice (PEFT's code reads base weights with plain tensors beside them: DoRA's
    row norms). `restore_after_building` puts the DTensors back (the engine does, before adopting)."""
    if state.building:
        return
    for name, module in root.named_modules():
        for attr, t in list(module._parameters.items()):
            key = f"{name}.{attr}" if name else attr
            if isinstance(t, DTensor) and key in state.layouts:
                stand_in = nn.Parameter(state.layouts[key].view(t.to_local().detach()), requires_grad=t.requires_grad)
                state.building.append((module, attr, t, stand_in))
                module._parameters[attr] = stand_in


def restore_after_building(state) -> None:
    """The DTensors back in place of `building_views`' stand-ins, with the trainable flags PEFT gave those."""
    for module, attr, original, stand_in in state.building:
        if module._parameters.get(attr) is stand_in:
            module._parameters[attr] = original
        original.requires_grad_(stand_in.requires_grad)
    state.building = []
