"""Adapters added to a model after it was split: adopted so that they follow the split, or refused.

    model = tp.tensor_parallel(model, devices)
    model = get_peft_model(model, LoraConfig(...))          # or PeftModel.from_pretrained(model, "adapter/")

PEFT then wraps the layers of every shard separately: each device's adapter layer gets its own random
tensors, sized from its split base layer, and PEFT's forward would neither share the whole tensors nor sum
the partial results. `adopt_late_modules` finds what PEFT added (LoRA, DoRA and IA3 layers, a new adapter
in an existing layer, modules_to_save copies) and gives it what the plan would have given it had it existed
before splitting (plans/adapters.py): the same styles and the same split of every tensor, with values that
form one adapter. A tensor that stays whole takes the first device's values everywhere; a split tensor
keeps each device's slice (a row several devices hold, of a replicated KV head, takes its first holder's);
a DoRA magnitude is recomputed from the adopted factors as PEFT initialises it, ||W + s B A|| per output
row (summed over the devices beside a row-parallel layer). From then on the model trains exactly like an
unsplit model holding the same (gathered) adapter, and `splits` knows the adapter's tensors by their unsplit
names, so gathered saves and unsplit loads work (integrations/peft/after_split.py: PEFT's own
``save_pretrained`` and ``load_adapter``).

It runs when PEFT hands the split model to a PeftModel (integrations/peft/after_split.py), when transformers'
``add_adapter`` / ``load_adapter`` of a split model return, and otherwise before the next forward call,
state_dict() or load_state_dict(). What was added, and how it must be split, comes from plans/late_adapters.py,
which checks everything before anything changes: what cannot follow the split (a LoRA variant other than
DoRA, another PEFT method's layer, an adapter on a layer split some other way, modules_to_save on a module
ZeRO-3 partitions, any other module added to the shards) is refused with the fix, and PEFT's additions are
taken out again, leaving the split model as it was. The adapter's whole trainable tensors are then
partitioned ZeRO-3 style (zero.py), as they would be in a PeftModel split in training mode, so gradient
clipping over ``model.parameters()`` (the Trainer's) counts each element once.
"""

from __future__ import annotations


import torch
from torch import nn

from ...comm.dropout import ShardDropout, ThreadPeers, may_drop
from ...comm.threads import ThreadComm
from ...logs import get_logger
from ...plans import late_adapters as late_plan
from ...plans.late_adapters import LateAdapters, tensor_of
from ...registrations import count_modules_and_tensors, nothing_added, registrations
from ...styles.style import ShardContext
from .views import follow_root, root_of
from .zero import shard_added

logger = get_logger(__name__)


def module_count(model) -> int:
    """Modules and tensors of the first shard: a change means something was added since the last look."""
    return count_modules_and_tensors(model.module_shards[0])


def adopt_late_modules(model) -> None:
    """Adopt what was added to `model`'s shards since splitting (see the module docstring); cheap when nothing was."""
    root = root_of(model)
    if root is not model:  # a view never adopts on its own: its split model does, then the view follows (views.py)
        adopt_late_modules(root)
        follow_root(model)
        return
    seen = nothing_added(model.module_shards[0], model.__dict__.get("_registrations"), model._module_count)
    if seen is not None:
        model._registrations = seen
        return
    try:
        late = _plan(model)  # every check, before any change
    except NotImplementedError:
        take_out_late_modules(model)
        raise
    with torch.no_grad():
        _rename_moved(model, late)
        _make_one_adapter(model, late)
    _attach(model, late)
    shard_added(model, _zero_candidates(model, late))
    partial = getattr(model._group, "partial_grads", None)
    if partial is not None:
        partial.install(model.module_shards)  # whole tensors with partial gradients: summed once per backward pass
    _consistent_dropout(model, late)
    model._module_names = {n for n, _ in model.module_shards[0].named_modules()}
    model._module_count = module_count(model)
    model._registrations = registrations()  # only now: an adoption that failed half-way is looked at again
    if late.tensors:
        logger.info("adopted %d adapter tensor(s) in %d layer(s) added after splitting; they follow their layers' "
                    "splits", len(late.tensors), len(late.wrappers))


