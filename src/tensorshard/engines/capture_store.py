"""Captured decode graphs of a kind of call, kept on disk so that a later process skips dynamo's trace.

The first fast call of a kind traces the split model's forward with dynamo (in one process every shard's, one
after the other: dynamo runs Python, it holds the GIL); on SmolLM2-135M's shape at 2 devices that trace is most of
the first call: two traces of ~71,000 bytecodes each, against one of ~52,000 for the unsplit model. What a step
that runs without dynamo is built from is only the graph as dynamo captured it, where each of its inputs comes from
and which output is which field. Once a kind's step is built and compiled, the engine `save`s those (as values:
`portable_graph`, `portable_sources`) to ``captures/`` in the library's cache folder (cache_dirs.py); `load` in a
later process finds them again under the same `key` and the step is built from them without tracing. Inductor's
own cache then finds the compiled graphs as it would after a trace. The in-process engine's use:
engines/inprocess/kept_captures.py.

What the key covers, so that a stored graph is one dynamo would trace again:
- the versions of Python, torch and transformers;
- the kind of call (shapes, dtypes, cache lengths, plain arguments, adapter settings: compiled_steps.py), the
  `torch.compile` options, the devices;
- each shard's modules: their paths and classes, their plain attributes (ints, floats, strings, flags, tuples of
  them, a config's values and its private settings such as the attention implementation), each weight's and
  buffer's name, shape, dtype, strides and ``requires_grad``, and the hooks on them by function name;
- the default dtype and deterministic mode;

and an entry also lists every source file dynamo traced through (the model's, transformers', tensorshard's
styles...), each with a hash of its contents: an entry whose files changed since is not used (and is replaced when
the kind is traced again). What it cannot see is Python state outside the model that changes which code runs (a
global flag a forward reads, an attention function registered under a name the model already uses):
``TENSORSHARD_CAPTURE_CACHE=0`` turns the store off (tracing every first call, as before). Entries are written
atomically (a temporary file renamed into place); one that cannot be read is ignored.
"""

from __future__ import annotations

import enum
import hashlib
import os
import pickle
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

try:  # (torch's own pickler of FX graphs, which inductor's out-of-process compile uses)
    from torch.fx._graph_pickler import GraphPickler, Options
except ImportError:  # a torch without it keeps nothing on disk
    GraphPickler = Options = None

from ..cache_dirs import cache_root
from ..logs import get_logger
from ..switches import switched_on
from .graph_inputs import Argument, CacheTensor, Item, LocalView, SizeInput, Source, Weight

logger = get_logger(__name__)

FORMAT = 1  # the entries' layout: a change makes every older entry a miss
_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum)


def enabled() -> bool:
    """The store is on unless ``TENSORSHARD_CAPTURE_CACHE`` says off; read at every first call of a kind."""
    return GraphPickler is not None and switched_on("TENSORSHARD_CAPTURE_CACHE")


def folder() -> Path:
    return cache_root() / "captures"


def key(parts: Sequence[Any], modules: Sequence[nn.Module]) -> str | None:
    """The entry's name for these `parts` (the engine's: the kind of call, the options, the devices) and `modules`
    (each shard, or the rank's model; see the module doc); None where something it must cover has no description
    that outlives this process (an object known only by its address)."""
    text = "\n".join(
        [f"format {FORMAT}", sys.version.split()[0], torch.__version__, _version("transformers"),
         repr(torch.get_default_dtype()), repr(torch.are_deterministic_algorithms_enabled())]
        + [_describe(part) for part in parts] + [_describe_modules(module) for module in modules]
    )
    if " at 0x" in text:
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def traced_files(codes: Sequence[types.CodeType]) -> set[str]:
    """The source files of the code dynamo traced (`TracingContext.get_traced_code()`), the ones on disk."""
    return {c.co_filename for c in codes if os.path.isfile(c.co_filename)}


def save(name: str, payload: Any, files: set[str]) -> bool:
    """Write `payload` (picklable: graphs as `portable_graph` makes them) under `name`, with the hashes of the
    `files` dynamo traced, atomically; False, logged at DEBUG, where it cannot be kept."""
    try:
        entry = {"format": FORMAT, "files": {f: _file_hash(f) for f in sorted(files)}, "payload": payload}
        data = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # something this store cannot write: the kind is traced again next time
        logger.debug("the captured decode graphs are not kept on disk: %s: %s", type(error).__name__, error)
        return False
    where = folder()
    tmp = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, where / f"{name}.pkl")
    except OSError as error:  # a folder that cannot be written: nothing kept, nothing else changes
        logger.debug("the captured decode graphs are not kept on disk (%s): %s", where, error)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False
    return True


def load(name: str) -> Any:
    """The payload kept under `name`; None where there is none, it cannot be read, or a file dynamo traced has
    changed since."""
    path = folder() / f"{name}.pkl"
    if not path.exists():
        return None
    try:
        entry = pickle.loads(path.read_bytes())
    except Exception as error:  # a file cut short, of another layout: traced again, and replaced
        logger.debug("a kept decode capture could not be read (%s: %s); tracing", type(error).__name__, error)
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return None
    if any(_file_hash(f) != digest for f, digest in entry["files"].items()):
        logger.debug("a kept decode capture is not used: a source file dynamo traced has changed")
        return None
    return entry["payload"]


def discard(name: str) -> None:
    (folder() / f"{name}.pkl").unlink(missing_ok=True)


# -- a graph and its inputs' sources, as values that outlive the process -----------------------------------------


