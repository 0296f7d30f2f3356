"""A compiled graph's inputs found again at every later call, and the call's output rebuilt from the graph's
outputs: for either engine's decode step called without dynamo.

    arguments = call_arguments(args, kwargs)             # keyword arguments by name, positional ones by index
    sources = locate_inputs(module, arguments, inputs)   # once, at a call whose graph inputs are known
    fields = output_fields(out, graph_outputs, arguments)
    read, build = InputReader(sources), output_builder(fields)
    ...
    outs = compiled(*read(arguments))                    # a later call: every input read afresh, in one pass
    out = build_output(type(out), build, outs, arguments)

Dynamo passes its backend the real tensors a graph reads; `locate_inputs` finds each again by identity, among
the module's weights and buffers and the call's arguments, as a `Source` (a function of the call's arguments):

- `Weight`: a parameter or buffer, read from its module's table each call (a weight replaced there is seen);
- `LocalView`: a split weight under torchrun, a DTensor whose local view the graph reads (engines/torchrun/
  local_views.py), kept from one call to the next while the DTensor and its local tensor are the same objects;
- `Argument`, `Item`, `CacheTensor`: a tensor argument, a tensor in a dict argument (a mask per attention type),
  a tensor of a cache argument's layer (`past_key_values.layers[3].keys`);
- `SizeInput`: an int input (dynamic shapes), filled in by the caller from the tensor input it is a size of.

Users: the in-process engine's stitched and parallel steps (engines/inprocess/stitched_step.py, parallel_step.py;
one reader per shard) and the torchrun engine's direct step (engines/torchrun/direct_step.py). A graph input or an
output field found nowhere raises `NotLocated`: that graph stays with dynamo's path.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class NotLocated(RuntimeError):
    """A graph input, or a field of the call's output, that cannot be found again at a later call (the reason is
    the message): the graph is not called directly."""


def call_arguments(args: tuple, kwargs: dict) -> dict:
    """A call's arguments as the sources read them: the keyword arguments by name and the positional ones by
    index (`kwargs` itself where there are none, the common case: no copy)."""
    return {**kwargs, **dict(enumerate(args))} if args else kwargs


# -- where one graph input comes from ------------------------------------------------------------------------------


class Source:
    """Where one graph input is found at a call: `source(arguments)` -> the input. `steady`: the same tensor from
    one token to the next (a weight, a cache's tensor), unlike the token's own arguments."""

    steady = False

    def __call__(self, arguments: Mapping) -> Any:
        raise NotImplementedError


class Weight(Source):
    """A parameter or buffer, read from its module's table each call (a weight replaced there is seen)."""

    steady = True

    def __init__(self, table: dict, key: str) -> None:
        self.table, self.key = table, key

    def __call__(self, arguments: Mapping) -> torch.Tensor:
        return self.table[self.key]


class LocalView(Source):
    """A split weight under torchrun: its DTensor's local view as `layout` makes it (local_views.py), kept while the
    DTensor and its local tensor are the same objects (a weight replaced, or its local tensor, makes a new view);
    a plain tensor put in its place as it is (as dynamo would read it); None for a DTensor of another mesh."""

    __slots__ = ("table", "key", "layout", "mesh", "dtensor", "local", "view")
    steady = True

    def __init__(self, table: dict, key: str, layout: Any, mesh: Any) -> None:
        self.table, self.key, self.layout, self.mesh = table, key, layout, mesh
        self.dtensor = self.local = self.view = None

    def __call__(self, arguments: Mapping) -> torch.Tensor | None:
        t = self.table[self.key]
        if t is self.dtensor and t._local_tensor is self.local:
            return self.view
        if not isinstance(t, DTensor):
            return t
        if t.device_mesh != self.mesh:
            return None
        self.dtensor, self.local, self.view = t, t._local_tensor, self.layout.view(t._local_tensor)
        return self.view


class Argument(Source):
    """An argument of the call (`name`: a keyword, or a position's index)."""

    def __init__(self, name: str | int) -> None:
        self.name = name

    def __call__(self, arguments: Mapping) -> Any:
        return arguments[self.name]


class Item(Source):
    """A tensor in a dict argument (`attention_mask["full_attention"]`, an encoder's ModelOutput)."""

    def __init__(self, name: str | int, key: Any) -> None:
        self.name, self.key = name, key

    def __call__(self, arguments: Mapping) -> torch.Tensor:
        return arguments[self.name][self.key]


class CacheTensor(Source):
    """A tensor of a cache argument's layer (`arguments[name].layers[layer].<attr>`)."""

    steady = True

    def __init__(self, name: str | int, layer: int, attr: str) -> None:
        self.name, self.layer, self.attr = name, layer, attr

    def __call__(self, arguments: Mapping) -> torch.Tensor:
        return getattr(arguments[self.name].layers[self.layer], self.attr)


class SizeInput(Source):
    """An int input of the graph (a size, stride or offset of a tensor input, dynamic shapes): 0 here, filled in by
    the caller from that tensor once every input is read."""

    def __call__(self, arguments: Mapping) -> int:
        return 0


def locate_inputs(module: nn.Module, arguments: Mapping, inputs: Sequence[Any], names: Sequence[str] = (), *,
                  local_views: Mapping[tuple[int, str], Any] | None = None, mesh: Any = None,
                  sizes: frozenset[int] | set[int] = frozenset()) -> list[Source]:
    """For each graph input (the real tensors dynamo passed to the backend), where to find it at a later call: a
    weight or buffer of `module` (a `LocalView` where `local_views` has its layout, keyed by (id of its module's
    table, name): the graph was traced with that view in the table), a tensor argument, a tensor in a dict
    argument, or a tensor of a cache argument's layer; the int inputs at `sizes` are `SizeInput`s. `names`: the
    inputs' names, for the error. NotLocated where an input is none of these."""
    local_views = local_views or {}
    where: dict[int, Source] = {}
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for key, t in table.items():
                if t is not None and id(t) not in where:
                    layout = local_views.get((id(table), key))
                    where[id(t)] = Weight(table, key) if layout is None else LocalView(table, key, layout, mesh)
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            where.setdefault(id(value), Argument(name))
        elif isinstance(value, dict):  # a mask per attention type (Gemma2, Qwen2), an encoder's ModelOutput (T5)
            for key, t in value.items():
                if isinstance(t, torch.Tensor):
                    where.setdefault(id(t), Item(name, key))
        for i, layer in enumerate(getattr(value, "layers", None) or ()):
            for attr, t in vars(layer).items():
                if isinstance(t, torch.Tensor):
                    where.setdefault(id(t), CacheTensor(name, i, attr))
    found: list[Source] = []
    for i, x in enumerate(inputs):
        if i in sizes:
            found.append(SizeInput())
            continue
        if not isinstance(x, torch.Tensor) or id(x) not in where:
            name = f" {names[i]}" if i < len(names) else ""
            raise NotLocated(f"graph input {i}{name} ({type(x).__name__}) is neither a weight, a tensor argument nor a cache tensor")
        found.append(where[id(x)])
    return found


class InputReader:
    """A graph's inputs at a call, in the graph's order, from its `sources`, in one pass: a weight is one lookup in
    its module's table, a cache tensor one attribute of a layer of the cache and a split weight's kept local view
    two identity tests, without a function call each; every other source (an argument, a local view made anew) is
    called. Deliberately repeats what `Weight`, `CacheTensor` and `LocalView` read, for speed: a shard of the small
    Llama of BENCHMARKS.md section 5 reads 106 inputs per token, 8 us this way against 13; a torchrun rank of
    SmolLM2's shape at 2 ranks 366 inputs (272 local views), 42 us against 61 (CPU time, a loaded 2-core machine)."""

    def __init__(self, sources: Sequence[Source]) -> None:
        self.caches = list(dict.fromkeys(s.name for s in sources if type(s) is CacheTensor))
        self.parts = [
            (_WEIGHT, s.table, s.key) if type(s) is Weight else (_CACHE, s.name, (s.layer, s.attr)) if type(s) is CacheTensor
            else (_VIEW, s, s.key) if type(s) is LocalView else (_OTHER, s, None)
            for s in sources
        ]

    def __call__(self, arguments: Mapping) -> list:
        layers = {name: arguments[name].layers for name in self.caches}  # (each cache argument's layers, once)
        return [
            a[b] if kind is _WEIGHT else getattr(layers[a][b[0]], b[1]) if kind is _CACHE
            # a local view kept (LocalView's first test, inline); else the source itself
            else a.view if kind is _VIEW and (t := a.table[b]) is a.dtensor and t._local_tensor is a.local
            else a(arguments)
            for kind, a, b in self.parts
        ]


_WEIGHT, _CACHE, _VIEW, _OTHER = "weight", "cache", "view", "other"


# -- the call's output ----------------------------------------------------------------------------------------------


def output_fields(output: Any, graph_outputs: Any, arguments: Mapping) -> dict[str, int | Argument]:
    """Where each field of the call's output (a ModelOutput) comes from: a graph output (its index) or an argument
    (the cache the call was given). NotLocated for anything else."""
    if not hasattr(output, "keys") or not isinstance(graph_outputs, (list, tuple)):
        raise NotLocated(f"the step returned a {type(output).__name__}, not a ModelOutput of graph outputs")
    index = {id(t): i for i, t in enumerate(graph_outputs)}
    given = {id(v): k for k, v in arguments.items()}
    fields: dict[str, int | Argument] = {}
    for key in output.keys():
        value = output[key]
        if id(value) in index:
            fields[key] = index[id(value)]
        elif id(value) in given:
            fields[key] = Argument(given[id(value)])
        else:
            raise NotLocated(f"output field {key!r} is neither a graph output nor an argument")
    return fields


def output_builder(fields: Mapping[str, int | Argument]) -> list[tuple[str, int, str | int | None]]:
    """`fields` (output_fields) as (field, graph output index, None) or (field, -1, the argument's name or index),
    for `build_output`."""
    return [(k, v, None) if isinstance(v, int) else (k, -1, v.name) for k, v in fields.items()]


def build_output(output_type: type, fields: list[tuple[str, int, str | int | None]], outs: Sequence[Any],
                 arguments: Mapping) -> Any:
    """The call's output (its ModelOutput type) from its graph's outputs and its arguments (`output_builder`)."""
    return output_type(**{k: outs[i] if name is None else arguments[name] for k, i, name in fields})
