"""One forward pass on a tiny input that records where split features could flow: the evidence for plans.

`trace_model(model, inputs)` runs the model once, in eval mode and without gradients, under a
`TorchFunctionMode` (every torch function and tensor method passes through it). Each supported layer the
pass reaches plays a role, decided from its input:

- input whole -> **column** candidate: its output features get fresh ids (`FeatureSet`), and the output
  carries a shadow of those ids (see oprules.py for how shadows follow the data);
- input carrying split features on its feature dimension -> **row** candidate (the features' consumer);
  when all its input features belong to one unit (a per-head projection) it runs **through**, whole;
- an embedding fed with the model's own input ids -> vocabulary-split candidate;
- a layer that mixes channels at most within fixed groups (BatchNorm, GroupNorm, a depthwise convolution:
  `styles.channel.is_channelwise`) fed split channels -> **channel**: it runs on each device's channels
  alone, so the features pass through it unchanged (a GroupNorm's groups become units) and its per-channel
  parameters will be split with them.

Anything that reads split features in a way a split model cannot reproduce *poisons* them (with a reason
and the module where it happened): the model's outputs, host reads, ops without a rule, a layer kept whole.
The parameters of a layer used outside its own forward (a tied head computed with ``F.linear``) pin it
whole. The inputs of every module are captured (copies) for the self-check.

Models on the meta device are traced too (for `tensorshard plan` on a 7B config): tensors that do not
depend on parameters (position ids, masks) are computed for real on the CPU, so data-dependent checks in
the model's code still work; only parameter-derived values stay on meta. Memory: activations of the tiny
input plus int64 shadows of the same size; captured module inputs (small) when `capture=True`.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..layers import CONV, EMBEDDING, LayerKind, layer_kind
from ..logs import get_logger
from ..styles.channel import channel_dim, channel_group, is_channelwise
from .collapses import Collapses
from .features import FeatureSet, Ids, compact
from .inputs import synthetic_inputs
from .oprules import Call, IDENTITY, NO_TRACK, Rules, STRUCTURAL, tensors_of

logger = get_logger(__name__)

LONG = "long"  # a tensor computed from activations (see Tracer.sources)

_FACTORIES = set(
    "arange zeros ones full empty tensor as_tensor rand randn randint randperm eye linspace logspace "
    "empty_strided scalar_tensor tril_indices triu_indices zeros_like ones_like full_like empty_like".split()
)


@dataclass
class LayerCall:
    role: str  # "column" | "row" | "through" | "embedding" | "whole"
    input_id: int  # id() of the input tensor (columns reading the same tensor share one backward all-reduce)
    row_ids: Ids | None = None  # the input's shadow, for rows


@dataclass
class LayerInfo:
    """A supported layer (Linear, HF Conv1D, Conv, Embedding) and what the traced pass did with it."""

    name: str
    module: nn.Module
    kind: LayerKind
    out_ids: Ids | None = None  # ids of its output features, once it ran as a column
    calls: list[LayerCall] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)  # uses of its parameters outside its own forward
    reads_model_input: bool = False  # an embedding looked up with the model's input ids

    @property
    def roles(self) -> set[str]:
        return {c.role for c in self.calls}


@dataclass(eq=False)
class Poison:
    ids: Ids
    reason: str
    where: str
    kind: str = "op"  # "output" when the features reach the model's output, "gradient" (see _gradient_sources)


@dataclass
class Trace:
    """What one traced pass found. `fs` holds the final classes of the column features."""

    fs: FeatureSet
    layers: dict[str, LayerInfo]
    poisons: list[Poison]
    captures: dict[str, tuple[tuple, dict] | None]  # module -> (args, kwargs) of its first call
    call_order: list[str]  # modules in the order they were first called
    inputs: tuple[tuple, dict]
    syncs: list["Sync"] = field(default_factory=list)
    split_outputs: dict[str, list[Ids | None]] = field(default_factory=dict)  # module -> shadow per output
    channels: dict[str, Ids] = field(default_factory=dict)  # channel-wise module -> ids of the channels it got


@dataclass(eq=False)
class Sync:
    """Whole parameters read by split computations: each device would see part of their gradient."""

    params: list[tuple[str, str]]  # (owning module, parameter name)
    ids: Ids  # the split features they meet


class Tracer(TorchFunctionMode):
    def __init__(self, model: nn.Module, fixed: set[str], *, capture: bool, meta: bool,
                 columns: set[str] | None = None, log: bool = False) -> None:
        super().__init__()
        self.fs = FeatureSet()
        if log:
            self.fs.log = []
        self.columns = columns  # None: any layer reading a whole input is a column candidate
        self.rules = Rules(self)
        self.meta = meta
        self.capture = capture
        self.fixed = fixed
        self.suspended = 0
        self.stack: list[str] = []
        self._shadows: dict[int, tuple[torch.Tensor, Ids]] = {}
        self._derived: dict[int, torch.Tensor] = {}  # tensors derived from the model's inputs by shape ops
        self.poisons: list[Poison] = []
        self.captures: dict[str, tuple[tuple, dict]] = {}
        self.call_order: list[str] = []
        self.layers: dict[str, LayerInfo] = {}
        self.param_owner: dict[int, list[str]] = {}
        self.syncs: list[Sync] = []
        self._sources: dict[int, tuple[weakref.ref, Any]] = {}
        self.split_outputs: dict[str, list[Ids | None]] = {}
        self.channels: dict[str, Ids] = {}
        self.collapses = Collapses(self)
        self.modules = dict(model.named_modules())
        self.param_names: dict[int, tuple[str, str]] = {}
        for mname, mod in model.named_modules():
            for pname, p in mod._parameters.items():
                if p is not None:
                    self.param_names.setdefault(id(p), (mname, pname))
        self._frames: list = []  # one per module call in progress (None: not traced)
        self._inputs: list = []
        self._hooks = []
        for name, mod in model.named_modules():
            kind = layer_kind(mod)
            is_channelwise(mod)  # decided (and remembered) now, outside the traced pass: a response norm is probed
            if kind is not None:
                self.layers[name] = LayerInfo(name, mod, kind)
                for p in mod.parameters(recurse=False):
                    self.param_owner.setdefault(id(p), []).append(name)
            self._hooks.append(mod.register_forward_pre_hook(self._pre_hook(name, kind), with_kwargs=True))
            self._hooks.append(mod.register_forward_hook(self._post_hook(name, kind), with_kwargs=True))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- shadows ---------------------------------------------------------------------------------------

    def shadow(self, t: torch.Tensor) -> Ids | None:
        entry = self._shadows.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else None

    def set_shadow(self, t: torch.Tensor, ids: Ids | None) -> None:
        if ids is None:
            self._shadows.pop(id(t), None)
        else:
            self._shadows[id(t)] = (t, ids)

    def poison(self, ids: Ids, reason: str, kind: str = "op", where: str | None = None) -> None:
        ids = self.fs.distinct(ids)
        if ids.numel():
            self.poisons.append(Poison(ids, reason, where or self.where(), kind))

    def _copy(self, t: Any) -> Any:
        """A captured input, marked as needing a gradient when it would in training; a KV cache as it was
        when the module was called (the rest of the pass appends to it)."""
        if not isinstance(t, torch.Tensor):
            return fresh_state(t)
        grad = t.is_floating_point() and (t.requires_grad or self.sources(t) is not None)
        return t.detach().clone().requires_grad_(grad)

    def where(self) -> str:
        return (self.stack[-1] if self.stack else "") or "<model>"

    def mark_inputs(self, tree: Any) -> None:
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor):
                self._derived[id(t)] = t

    def derived(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self._derived.get(id(t)) is t

    # -- the mode --------------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        name = _name(func)
        if name in NO_TRACK:
            return func(*args, **kwargs)
        if self.meta:
            args, kwargs = self._meta_args(name, args, kwargs)
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for t in leaves:
            owners = self.param_owner.get(id(t))
            if owners:
                for owner in owners:
                    self.layers[owner].foreign.append(f"{name} in {self.where()}")
        out = func(*args, **kwargs)
        if self.meta and name in ("to", "cuda", "type_as") and isinstance(out, torch.Tensor):
            if out.is_meta and args and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
                out = args[0].to(dtype=out.dtype)  # keep values that do not depend on weights real
        tracked = [self.shadow(t) for t in leaves if self.shadow(t) is not None]
        self._record_sources(leaves, out, bool(tracked))
        if tracked:
            self.suspended += 1
            try:
                self.fs.op = f"{name} in {self.where()}"
                self.rules.apply(Call(func, name, args, kwargs, out))
                self._gradient_sources(name, leaves, tracked)
                self._collapsed(name, out)
            finally:
                self.suspended -= 1
        elif leaves and any(self.derived(t) for t in leaves):
            # Ids stay ids through shape ops and integer arithmetic (a clamp, a where, an offset).
            shaped = name in STRUCTURAL or name in IDENTITY
            for t in tensors_of(out):
                if shaped or not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
                    self._derived[id(t)] = t
        return out

    def _collapsed(self, name: str, out: Any) -> None:
        """Once one class holds every feature of a column, its group has a single unit: it cannot split,
        unless it is the one key/value head of multi-query attention. Pending until the module holding the
        column returns (collapses.py), the tensors carrying that class are remembered."""
        for t in tensors_of(out):
            s = self.shadow(t)
            if s is None:
                continue
            roots = self.fs.find(compact(s)).reshape(-1)
            if roots.numel() == 0 or not bool((roots == roots[0]).all()):
                continue
            root = int(roots[0])
            pending = self.collapses.find(root)
            if pending is not None:
                pending.tensors.append(t)
                continue
            for info in self.layers.values():
                ids = info.out_ids
                if ids is not None and ids.numel() > 1 and bool((self.fs.find(ids) == root).all()):
                    reason = f"{name} mixes all output features of {info.name}; nothing is left to split"
                    self.collapses.start(info.name, root, t, reason)
                    break

    # -- which whole tensors would carry gradients --------------------------------------------------------
    #
    # The pass runs without autograd (memory); instead each tensor it makes records where its gradient
    # would go: the parameters it is computed from, when it is computed from parameters alone (a norm
    # weight, ``1 + weight``), or LONG when it derives from activations (a hidden state, a layer's output).

    def sources(self, t: torch.Tensor):
        if id(t) in self.param_names:
            return frozenset([id(t)]) if t.requires_grad else None
        entry = self._sources.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else (LONG if t.requires_grad else None)

    def set_sources(self, t: torch.Tensor, value) -> None:
        if value is None:
            self._sources.pop(id(t), None)
        else:
            self._sources[id(t)] = (weakref.ref(t), value)

    def _record_sources(self, leaves: list[torch.Tensor], out: Any, tracked: bool) -> None:
        found: set[int] = set()
        value = LONG if tracked else None
        if value is None:
            for t in leaves:
                s = self.sources(t)
                if s is LONG:
                    value = LONG
                    break
                if s:
                    found |= s
            else:
                value = frozenset(found) if found else None
        for t in tensors_of(out):
            if t.is_floating_point() or t.is_complex():
                self.set_sources(t, value)

    def _gradient_sources(self, name: str, leaves: list[torch.Tensor], tracked: list[Ids]) -> None:
        """A whole tensor with a gradient meeting split features gets only part of its gradient on each
        device. Parameters computed into it directly can have their gradients summed (SumGradients); a tensor
        computed from activations cannot: poison."""
        ids = torch.cat([compact(t).reshape(-1) for t in tracked])
        for t in leaves:
            if self.shadow(t) is not None or t.numel() == 0:
                continue
            s = self.sources(t)
            if s is LONG:
                self.poison(ids, f"{name} combines split features with a whole tensor whose gradient would be partial",
                            kind="gradient")
            elif s:
                self.syncs.append(Sync([self.param_names[p] for p in s], self.fs.distinct(ids)))

    def _meta_args(self, name: str, args: tuple, kwargs: dict):
        """On a meta model: factories build real CPU tensors; a real tensor meeting a meta one goes meta."""
        if name in _FACTORIES or name.startswith("new_"):
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "meta":
                kwargs = dict(kwargs, device="cpu")
            return args, kwargs
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(t.is_meta for t in leaves) and not all(t.is_meta for t in leaves):
            to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t  # noqa: E731
            new_args, new_kwargs = tree_map(to_meta, (args, kwargs))
            for old, new in zip(tree_flatten((args, kwargs))[0], tree_flatten((new_args, new_kwargs))[0]):
                if isinstance(old, torch.Tensor) and new is not old and self.shadow(old) is not None:
                    self.set_shadow(new, self.shadow(old))
            return new_args, new_kwargs
        return args, kwargs

    # -- module hooks ----------------------------------------------------------------------------------

    def _pre_hook(self, name: str, kind: LayerKind | None):
        def hook(module, args, kwargs):
            if self.suspended:  # inside a layer's own forward, or our own bookkeeping
                self._frames.append(None)
                return None
            self.stack.append(name)
            if name not in self.captures:
                self.call_order.append(name)
                if self.capture:
                    self.suspended += 1
                    try:
                        self.captures[name] = tree_map(self._copy, (args, kwargs))
                    finally:
                        self.suspended -= 1
                else:
                    self.captures[name] = None
            frame = (name, None, None)
            changed = None
            x = args[0] if args else next(iter(kwargs.values()), None)
            reads = kind is not None or is_channelwise(module)
            if reads and isinstance(x, torch.Tensor) and self.shadow(x) is not None:
                if self.collapses.read_by(self.shadow(x)):  # a collapsed column read by a layer: whole
                    self.set_shadow(x, None)
            if is_channelwise(module) and isinstance(x, torch.Tensor) and self.shadow(x) is not None:
                self._inputs.append(x)
                self._frames.append((name, self._channel_role(name, x), x))
                self.suspended += 1  # its own ops are not traced: it keeps each channel's features apart
                weights = next(module.parameters(), None)
                if self.meta and not x.is_meta and weights is not None and weights.is_meta:
                    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
                return None
            if kind is not None:
                self._inputs.append(x)  # alive until the end, so id(x) names one tensor (shared inputs)
                frame = (name, self._layer_role(name, kind, x), x)
                self.suspended += 1  # the layer's own ops are not traced
                if self.meta and isinstance(x, torch.Tensor) and not x.is_meta and module.weight.is_meta:
                    # its own forward is not traced, so the mode cannot move a real input to meta there
                    changed = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
            self._frames.append(frame)
            return changed

        return hook

    def _post_hook(self, name: str, kind: LayerKind | None):
        def hook(module, args, kwargs, out):
            frame = self._frames.pop()
            if frame is None:
                return None
            _, role, x = frame
            if role in ("channel", "channel-mixed"):
                self.suspended -= 1
                self._channel_output(name, role, x, out)
            elif kind is not None:
                self.suspended -= 1
                self._layer_output(name, kind, role, x, out)
            self.collapses.module_returns(len(self.stack) - 1)
            if name not in self.split_outputs:
                self.split_outputs[name] = [self.shadow(t) for t in output_tensors(out)]
            self.stack.pop()
            return None

        return hook

    def _layer_role(self, name: str, kind: LayerKind, x: Any) -> str:
        info = self.layers[name]
        s = self.shadow(x) if isinstance(x, torch.Tensor) else None
        if kind is EMBEDDING:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                # not a lookup: an Embedding subclass multiplying soft inputs with its table (Ovis2's visual
                # table, fed probabilities): a vocabulary split would cut that product
                if s is not None:
                    self.poison(s, f"{name} multiplies split features with its table")
                return "soft"
            info.reads_model_input |= self.derived(x)
            if s is not None:
                self.poison(s, f"{name} looks up split values")
            return "embedding"
        whole = name in self.fixed or (kind is CONV and info.module.groups != 1)
        if s is None:
            return "whole" if whole or (self.columns is not None and name not in self.columns) else "column"
        fdim = kind.feature_dim % x.dim()
        classes = self.fs.find(s)
        if bool((classes == classes.narrow(fdim, 0, 1)).all()):
            # All its input features belong to one unit: it runs whole on each unit, so its parameters see
            # part of their gradient on each device.
            params = [(name, p) for p, v in info.module._parameters.items() if v is not None and v.requires_grad]
            if params:
                self.syncs.append(Sync(params, self.fs.distinct(s)))
            return "through"
        if whole:
            self.poison(s, f"read by {name} ({type(info.module).__name__}), which is kept whole")
            return "whole"
        return "row"

    def _channel_role(self, name: str, x: torch.Tensor) -> str:
        """"channel" when each channel of `x` (dim 1) carries one feature, the same at every batch and
        spatial position, and the module saw the same features before; else the features are poisoned."""
        s = self.shadow(x)
        per_channel = self._per_channel(s, channel_dim(self.modules[name]))
        seen = self.channels.get(name)
        if per_channel is None or seen is not None and not torch.equal(seen, per_channel):
            self.poison(s, f"{name} reads split features other than one per channel")
            return "channel-mixed"
        group = channel_group(self.modules[name])
        if group > 1:  # a GroupNorm normalises each group of channels together: one unit per group
            self.fs.union_along(per_channel.view(-1, group), 1)
        self.channels[name] = per_channel
        return "channel"

    @staticmethod
    def _per_channel(s: Ids, dim: int = 1) -> Ids | None:
        if s.dim() < 2:
            return None
        dim %= s.dim()
        rep = s.narrow(0, 0, 1)
        for d in range(1, s.dim()):
            if d != dim:
                rep = rep.narrow(d, 0, 1)
        if not bool((s == rep).all()) or not bool((rep >= 0).all()):
            return None
        return rep.reshape(-1)

    def _channel_output(self, name: str, role: str, x: torch.Tensor, out: Any) -> None:
        for t in tensors_of(out):
            self.set_sources(t, LONG)
        dim = channel_dim(self.modules[name]) % x.dim()
        if role == "channel" and isinstance(out, torch.Tensor) and out.dim() == x.dim() and out.shape[dim] == x.shape[dim]:
            ids = self.channels[name]
            shape = [1] * out.dim()
            shape[dim] = -1
            self.set_shadow(out, ids.view(shape).expand(out.shape))

    def _layer_output(self, name: str, kind: LayerKind, role: str, x: Any, out: Any) -> None:
        info = self.layers[name]
        s = self.shadow(x) if isinstance(x, torch.Tensor) else None
        for t in tensors_of(out):
            self.set_sources(t, LONG)  # an activation: its gradient reaches the layer's weights and input
        call = LayerCall(role, id(x))
        info.calls.append(call)
        if not isinstance(out, torch.Tensor):
            return
        fdim = kind.feature_dim % out.dim() if out.dim() else 0
        if role == "column":
            if info.out_ids is None:
                info.out_ids = self.fs.new(out.shape[fdim])
            shape = [1] * out.dim()
            shape[fdim] = out.shape[fdim]
            self.set_shadow(out, info.out_ids.view(shape).expand(out.shape))
        elif role == "through":
            rep = s.narrow(kind.feature_dim % x.dim(), 0, 1)
            if kind is CONV:  # a window mixes positions (and a stride changes their number): one unit throughout
                for d in range(2, rep.dim()):
                    rep = rep.narrow(d, 0, 1)
                if not bool((s == rep).all()):
                    self.poison(s, f"{name} mixes positions that hold different split features")
                    return
            self.set_shadow(out, rep.expand(out.shape) if rep.dim() == out.dim() else None)
        elif role == "row":
            call.row_ids = s


def _name(func) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a tensor property such as .shape or .T
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


# --- running it -----------------------------------------------------------------------------------------


def fresh_state(value: Any) -> Any:
    """A copy of an argument that a forward changes in place (a transformers KV cache: anything with a
    ``get_seq_length`` method), so each run of a captured input starts from the same entries; other
    values as they are."""
    if not isinstance(value, nn.Module) and callable(getattr(value, "get_seq_length", None)):
        try:
            return copy.deepcopy(value)
        except Exception:  # a cache that cannot be copied: shared, as before (the self-check may then refuse)
            logger.debug("could not copy a %s for the self-check; it is shared between runs", type(value).__name__)
    return value


def trace_model(
    model: nn.Module,
    inputs: tuple[tuple, dict] | None = None,
    *,
    fixed: set[str] = frozenset(),
    capture: bool = True,
    columns: set[str] | None = None,
    log: bool = False,
) -> Trace:
    """Run `model` once on `inputs` (default: `inputs.synthetic_inputs(model)`) and record the evidence.

    `fixed` names layers already decided to stay whole (or gathered): they are not candidates. `columns`,
    when given, are the only layers that may be columns (a given plan's; plan_inference/plancheck.py); `log`
    keeps which op joined which features (`FeatureSet.log`). The model
    runs in eval mode without gradients; its train/eval flags are restored afterwards and nothing else of
    it changes.
    """
    meta = any(p.is_meta for p in model.parameters())
    if inputs is None:
        inputs = synthetic_inputs(model)
    args, kwargs = inputs
    modes = {m: m.training for m in model.modules()}
    tracer = Tracer(model, set(fixed), capture=capture and not meta, meta=meta, columns=columns, log=log)
    tracer.mark_inputs((args, kwargs))
    threads = torch.get_num_threads()
    try:
        model.eval()
        torch.set_num_threads(1)  # the bookkeeping is many tiny ops: threads only add overhead
        with torch.no_grad(), tracer:
            out = model(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)
        tracer.remove_hooks()
        for m, flag in modes.items():
            m.training = flag
    tracer.collapses.finish()
    for t in output_tensors(out):
        s = tracer.shadow(t)
        if s is not None:
            tracer.poison(s, "reaches the model's output", kind="output")
    return Trace(
        tracer.fs, tracer.layers, tracer.poisons, tracer.captures, tracer.call_order, (args, kwargs), tracer.syncs,
        tracer.split_outputs, tracer.channels,
    )


def output_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):  # includes transformers' ModelOutput
        return [t for v in out.values() for t in output_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in output_tensors(v)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):  # a user's output class
        return [t for f in dataclasses.fields(out) for t in output_tensors(getattr(out, f.name))]
    return []
