"""Optimizer state in sharded checkpoints, resharded like the parameters it belongs to.

An optimizer over a split model holds, per rank, state for that rank's local parameter: AdamW's
``exp_avg`` and ``exp_avg_sq`` have the local parameter's shape, ``step`` is a scalar. Each state tensor
shaped like its parameter is stored as the global tensor ``state.<param name>.<key>`` with the parameter's
placement, so it reshards exactly as the weights do; scalars are stored once; plain numbers go in the
index. Hyperparameters are stored per param group, the group named by its parameters' names, and restored
into the optimizer given at load time, whose groups must hold the same parameters.

A *factored* state (the parameter's shape with some dimensions reduced to 1: Adafactor's row and column second
moments) is stored as the global tensor of its own shape: sliced like the parameter when it keeps the split
dimension, whole (written once) when it reduces it, so it too reloads at another device count. State of any
other shape is refused at save time with a clear error.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from .files import DTYPES_BY_NAME, FileEntry, dtype_name
from .layout import Box, ModelLayout, TensorEntry, local_shape, local_view, rank_pieces, saved_pieces
from .sources import Source, describe_names

SHARDED, SCALAR, FACTORED = "sharded", "scalar", "factored"


def _param_owners(layout: ModelLayout, optimizer: torch.optim.Optimizer) -> dict[int, tuple[TensorEntry, int]]:
    owners = {}
    for entry in layout:
        if entry.kind == "param":
            for rank in layout.ranks:
                owners[id(layout.param(entry, rank))] = (entry, rank)
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in owners:
                raise ValueError(
                    f"param group {i} of the {type(optimizer).__name__} holds a parameter of shape {tuple(p.shape)} "
                    "that is not part of this model; build the optimizer over model.parameters()"
                )
    return owners


def _group_names(group: dict, owners) -> list[str]:
    names = []
    for p in group["params"]:
        name = owners[id(p)][0].name
        if name not in names:
            names.append(name)
    return names


def optimizer_files(layout: ModelLayout, optimizer: torch.optim.Optimizer) -> tuple[dict[int, list[list[FileEntry]]], dict]:
    """Per rank held here, per part, the file entries to write; and the index section (without chunk lists)."""
    owners = _param_owners(layout, optimizer)
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: _to_json(k, v, type(optimizer).__name__) for k, v in group.items() if k != "params"}
        groups.append({"params": _group_names(group, owners), **hyper})

    kinds: dict[str, dict[str, str]] = {}
    values: dict[str, dict[str, Any]] = {}
    tensors: dict[str, dict] = {}
    per_rank: dict[int, list[list[FileEntry]]] = {r: [] for r in layout.ranks}
    first = layout.ranks[0]
    for entry in layout:
        if entry.kind != "param":
            continue
        states = [optimizer.state.get(layout.param(entry, r)) for r in layout.ranks]
        if not any(states):
            continue  # never stepped (no gradient yet, or not in this optimizer)
        if not all(states):
            raise RuntimeError(f"{entry.name} has optimizer state on some devices only; step every shard before saving")
        local = layout.local(entry, first)
        kinds[entry.name] = {}
        for key, value in states[0].items():
            if not isinstance(value, torch.Tensor):
                kinds[entry.name][key] = "value"
                values.setdefault(entry.name, {})[key] = _to_json(key, value, type(optimizer).__name__)
                continue
            gname = f"state.{entry.name}.{key}"
            value = layout.state_local(entry, first, value)
            if value.dim() > 0 and tuple(value.shape) == tuple(local.shape):
                kind, shape, placement = SHARDED, entry.shape, entry.placement
            elif value.dim() == 0:
                kind, shape, placement = SCALAR, (), None
            elif _factored(value.shape, local.shape):
                kind = FACTORED
                placement = _factored_placement(entry, value.shape[entry.placement[0]] if entry.placement else 1)
                shape = tuple(entry.shape[d] if placement and d == placement[0] else n for d, n in enumerate(value.shape))
            else:
                raise NotImplementedError(
                    f"{type(optimizer).__name__} keeps state {key!r} of shape {tuple(value.shape)} for {entry.name} "
                    f"(local shape {tuple(local.shape)}); only state shaped like its parameter (or like it with "
                    "dimensions reduced to 1), or scalars, can be saved and resharded"
                )
            kinds[entry.name][key] = kind
            tensors[gname] = {"shape": list(shape), "dtype": dtype_name(value.dtype), "chunks": []}
            for rank in layout.ranks:
                pieces = saved_pieces(shape, placement, rank)
                parts = per_rank[rank]
                for k, (box, start) in enumerate(pieces):
                    while len(parts) <= k:
                        parts.append([])
                    getter = _state_getter(optimizer, layout, entry, rank, key, placement, box, start)
                    parts[k].append(FileEntry(gname, box.sizes, value.dtype, getter, box.offsets))
    section = {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", "param_groups": groups,
               "kinds": kinds, "values": values, "tensors": tensors}
    return per_rank, section


def _factored(shape, param_shape) -> bool:
    """True for the shape of a factored moment: the parameter's, some dimensions reduced to 1."""
    return len(shape) == len(param_shape) and all(s in (n, 1) for s, n in zip(shape, param_shape))