def portable_graph(gm: fx.GraphModule) -> dict:
    """`gm` (a dynamo graph) as bytes, without its nodes' metadata but for each output's shape and dtype."""
    shapes = {node.name: (tuple(v.shape), v.dtype) for node in gm.graph.nodes
              if isinstance(v := node.meta.get("example_value"), torch.Tensor)}
    bare = fx.GraphModule(gm, gm.graph)  # (without dynamo's attributes: its shape env, its user stacks)
    data = GraphPickler.dumps(bare, Options(ops_filter=None, node_metadata_key_filter=lambda k: False))
    return {"graph": data, "shapes": shapes}


def restored_graph(kept: dict) -> fx.GraphModule:
    """The graph `portable_graph` kept; each node's ``meta["example_value"]`` a meta tensor of its shape and dtype."""
    gm: fx.GraphModule = GraphPickler.loads(kept["graph"], FakeTensorMode())
    for node in gm.graph.nodes:
        if node.name in kept["shapes"]:
            shape, dtype = kept["shapes"][node.name]
            node.meta["example_value"] = torch.empty(shape, dtype=dtype, device="meta")
    return gm


def portable_sources(module: nn.Module, sources: Sequence[Source]) -> list:
    """Where each graph input comes from, as values: a weight by its module's path; a split weight's local view
    (torchrun) by its module's path and its layout; an argument, an item of one, a cache tensor or a size as it is.
    TypeError for another kind of source (not kept)."""
    tables = {}
    for path, owner in module.named_modules(remove_duplicate=False):
        tables.setdefault(id(owner._parameters), (path, "parameters"))
        tables.setdefault(id(owner._buffers), (path, "buffers"))
    kept = []
    for source in sources:
        if type(source) is Weight:
            kept.append(("weight", *tables[id(source.table)], source.key))
        elif type(source) is LocalView:  # (its layout: a frozen dataclass of ints, comm/dtensor.py)
            kept.append(("view", *tables[id(source.table)], source.key, source.layout))
        elif type(source) in (Argument, Item, CacheTensor, SizeInput):
            kept.append(("plain", source))
        else:
            raise TypeError(f"a graph input from a {type(source).__name__} is not kept")
    return kept


def restored_sources(module: nn.Module, kept: Sequence, *, mesh: Any = None) -> list[Source]:
    """`portable_sources`' values as sources on `module` (a local view's on `mesh`); KeyError where a weight is not
    there any more."""
    sources: list[Source] = []
    for item in kept:
        if item[0] in ("weight", "view"):
            _, path, table, name = item[:4]
            owner = module.get_submodule(path)
            found = owner._parameters if table == "parameters" else owner._buffers
            if found.get(name) is None:
                raise KeyError(f"{path}.{name} is not a {table[:-1]} of the module")
            sources.append(Weight(found, name) if item[0] == "weight" else LocalView(found, name, item[4], mesh))
        else:
            sources.append(item[1])
    return sources


# -- what the key describes ---------------------------------------------------------------------------------------


def _describe_modules(shard: nn.Module) -> str:
    lines = []
    for path, module in shard.named_modules(remove_duplicate=False):
        lines.append(f"{path}: {_type_name(type(module))}")
        for name, value in sorted(vars(module).items()):
            if name in ("_parameters", "_buffers", "_modules") or isinstance(value, nn.Module):
                continue
            if "hook" in name and isinstance(value, dict):  # (keyed by this process's hook numbers)
                value = sorted(_describe(hook) for hook in value.values())
            lines.append(f"  {name} = {_describe(value)}")
        for table in ("_parameters", "_buffers"):
            for name, t in getattr(module, table).items():
                if t is None:
                    lines.append(f"  {table} {name} None")
                else:
                    lines.append(f"  {table} {name} {type(t).__name__} {tuple(t.shape)} {t.dtype} {t.stride()} "
                                 f"{t.requires_grad} {t.device.type}")
    return "\n".join(lines)


def _describe(value: Any, depth: int = 0) -> str:
    """A description of `value` that another process gives the same object: plain values by value, containers by
    their items, configs by their values, functions and other objects by their type's name."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    if depth > 4:
        return type(value).__name__
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[" + ", ".join(_describe(v, depth + 1) for v in value) + "]"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_describe(v, depth + 1) for v in value)) + "}"
    if isinstance(value, dict):
        items = sorted((_describe(k, depth + 1), _describe(v, depth + 1)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if callable(getattr(value, "to_dict", None)) and not isinstance(value, type):
        # A config: its values, and the private settings `to_dict` leaves out but a forward reads (transformers'
        # `_attn_implementation_internal`: which attention function runs), strings and flags only (an int there can
        # be a hash of this process: GenerationConfig's `_original_object_hash`).
        private = {k: v for k, v in getattr(value, "__dict__", {}).items()
                   if k.startswith("_") and isinstance(v, (str, bool, type(None)))}
        try:
            return f"{_type_name(type(value))}{_describe(value.to_dict(), depth + 1)}{_describe(private, depth + 1)}"
        except Exception:
            return _type_name(type(value))
    if isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)):
        return _type_name(value)
    if callable(value) and hasattr(value, "__wrapped__"):
        return _describe(value.__wrapped__, depth + 1)
    return _type_name(type(value))


def _type_name(obj: Any) -> str:
    func = getattr(obj, "__func__", obj)
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__name__)}"


def _file_hash(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "missing"


def _version(package: str) -> str:
    module = sys.modules.get(package)
    return f"{package} {getattr(module, '__version__', None)}"