def take_out_late_modules(model) -> None:
    """Undo what PEFT added to the shards since the last adoption; the split model is left as it was."""
    for shard in model.module_shards:
        late_plan.take_out_late_adapters(shard, model._module_names, model.splits)
    model._module_count = module_count(model)


def _plan(model) -> LateAdapters:
    zero = getattr(model, "zero_splits", None) or {}
    shards = list(model.module_shards)
    return late_plan.plan_late_adapters(
        shards[0], known=model._module_names, splits=model.splits, modules=model._layout_modules,
        zero=zero.__contains__, engine="before tensor_parallel()",
        local_sizes=lambda late, name: [(r, tensor_of(s, name).shape[late.splits[name][0]]) for r, s in enumerate(shards)],
    )


def _rename_moved(model, late: LateAdapters) -> None:
    """The wrapped modules' tensors, plan records and ZeRO-3 partitions under their new names; the new tensors' splits."""
    model.splits = {late.moved_name(n): s for n, s in model.splits.items()}
    zero = getattr(model, "zero_splits", None)
    if zero:
        model.zero_splits = {late.moved_name(n): s for n, s in zero.items()}
    late_plan.rename_modules(model._layout_modules, late)
    model.splits.update(late.splits)


def _make_one_adapter(model, late: LateAdapters) -> None:
    """Values that form one adapter: whole tensors from the first device, replicated rows from their first holder,
    DoRA magnitudes recomputed from the adopted factors."""
    shards = list(model.module_shards)
    first = model._placement[0]
    for name, split in late.splits.items():
        local = [tensor_of(s, name) for s in shards]
        if split is None:
            for t in local[1:]:
                t.copy_(local[0].to(t.device))
        elif split[1].overlapping:
            dim, part = split
            whole = part.assemble([t.to(first) for t in local], dim)
            for rank, t in enumerate(local):
                t.copy_(part.take(whole, dim, rank).to(t.device))
    _recompute_magnitudes(model, late)


def _recompute_magnitudes(model, late: LateAdapters) -> None:
    """DoRA magnitudes from the adopted factors, the squared row norms summed over the devices' column slices
    beside a row-parallel layer (plans/late_adapters.py)."""

    def summed(_name: str, squares: list[torch.Tensor]) -> list[torch.Tensor]:
        total = sum(s.to(squares[0].device) for s in squares)
        return [total.to(s.device) for s in squares]

    def local_weight(_name: str, layer: nn.Module) -> torch.Tensor:
        return layer.get_base_layer().weight

    late_plan.recompute_dora_magnitudes(late, list(model.module_shards), local_weight, summed)


def _attach(model, late: LateAdapters) -> None:
    world = len(model.module_shards)
    if world == 1:
        return
    for rank, shard in enumerate(model.module_shards):
        comm = ThreadComm(model._group, rank)
        for name, (style, splits, heads, where) in late.attach.items():
            module = shard.get_submodule(name)
            module.__dict__.pop("forward", None)  # a modules_to_save copy runs its own forward, not the original's
            style.attach(module, splits, ShardContext(rank=rank, world_size=world, name=where, comm=comm, heads=heads))


def _zero_candidates(model, late: LateAdapters) -> list[str]:
    """The new tensors ZeRO-3 partitions, as it would at split time when training (zero.py): trainable whole
    parameters with at least as many rows as devices."""
    world = len(model.module_shards)
    shard = model.module_shards[0]
    out = []
    for name, split in late.splits.items():
        t = tensor_of(shard, name)
        if split is None and isinstance(t, nn.Parameter) and t.requires_grad and t.dim() >= 1 and t.shape[0] >= world:
            out.append(name)
    return out


def _consistent_dropout(model, late: LateAdapters) -> None:
    """Adapters with dropout draw one mask per replicated activation on every device (comm/dropout.py)."""
    if len(model.module_shards) == 1:
        return
    wrappers = [[s.get_submodule(n) for s in model.module_shards] for n in late.wrappers]
    if not any(may_drop(ws[0]) for ws in wrappers):
        return
    if model._dropout is None:
        model._dropout = ShardDropout(ThreadPeers(model._group))
        model._dropout.install(model.module_shards)
        return
    for ws in wrappers:
        model._dropout.install(ws)

