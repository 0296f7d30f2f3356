"""The torchrun engine: one process per device, each holding its shards as DTensors on the TP mesh.

    # torchrun --nproc_per_node=4 train.py
    mesh = init_device_mesh("cuda", (4,))
    model = tp.parallelize(model, mesh, plan=plan)      # in place; returns the module

The same plans and styles as the in-process engine, applied in place to this process's copy of the model:

1. `shard_plan` validates the plan against the whole model before anything changes.
2. Every tensor is broadcast from TP rank `src_data_rank` (so ranks need not share a seed), then this rank
   keeps only its slice: split parameters become `Shard` DTensors on the mesh (see comm/dtensor.py for
   uneven and fused splits), replicated ones `Replicate` DTensors, so `fully_shard` (FSDP2) and
   `torch.distributed.checkpoint` compose with the model.
3. Each style attaches its collectives, taken from a `DistComm` on the mesh's process group.
4. Forward runs on plain local tensors: every module holding DTensors swaps in their local views for the
   duration of its own forward (inside FSDP2's hooks, so FSDP's unsharded parameters are swapped too),
   and the collectives are ours, not DTensor's: a transformer block costs 2 all-reduces each way.

The root module's forward also resets the per-call collective cache, moves input tensors to this rank's
device, for its first `check_inputs` calls checks that every TP rank got the same inputs (see engines/torchrun/data.py),
and, when it raises, tells the other ranks to stop (comm/dist_guard.py: every collective is bounded by
`timeout` and stops when another rank failed).

Under `torch.compile` the root wrapper does none of this host-side work: the graph holds the model's computation
and its collectives (comm/dist_ops.py), and a transformers model's `generate` compiles its static-cache decode
step on every device type (decoding.py).

Memory: each rank must be able to hold the whole model once (it starts from its own full copy); build the
model on the meta device with `src_data_rank=None` and load weights afterwards to avoid that.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ... import quant
from ...comm.dist import DistComm
from ...comm.objects import gather_objects
from ...comm import recovery
from ...comm.dropout import DistPeers, ShardDropout, may_drop
from ...comm.dist_guard import collective
from ...comm.dtensor import Layout, mesh_device
from ...comm.timeout import resolve_timeout
from ...global_hooks import split_model_made
from ...logs import get_logger
from ...partition import Partition
from ...plans import resolve_plan
from ...plans.balance import check_balance
from ...plans.plan import Plan
from ...plans.module_shard import ModuleShard
from ...plans.sharding import ShardedModel, direct_tensors, shard_plan
from ...plans.slices import SplitLayout, register_engine, run_after_split
from ...registrations import count_modules_and_tensors
from ...styles.style import original_forward, wrap_forward
from ..late_modules import adopt_late_modules
from ..resplit import refuse_split_twice
from ..shared_config import guard as guard_configurations
from ..split_report import report_split
from . import compiled_check, decoding
from .copies import deep_copy, keep_skeleton
from .data import check_same_inputs
from .ddp_refusal import refuse_ddp
from .local_views import LocalViews, swap_local_views, swap_wrapper_views

logger = get_logger(__name__)

DEFAULT_CHECKS = 3  # root calls whose inputs are compared across TP ranks


@dataclass
class TorchrunState:
    """What `parallelize` did to a module: kept as ``module.tensorshard``."""

    plan: Plan
    mesh: Any  # the 1-D tensor-parallel DeviceMesh
    comm: DistComm
    splits: dict[str, tuple[int, Partition] | None]  # original state-dict name -> split
    layouts: dict[str, Layout]  # state-dict name -> how this rank stores it
    checks_left: int = 0
    modules: dict[str, ModuleShard] = field(default_factory=dict)  # what the plan did to each module (late adapters)
    module_names: set[str] = field(default_factory=set)  # the module's names, to spot adapters added later
    module_count: int = 0
    registrations: int = -1  # registrations.py's count when module_count was last checked
    building: list = field(default_factory=list)  # plain stand-ins while an integration builds layers on the module
    skeleton: nn.Module | None = field(default=None, repr=False)  # the module before splitting, meta tensors (copies.py)
    skeleton_error: str = ""  # why there is no skeleton: the module could not be deep-copied
    views: LocalViews = field(default_factory=LocalViews)  # every local-view swap, made at once (local_views.py)
    balance: bool = False  # a balanced split (plans/balance.py), made again by copies


def parallelize(
    module: nn.Module,
    device_mesh,
    plan: Plan | dict | None = None,
    *,
    src_data_rank: int | None = 0,
    check_inputs: int = DEFAULT_CHECKS,
    timeout: float | None = None,
    check: bool | None = None,
    balance: bool = False,
) -> nn.Module:
    """Split `module` over the processes of a 1-D tensor-parallel mesh, in place; returns the module.

    Args:
        module: the model, whole, on every rank (CPU, its device, or the meta device).
        device_mesh: the tensor-parallel mesh, e.g. ``init_device_mesh("cuda", (4,))`` or, for 2-D,
            ``mesh["tensor_parallel"]`` (Lightning: ``self.device_mesh["tensor_parallel"]``).
        plan: a `Plan`, a ``{pattern: style}`` dict or a plan JSON path; default: preset, else inferred.
        src_data_rank: TP rank whose weights every rank takes (broadcast); None: each rank keeps its own
            (identical seeds, or meta-device models loaded later).
        check_inputs: number of first calls on which TP ranks compare their inputs (0: never).
        timeout: seconds any collective of the tensor-parallel group may wait (default: TENSORSHARD_TIMEOUT,
            else 300); set as the group's process-group timeout. docs/errors.md lists what each failure raises.
        check: self-check the plan numerically before splitting (every rank runs the same seeded check, so
            all reach the same plan); default: on for inferred plans only (docs/automatic-plans.md).
        balance: even out each rank's weights over every block whose attention heads split unevenly (the MLP
            beside it gets per-rank sizes that make up the difference; plans/balance.py). Default off.
    """

    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize() splits an nn.Module; got {type(module).__name__}")
    check_balance(balance)
    quant.check_quantized_model(module, "torchrun")
    done = getattr(module, "tensorshard", None)
    if isinstance(done, TorchrunState):
        same_plan = plan is None or (isinstance(plan, Mapping) and done.plan == Plan(plan))
        if done.mesh == device_mesh and same_plan and done.balance == balance:
            return module  # idempotent, as Lightning's configure_model must be
        raise TypeError(
            f"this {type(module).__name__} is already parallelized on mesh {done.mesh} with another plan or mesh; "
            "parallelize the original model once"
        )
    refuse_split_twice(module)
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"device_mesh must be a torch DeviceMesh, got {type(device_mesh).__name__}; build one with "
            "torch.distributed.device_mesh.init_device_mesh('cuda', (world_size,)) under torchrun"
        )
    if device_mesh.ndim != 1:
        raise ValueError(
            f"parallelize() needs the 1-D tensor-parallel mesh; got a {device_mesh.ndim}-D mesh with dims "
            f"{device_mesh.mesh_dim_names}. Pass its tensor-parallel dimension, e.g. mesh['tensor_parallel'] "
            "(Lightning: self.device_mesh['tensor_parallel'])."
        )
    if device_mesh.get_coordinate() is None:
        raise ValueError(f"rank {dist.get_rank()} is not part of device_mesh {device_mesh}; every rank must pass its own TP mesh")
    if isinstance(check_inputs, bool) or not isinstance(check_inputs, int) or check_inputs < 0:
        raise ValueError(f"check_inputs must be a number of calls >= 0; got {check_inputs!r}")
    timeout = resolve_timeout(timeout)
    world = device_mesh.size()
    if src_data_rank is not None and not 0 <= src_data_rank < world:
        raise ValueError(f"src_data_rank={src_data_rank} is not a rank of the {world}-rank mesh; use 0..{world - 1} or None")


    plan = resolve_plan(module, plan, world, check=check)
    comm = DistComm(device_mesh, timeout)
    recovery.restore(comm.guard)  # the group's native collectives, after a failure the ranks went through together
    _check_same_plan(plan, comm, balance)  # first: a plan error below would otherwise stop only the ranks that have it
    skeleton, skeleton_error = keep_skeleton(module)  # before anything changes: copy.deepcopy splits it again
    source = None if src_data_rank is None else dist.get_global_rank(comm.group, src_data_rank)
    state = _split(module, plan, comm, check_inputs, source, balance=balance)
    state.skeleton, state.skeleton_error = skeleton, skeleton_error

    if dist.get_rank() == 0:
        split = {n for n, m in state.modules.items() if m.splits}
        report_split(module, plan, split, world, (
            f"parallelized {type(module).__name__} over {world} rank(s) of mesh {device_mesh.mesh.tolist()}: "
            f"{len(split)} module(s) split, {len(plan)} plan entries; collectives time out after {timeout:g} s"
        ))
    return module


def _split(module: nn.Module, plan: Plan, comm: DistComm, check_inputs: int, source: int | None, *,
           balance: bool = False) -> TorchrunState:
    """Steps 1-4 of the module docstring on `module`, in place (also how copies.py splits a copy of the skeleton:
    `source` None, no broadcast). Returns the state it also keeps as ``module.tensorshard``."""
    mesh, world, rank = comm.mesh, comm.world_size, comm.rank
    sharded = shard_plan(module, plan, world, balance=balance)  # raises on any plan error; the model is untouched
    state = TorchrunState(plan, mesh, comm, sharded.slice_map(module), {}, check_inputs, dict(sharded.modules),
                          balance=balance)
    try:
        held = _distribute(module, sharded, state, mesh_device(mesh), source)
        by_name = dict(module.named_modules())
        if world > 1:
            for name, ms in sharded.modules.items():
                ms.style.attach(by_name[name], ms.splits, ms.context(rank, world, comm))
        for mod, tensors in held.items():
            swap_local_views(mod, tensors, state)  # after attach: outermost, and partial grads are known
        swap_wrapper_views(module, state)  # layer wrappers that read their layer's tensors (layers.py)
    except BaseException as e:
        comm.guard.report(e, f"parallelize({type(module).__name__})")  # the others stop waiting for this rank
        raise
    guard_configurations([module], f"over {world} rank(s)")  # fields that size the split stay (shared_config.py)
    _wrap_root(module, state)
    if world > 1:
        refuse_ddp(module, world)  # DDP across the TP ranks is never right: say so, naming the fix
    decoding.install(module, comm.guard, state)  # generate() compiles its decode step on every device (decoding.py)
    module.tensorshard = state
    # copy.deepcopy finds this on the instance: a second split model, not a copy of closures (copies.py)
    module.__dict__["__deepcopy__"] = lambda memo: deep_copy(module, memo, _split)
    state.module_names = {n for n, _ in module.named_modules()}
    state.module_count = count_modules_and_tensors(module)
    run_after_split(module)  # e.g. a transformers model's save_pretrained gathers (checkpoint/gather.py)
    split_model_made(module)  # the process-wide hooks this model needs, while it lives (global_hooks.py)
    return state


@register_engine
def split_layout(module: object) -> SplitLayout | None:
    """What this engine did to `module` (None if it did not split it): this process's rank only."""
    state = getattr(module, "tensorshard", None)
    if not isinstance(state, TorchrunState):
        return None
    return SplitLayout("torchrun", state.plan, dict(state.splits), [module], [mesh_device(state.mesh)], state=state)


