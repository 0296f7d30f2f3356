"""A torchrun rank's learnt decode step (direct_step.py) kept on disk, so that a later process builds it at the first
call of its kind without entering dynamo (engines/capture_store.py owns the key, the files' hashes, the writes).

    name = entry_name(model, state, guard, settings, kind)        # this rank's entry for a kind (None: not kept)
    payload = portable(model, state, guard, graph, sources, ...)  # once the kind's direct step is learnt
    pieces = restored(payload, model, state, guard, backend, arguments, name=...)  # a later process, first call
    if agree(pieces is not None, guard): ...                      # every rank uses its entry, or none does

What a direct step is built from: dynamo's FX graph as the backend got it, where each graph input comes from (a
split weight's local view by its module's path, its table, its name and its layout; a weight, an argument, a cache
tensor as engines/graph_inputs.py finds them), the Python side effects dynamo's code replays after the graph (an
attribute set to a constant on the rank's comm or on a module's global object: transformers' output-capturing
context), each input's dtype and which output field is which graph output. Only a graph with static shapes is
kept (an int input, dynamic shapes, is traced every process).

Each rank keeps its own entry: the key adds to the kind of call and the compile settings the rank, the world size,
the mesh, the group's backend, whether the native collectives are connected, and every split weight's layout. A
collective names its group by a value of this process (comm/dist_ops.py: the group's ``group_name``; the native
ones, comm/native/ops.py: the handle of the group's native region): every such argument must be the model's own
group at save, and is set to the current process's at load.

The ranks must not diverge: a rank that built its step runs the graph's collectives directly while one without an
entry would run dynamo's trace first. So before using its entry, every rank says whether it could (`agree`: one
all-reduce of one int over the model's group, at the first call of each kind of call, the store switched off or
not): the kind runs from the kept graphs on every rank, or is traced on every rank.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn

from .. import capture_store
from ..graph_inputs import InputReader, Source
from . import cpp_step

_GROUP_ARGUMENTS = ("group", "group_name")  # how tensorshard's collectives name their group (an int, a string)


def entry_name(model: nn.Module, state, guard, settings: Any, kind: Any) -> str | None:
    """This rank's entry for a kind of call (`kind`: unguarded.py's key without this process's registration count)
    under the compile `settings`; None where the store is off or something in it has no lasting description."""
    if not capture_store.enabled():
        return None
    mesh = state.mesh
    parts = [
        "torchrun direct step", kind, settings, dist.get_rank(), dist.get_world_size(), mesh.device_type,
        mesh.mesh.tolist(), mesh.mesh_dim_names, dist.get_backend(guard.group), guard.native is not None,
        sorted((name, repr(layout)) for name, layout in state.layouts.items()),
    ]
    return capture_store.key(parts, [model])


def portable(model: nn.Module, state, guard, graph: fx.GraphModule, sources: Sequence[Source],
             stores: Sequence[tuple[Any, str, Any]], dtypes: list, fields: Mapping, output_type: type) -> dict:
    """A learnt step's pieces as values (see the module doc); TypeError, ValueError or KeyError where one cannot be
    kept."""
    ours = _own_groups(state, guard)
    for node, index, name in _group_arguments(graph):
        if _argument(node, index, name) != ours[name]:
            raise ValueError(f"{node.target} runs on a group other than the split model's")
    return {
        "graph": capture_store.portable_graph(graph), "dynamo": _dynamo_meta(graph),
        "sources": capture_store.portable_sources(model, sources),
        "stores": [(_portable_owner(owner, state), attr, value) for owner, attr, value in stores],
        "dtypes": dtypes, "fields": dict(fields), "output_type": output_type,
    }


def restored(payload: dict, model: nn.Module, state, guard, backend, arguments: Mapping, *, name: str) -> dict:
    """The pieces of a `DirectStep` (direct_step.py) from what `portable` kept, its graph compiled by `backend`
    (direct_step's `_Backend`) for this call's `arguments`; an error where they do not fit this model and call."""
    gm = capture_store.restored_graph(payload["graph"])
    _restore_dynamo_meta(gm, payload["dynamo"])
    ours = _own_groups(state, guard)
    for node, index, group in _group_arguments(gm):
        if ours[group] is None:
            raise ValueError(f"{node.target} needs the native collectives, which this process has not connected")
        _set_argument(node, index, group, ours[group])
    gm.recompile()
    read = InputReader(capture_store.restored_sources(model, payload["sources"], mesh=state.mesh))
    inputs = read(arguments)
    dtypes = [x.dtype if isinstance(x, torch.Tensor) else type(x) for x in inputs]
    if dtypes != payload["dtypes"]:  # (a weight of another mesh reads None)
        raise ValueError("the call's graph inputs are not of the kept graph's dtypes")
    compiled = backend.compile_kept(gm, inputs)
    return {
        "compiled": compiled, "read": read, "dtypes": dtypes, "fields": payload["fields"],
        "output_type": payload["output_type"],
        "stores": [(_restored_owner(owner, state), attr, value) for owner, attr, value in payload["stores"]],
        "pending": cpp_step.candidate(backend.again(gm), inputs, dynamic=False, name=name),
    }


def agree(ready: bool, guard) -> bool:
    """Whether every rank of the model's group is `ready` (one all-reduce of one int over its group): called by every
    rank at the same call, the first of a kind."""
    flag = torch.tensor([int(ready)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=guard.group)
    return bool(flag.item())


# -- what inductor's cache key reads of dynamo's graph ------------------------------------------------------------
# AOT autograd takes a graph marked as dynamo's (`dynamo_compile_id` in its meta) for one, and reads which of its
# inputs are static (weights, `_dynamo_static_input_type` on a placeholder): those indices are part of the key of
# inductor's and AOT autograd's caches. A graph without them would miss the entry dynamo's trace left there and be
# compiled anew (SmolLM2's shape at 2 ranks: ~70 s of inductor per rank instead of a cache hit). AOT autograd's own
# cache also hashes the graph's code with dynamo's source comments, which the kept graph has not: its first use misses
# there once (AOT autograd traces it again, a few seconds, and keeps it under the kept graph's key for later uses).


def _dynamo_meta(gm: fx.GraphModule) -> dict | None:
    """Which placeholders dynamo marked static, by name; None where `gm` is not dynamo's (or holds weights of its
    own, whose sources AOT autograd would need)."""
    own = next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None
    if own or "dynamo_compile_id" not in gm.meta or not hasattr(gm, "_param_name_to_source"):
        return None
    static = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        kind = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
        if kind is not None:
            static[node.name] = kind
    return {"static": static, "compile_id": str(gm.meta["dynamo_compile_id"])}


def _restore_dynamo_meta(gm: fx.GraphModule, kept: dict | None) -> None:
    if kept is None:
        return
    gm.meta["dynamo_compile_id"] = kept["compile_id"]
    gm._param_name_to_source = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        node._dynamo_source = None
        if node.name in kept["static"]:
            node.meta["tensor_dict"] = {"_dynamo_static_input_type": kept["static"][node.name]}


# -- the collectives' groups ----------------------------------------------------------------------------------------


def _own_groups(state, guard) -> dict[str, Any]:
    return {"group": guard.native, "group_name": state.comm.group_name}


def _group_arguments(gm: fx.GraphModule):
    """(node, argument index, argument name) for every group argument of tensorshard's operators in `gm`."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target.namespace != "tensorshard":
            continue
        for index, argument in enumerate(target._schema.arguments):
            if argument.name in _GROUP_ARGUMENTS:
                yield node, index, argument.name


def _argument(node: fx.Node, index: int, name: str) -> Any:
    return node.args[index] if index < len(node.args) else node.kwargs.get(name)


def _set_argument(node: fx.Node, index: int, name: str, value: Any) -> None:
    if index < len(node.args):
        node.args = (*node.args[:index], value, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}


# -- the objects whose attributes dynamo's code sets after the graph ---------------------------------------------------


def _portable_owner(owner: Any, state) -> tuple:
    """The rank's comm, or a module's global object by its module and name; ValueError for anything else."""
    if owner is state.comm:
        return ("comm",)
    candidates = [sys.modules.get(type(owner).__module__)] + list(sys.modules.values())
    for module in candidates:
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is owner:
                return ("global", module.__name__, name)
    raise ValueError(f"the step sets an attribute of a {type(owner).__name__} that is neither the comm nor a global")


def _restored_owner(kept: tuple, state) -> Any:
    if kept[0] == "comm":
        return state.comm
    return getattr(importlib.import_module(kept[1]), kept[2])