def _factored_placement(entry: TensorEntry, length: int):
    """A factored state keeps the parameter's placement if it keeps the split dimension (`length`: its length
    there), and is whole on every device if it reduces it to 1."""
    if entry.placement is None or (length == 1 and entry.shape[entry.placement[0]] != 1):
        return None
    return entry.placement


def _state_getter(optimizer, layout, entry, rank, key, placement, box, start):
    def get():
        value = layout.state_local(entry, rank, optimizer.state[layout.param(entry, rank)][key])
        return local_view(value, placement, box, start)

    return get


def _check_class(optimizer: torch.optim.Optimizer, section: dict) -> None:
    saved_class = section.get("class", "?")
    mine = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if saved_class != mine:
        raise ValueError(f"the checkpoint holds the state of a {saved_class}, but the optimizer given is a {mine}")


def _saved_namer(section: dict, aliases: dict[str, str]):
    """entry -> the name the checkpoint knows the parameter by (tied weights: any of its names)."""
    every_saved = {n for g in section["param_groups"] for n in g["params"]}

    def saved_name(entry: TensorEntry) -> str:
        for n in entry.names:
            if n in every_saved:
                return n
            if aliases.get(n) in every_saved:
                return aliases[n]
        return entry.name

    return saved_name


def _match_groups(optimizer, section: dict, owners, saved_name) -> list[int]:
    """For each param group of `optimizer`, the index of the saved group with the same parameters."""
    saved_groups = [set(g["params"]) for g in section["param_groups"]]
    matches = []
    for i, group in enumerate(optimizer.param_groups):
        names = {saved_name(owners[id(p)][0]) for p in group["params"]}
        match = next((j for j, g in enumerate(saved_groups) if g == names), None)
        if match is None:
            raise ValueError(
                f"param group {i} of the optimizer holds {describe_names(sorted(names))}, which matches none of the "
                f"checkpoint's {len(saved_groups)} param group(s); build the optimizer with the same groups as when "
                "saving. Nothing was loaded."
            )
        matches.append(match)
    return matches