def _check_same_plan(plan: Plan, comm: DistComm, balance: bool = False) -> None:
    """Every rank of the group resolved the same plan (and `balance`), or all of them raise (before anything
    changes)."""
    digest = hashlib.sha1((plan.table() + (" balanced" if balance else "")).encode()).hexdigest()
    digests = gather_objects(digest, comm.group, what="parallelize: comparing the ranks' plans")
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ValueError(
            f"the tensor-parallel ranks resolved different plans: rank(s) {differ} differ from rank 0. Every rank "
            "must split the same model with the same plan: build the model identically everywhere (same config "
            "and code), or pass the same plan= on every rank (tp.Plan.load('plan.json'))"
        )


# --- building the local shards ------------------------------------------------------------------------


def _distribute(module: nn.Module, sharded: ShardedModel, state: TorchrunState, device, source: int | None) -> dict:
    """Replace every parameter and buffer by this rank's local slice (a DTensor, or a plain replicated
    buffer). Returns {module: {(kind, name): layout}} for the tensors that are now DTensors."""
    rank = state.comm.rank
    made: dict[int, torch.Tensor] = {}
    held: dict[nn.Module, dict[tuple[str, str], Layout]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for kind, name, t in list(direct_tensors(mod)):
            split = sharded.split_of(t)
            layout = Layout.of(split, rank)
            key = f"{mod_name}.{name}" if mod_name else name
            state.layouts[key] = layout
            if id(t) not in made:
                made[id(t)] = _local_tensor(t, kind, split, layout, state, device, source, key)
            (mod._parameters if kind == "param" else mod._buffers)[name] = made[id(t)]
            if kind == "param" or split is not None:
                held.setdefault(mod, {})[(kind, name)] = layout
    return held


def _local_tensor(t, kind: str, split, layout: Layout, state: TorchrunState, device, source: int | None, key: str):
    full = t.detach()
    if not full.is_meta:
        full = full.to(device)
        if source is not None:
            full = full.contiguous()
            what = f"broadcast of {key} from rank {source} (parallelize)"
            collective(dist.broadcast, full, full, src=source, group=state.comm.group, what=what)
    if split is not None:
        dim, part = split
        local = part.take(full, dim, state.comm.rank).clone(memory_format=torch.contiguous_format)
    else:
        local = full
    if kind == "buffer":
        return layout.to_dtensor(local, state.mesh) if split is not None else local
    return nn.Parameter(layout.to_dtensor(local, state.mesh), requires_grad=t.requires_grad)


def _wrap_root(root: nn.Module, state: TorchrunState) -> None:
    """Around the root forward: the per-call collective cache, inputs moved to this rank's device, the first
    calls' identical-input check, and a failure report to the other ranks when the forward raises."""

    inner = root.forward
    try:
        signature = inspect.signature(original_forward(root))
    except (TypeError, ValueError):
        signature = None
    comm = state.comm
    device = mesh_device(state.mesh)
    where = f"the forward of {type(root).__name__}"
    # dropout in training: one mask per replicated activation on every rank (comm/dropout.py); the last few
    # calls' keys are kept for blocks that activation checkpointing recomputes in backward
    dropout = ShardDropout(DistPeers(comm), keep=8) if comm.world_size > 1 and may_drop(root) else None
    if dropout is not None:
        dropout.install([root])
    outermost = {"depth": 0}
    check_key = compiled_check.register(state) if state.checks_left > 0 and comm.world_size > 1 else None
    parameter_names = list(signature.parameters) if signature is not None else []

    def forward(*args, **kwargs):
        if torch.compiler.is_compiling():
            # What torch.compile traces (docs/torchrun.md, "Compiled decoding"; docs/compile.md): the model's own
            # computation and its collectives only. The host-side work (adopting late adapters, moving inputs,
            # failure reports) is not part of a graph; in training, the first calls' input check is, as an
            # operator (compiled_check.py). Dropout in training draws the eager masks through operators of the
            # graph (comm/dropout.py).
            if check_key is not None and root.training:
                compiled_check.call(check_key, type(root).__name__, parameter_names, args, kwargs)
            try:
                if dropout is not None and root.training:
                    with dropout.mode():
                        return inner(*args, **kwargs)
                return inner(*args, **kwargs)
            finally:
                comm.end_traced_call()
        return eager(*args, **kwargs)

    def eager(*args, **kwargs):
        comm.begin_call()
        outermost["depth"] += 1
        try:
            adopt_late_modules("torchrun", root)  # PEFT adapters added since parallelize follow the split (late_modules.py)
            args, kwargs = _inputs_on(device, args, kwargs, signature)
            if state.checks_left > 0 and comm.world_size > 1:
                state.checks_left -= 1
                check_same_inputs(_named_inputs(signature, args, kwargs), comm.group, where=type(root).__name__)
            if dropout is not None and root.training and outermost["depth"] == 1:
                dropout.begin_forward()
                dropout.in_call = True  # a compiled model forward inside draws from this record (comm/dropout.py)
                try:
                    with dropout.mode():
                        return inner(*args, **kwargs)
                finally:
                    dropout.in_call = False
            return inner(*args, **kwargs)
        except BaseException as e:
            comm.guard.report(e, where)
            raise
        finally:
            outermost["depth"] -= 1
            comm.end_call()

    wrap_forward(root, forward)


def _inputs_on(device: torch.device, args: tuple, kwargs: dict, signature) -> tuple[tuple, dict]:
    """Input tensors on another device than this rank's are moved to it (as DDP and FSDP2 do); tensors on
    the meta device have no values and are refused, naming the input."""
    leaves, spec = tree_flatten((args, kwargs))
    if not any(isinstance(x, torch.Tensor) and x.device != device for x in leaves):
        return args, kwargs
    for name, value in _named_inputs(signature, args, kwargs).items():
        meta = next((x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor) and x.is_meta), None)
        if meta is not None:
            raise ValueError(
                f"input {name!r} (shape {list(meta.shape)}) is on the meta device: it has no values to compute "
                f"with. Pass real tensors (inputs on another device than this rank's {device} are moved to it)."
            )
    moved = [x.to(device) if isinstance(x, torch.Tensor) and not _is_dtensor(x) else x for x in leaves]
    return tree_unflatten(moved, spec)


def _is_dtensor(x) -> bool:
    return isinstance(x, DTensor)


def _named_inputs(signature, args, kwargs) -> dict[str, Any]:
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
            return dict(bound.arguments)
        except TypeError:
            pass
    return {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}


def synchronize_rng(device_mesh, seed: int | None = None) -> int:
    """Seed torch's RNG identically on every rank of `device_mesh` (TP rank 0's seed): sampling in
    `generate()` then draws the same tokens everywhere. Returns the seed."""
    group = device_mesh.get_group()
    value = torch.tensor([seed if seed is not None else int(torch.randint(0, 2**62, ()))], dtype=torch.int64)
    if device_mesh.device_type != "cpu":
        value = value.to(mesh_device(device_mesh))
    source = dist.get_global_rank(group, 0)
    collective(dist.broadcast, value, value, src=source, group=group, what=f"broadcast of the seed from rank {source} (synchronize_rng)")
    seed = int(value.item())
    torch.manual_seed(seed)
    return seed
