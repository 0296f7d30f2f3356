"""Choosing layer roles: what the traced pass does at each module call.

Forward hooks on every module of the traced model. Each supported layer the pass reaches plays a role,
decided from its input (before it runs) and applied to its output (after):

- input whole -> **column** candidate: its output features get fresh ids (`FeatureSet`), and the output
  carries a shadow of those ids (see oprules.py for how shadows follow the data);
- input carrying split features on its feature dimension -> **row** candidate (the features' consumer);
  when all its input features belong to one unit (a per-head projection) it runs **through**, whole;
- an embedding fed with the model's own input ids -> vocabulary-split candidate;
- a layer that mixes channels at most within fixed groups (BatchNorm, GroupNorm, a depthwise convolution:
  `styles.channel.is_channelwise`) fed split channels -> **channel**: it runs on each device's channels
  alone, so the features pass through it unchanged (a GroupNorm's groups become units) and its per-channel
  parameters will be split with them.

A layer's own ops are not traced (the mode is suspended inside it). The same hooks capture each module's
inputs on its first call (copies, for the self-check), the order modules are first called in, and the
shadows of each module's outputs.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..layers import CONV, EMBEDDING, LayerKind, layer_kind
from ..logs import get_logger
from ..styles.channel import channel_dim, channel_group, is_channelwise
from .collapses import Collapses
from .evidence import LayerCall, LayerInfo, Sync
from .features import FeatureSet, Ids
from .gradient_sources import LONG, GradientSources
from .shadows import tensors_of

logger = get_logger(__name__)


class TraceState(Protocol):
    """What the hooks read and change of the trace they belong to (tracer.py's Tracer)."""

    fs: FeatureSet
    meta: bool  # the model is on the meta device
    suspended: int  # > 0: torch functions are not traced (inside a layer, or our own bookkeeping)
    stack: list[str]  # the modules in progress, outermost first
    syncs: list[Sync]
    collapses: Collapses
    sources: GradientSources

    def shadow(self, t: torch.Tensor) -> Ids | None: ...
    def set_shadow(self, t: torch.Tensor, ids: Ids | None) -> None: ...
    def poison(self, ids: Ids, reason: str, kind: str = "op", where: str | None = None) -> None: ...
    def derived(self, t: Any) -> bool: ...


class LayerRoles:
    """The hooks on one traced model, and what they record (see the module docstring).

    `fixed` names layers already decided to stay whole; `columns`, when given, are the only layers that may be
    columns; `capture` keeps copies of each module's first inputs."""

    def __init__(self, tracer: TraceState, model: nn.Module, fixed: set[str], *, capture: bool,
                 columns: set[str] | None) -> None:
        self.tr = tracer
        self.fixed = fixed
        self.columns = columns  # None: any layer reading a whole input is a column candidate
        self.capture = capture
        self.modules = dict(model.named_modules())
        self.layers: dict[str, LayerInfo] = {}
        self.param_owner: dict[int, list[str]] = {}  # id(parameter) -> the supported layers holding it
        self.captures: dict[str, tuple[tuple, dict] | None] = {}
        self.call_order: list[str] = []
        self.split_outputs: dict[str, list[Ids | None]] = {}
        self.channels: dict[str, Ids] = {}
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

    def _copy(self, t: Any) -> Any:
        """A captured input, marked as needing a gradient when it would in training; a KV cache as it was
        when the module was called (the rest of the pass appends to it)."""
        if not isinstance(t, torch.Tensor):
            return fresh_state(t)
        grad = t.is_floating_point() and (t.requires_grad or self.tr.sources.of(t) is not None)
        return t.detach().clone().requires_grad_(grad)

    # -- the hooks -------------------------------------------------------------------------------------

    def _pre_hook(self, name: str, kind: LayerKind | None):
        tr = self.tr

        def hook(module, args, kwargs):
            if tr.suspended:  # inside a layer's own forward, or our own bookkeeping
                self._frames.append(None)
                return None
            tr.stack.append(name)
            if name not in self.captures:
                self.call_order.append(name)
                if self.capture:
                    tr.suspended += 1
                    try:
                        self.captures[name] = tree_map(self._copy, (args, kwargs))
                    finally:
                        tr.suspended -= 1
                else:
                    self.captures[name] = None
            frame = (name, None, None)
            changed = None
            x = args[0] if args else next(iter(kwargs.values()), None)
            reads = kind is not None or is_channelwise(module)
            if reads and isinstance(x, torch.Tensor) and tr.shadow(x) is not None:
                if tr.collapses.read_by(tr.shadow(x)):  # a collapsed column read by a layer: whole
                    tr.set_shadow(x, None)
            if is_channelwise(module) and isinstance(x, torch.Tensor) and tr.shadow(x) is not None:
                self._inputs.append(x)
                self._frames.append((name, self._channel_role(name, x), x))
                tr.suspended += 1  # its own ops are not traced: it keeps each channel's features apart
                weights = next(module.parameters(), None)
                if tr.meta and not x.is_meta and weights is not None and weights.is_meta:
                    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
                return None
            if kind is not None:
                self._inputs.append(x)  # alive until the end, so id(x) names one tensor (shared inputs)
                frame = (name, self._layer_role(name, kind, x), x)
                tr.suspended += 1  # the layer's own ops are not traced
                if tr.meta and isinstance(x, torch.Tensor) and not x.is_meta and module.weight.is_meta:
                    # its own forward is not traced, so the mode cannot move a real input to meta there
                    changed = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
            self._frames.append(frame)
            return changed

        return hook

    def _post_hook(self, name: str, kind: LayerKind | None):
        tr = self.tr

        def hook(module, args, kwargs, out):
            frame = self._frames.pop()
            if frame is None:
                return None
            _, role, x = frame
            if role in ("channel", "channel-mixed"):
                tr.suspended -= 1
                self._channel_output(name, role, x, out)
            elif kind is not None:
                tr.suspended -= 1
                self._layer_output(name, kind, role, x, out)
            tr.collapses.module_returns(len(tr.stack) - 1)
            if name not in self.split_outputs:
                self.split_outputs[name] = [tr.shadow(t) for t in output_tensors(out)]
            tr.stack.pop()
            return None

        return hook

    # -- roles -----------------------------------------------------------------------------------------

    def _layer_role(self, name: str, kind: LayerKind, x: Any) -> str:
        tr = self.tr
        info = self.layers[name]
        s = tr.shadow(x) if isinstance(x, torch.Tensor) else None
        if kind is EMBEDDING:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                # not a lookup: an Embedding subclass multiplying soft inputs with its table (Ovis2's visual
                # table, fed probabilities): a vocabulary split would cut that product
                if s is not None:
                    tr.poison(s, f"{name} multiplies split features with its table")
                return "soft"
            info.reads_model_input |= tr.derived(x)
            if s is not None:
                tr.poison(s, f"{name} looks up split values")
            return "embedding"
        whole = name in self.fixed or (kind is CONV and info.module.groups != 1)
        if s is None:
            return "whole" if whole or (self.columns is not None and name not in self.columns) else "column"
        fdim = kind.feature_dim % x.dim()
        classes = tr.fs.find(s)
        if bool((classes == classes.narrow(fdim, 0, 1)).all()):
            # All its input features belong to one unit: it runs whole on each unit, so its parameters see
            # part of their gradient on each device.
            params = [(name, p) for p, v in info.module._parameters.items() if v is not None and v.requires_grad]
            if params:
                tr.syncs.append(Sync(params, tr.fs.distinct(s)))
            return "through"
        if whole:
            tr.poison(s, f"read by {name} ({type(info.module).__name__}), which is kept whole")
            return "whole"
        return "row"

    def _channel_role(self, name: str, x: torch.Tensor) -> str:
        """"channel" when each channel of `x` (dim 1) carries one feature, the same at every batch and
        spatial position, and the module saw the same features before; else the features are poisoned."""
        s = self.tr.shadow(x)
        per_channel = _per_channel(s, channel_dim(self.modules[name]))
        seen = self.channels.get(name)
        if per_channel is None or seen is not None and not torch.equal(seen, per_channel):
            self.tr.poison(s, f"{name} reads split features other than one per channel")
            return "channel-mixed"
        group = channel_group(self.modules[name])
        if group > 1:  # a GroupNorm normalises each group of channels together: one unit per group
            self.tr.fs.union_along(per_channel.view(-1, group), 1)
        self.channels[name] = per_channel
        return "channel"

    def _channel_output(self, name: str, role: str, x: torch.Tensor, out: Any) -> None:
        for t in tensors_of(out):
            self.tr.sources.set(t, LONG)
        dim = channel_dim(self.modules[name]) % x.dim()
        if role == "channel" and isinstance(out, torch.Tensor) and out.dim() == x.dim() and out.shape[dim] == x.shape[dim]:
            ids = self.channels[name]
            shape = [1] * out.dim()
            shape[dim] = -1
            self.tr.set_shadow(out, ids.view(shape).expand(out.shape))

    def _layer_output(self, name: str, kind: LayerKind, role: str, x: Any, out: Any) -> None:
        tr = self.tr
        info = self.layers[name]
        s = tr.shadow(x) if isinstance(x, torch.Tensor) else None
        for t in tensors_of(out):
            tr.sources.set(t, LONG)  # an activation: its gradient reaches the layer's weights and input
        call = LayerCall(role, id(x))
        info.calls.append(call)
        if not isinstance(out, torch.Tensor):
            return
        fdim = kind.feature_dim % out.dim() if out.dim() else 0
        if role == "column":
            if info.out_ids is None:
                info.out_ids = tr.fs.new(out.shape[fdim])
            shape = [1] * out.dim()
            shape[fdim] = out.shape[fdim]
            tr.set_shadow(out, info.out_ids.view(shape).expand(out.shape))
        elif role == "through":
            rep = s.narrow(kind.feature_dim % x.dim(), 0, 1)
            if kind is CONV:  # a window mixes positions (and a stride changes their number): one unit throughout
                for d in range(2, rep.dim()):
                    rep = rep.narrow(d, 0, 1)
                if not bool((s == rep).all()):
                    tr.poison(s, f"{name} mixes positions that hold different split features")
                    return
            tr.set_shadow(out, rep.expand(out.shape) if rep.dim() == out.dim() else None)
        elif role == "row":
            call.row_ids = s


def _per_channel(s: Ids, dim: int = 1) -> Ids | None:
    """The one feature id of each channel along `dim`, when every batch and spatial position agrees; else None."""
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


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a module's output, also inside transformers' ModelOutput and a user's dataclass."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):  # includes transformers' ModelOutput
        return [t for v in out.values() for t in output_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in output_tensors(v)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):  # a user's output class
        return [t for f in dataclasses.fields(out) for t in output_tensors(getattr(out, f.name))]
    return []