def load_optimizer(
    layout: ModelLayout, optimizer: torch.optim.Optimizer, source: Source, section: dict, aliases: dict[str, str]
) -> None:
    """Restore hyperparameters and state into `optimizer`, resharded to `layout`."""
    _check_class(optimizer, section)
    owners = _param_owners(layout, optimizer)
    saved_name = _saved_namer(section, aliases)
    matches = _match_groups(optimizer, section, owners, saved_name)
    state_dict = optimizer.state_dict()
    new_groups = []
    for match, sd_group in zip(matches, state_dict["param_groups"]):
        hyper = {k: _from_json(v) for k, v in section["param_groups"][match].items() if k != "params"}
        new_groups.append({**sd_group, **hyper, "params": sd_group["params"]})

    state: dict[int, dict[str, Any]] = {}
    for group, sd_group in zip(optimizer.param_groups, state_dict["param_groups"]):
        for p, index in zip(group["params"], sd_group["params"]):
            entry, rank = owners[id(p)]
            name = saved_name(entry)
            if name not in section["kinds"]:
                continue  # no state saved for it (it had not been stepped)
            st = {}
            for key, kind in section["kinds"][name].items():
                if kind == "value":
                    st[key] = _from_json(section["values"][name][key])
                    continue
                gname = f"state.{name}.{key}"
                _, dtype = source.info(gname)
                if kind == SHARDED:
                    holder, dest = layout.new_local(entry, rank, dtype)
                    pieces = rank_pieces(entry.shape, entry.placement, rank)
                    targets = [(box, local_view(dest, entry.placement, box, start)) for box, start in pieces]
                    source.read(gname, targets)
                    st[key] = layout.as_state(entry, rank, holder)
                elif kind == FACTORED:
                    shape, _ = source.info(gname)
                    placement = _factored_placement(entry, shape[entry.placement[0]] if entry.placement else 1)
                    dest = torch.empty(local_shape(shape, placement, rank), dtype=dtype, device=layout.local(entry, rank).device)
                    targets = [(box, local_view(dest, placement, box, start)) for box, start in rank_pieces(shape, placement, rank)]
                    source.read(gname, targets)
                    st[key] = dest
                else:
                    dest = torch.empty((), dtype=dtype)
                    source.read(gname, [(Box((), ()), dest)])
                    st[key] = dest
            state[index] = st
    optimizer.load_state_dict({"state": state, "param_groups": new_groups})


def check_optimizer_section(
    section: dict, layout: ModelLayout, optimizer: torch.optim.Optimizer, source: Source, aliases: dict[str, str]
) -> None:
    """Refuse before loading anything: another optimizer class, other param groups, state that does not fit."""
    _check_class(optimizer, section)
    _match_groups(optimizer, section, _param_owners(layout, optimizer), _saved_namer(section, aliases))
    by_alias = layout.by_alias()
    problems = []
    for name, kinds in section["kinds"].items():
        entry = by_alias.get(name) or next((e for e in layout if aliases.get(e.name) == name), None)
        if entry is None:
            problems.append(f"{name} (not a parameter of this model)")
            continue
        for key, kind in kinds.items():
            if kind in (SHARDED, FACTORED):
                shape, _ = source.info(f"state.{name}.{key}")
                fits = _factored(shape, entry.shape) if kind == FACTORED else tuple(shape) == tuple(entry.shape)
                if not fits:
                    problems.append(f"state.{name}.{key}: {list(shape)}, parameter {list(entry.shape)}")
            if kind != "value":
                problems += [f"state.{name}.{key}: {p}" for p in source.problems(f"state.{name}.{key}")]
    problems = source.damage() + problems
    if problems:
        raise ValueError(
            f"the {source.description} does not fit this model and optimizer: {describe_names(problems)}. "
            "Restore or save the checkpoint again; nothing was loaded."
        )


def _to_json(key: str, value: Any, owner: str) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return {"__tensor__": value.item(), "dtype": dtype_name(value.dtype)}
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(key, v, owner) for v in value]}
    try:
        json.dumps(value)
    except TypeError:
        raise NotImplementedError(
            f"{owner} setting {key!r} = {value!r} cannot be stored in a checkpoint index (not JSON)"
        ) from None
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=DTYPES_BY_NAME[value["dtype"]])
    if isinstance(value, dict) and "__tuple__" in value:
        return tuple(_from_json(v) for v in value["__tuple__"])
    return value
