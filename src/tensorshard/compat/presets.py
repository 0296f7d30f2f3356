"""tensorshard's presets, written as tensor_parallel Configs: ``find_predefined_tensor_parallel_config``.

    config = find_predefined_tensor_parallel_config(model.config, ["cuda:0", "cuda:1"])
    config.attr_rules[re.compile(".*self_attn$")]         # {'num_key_value_groups': PerDevice((3, 3))}
    model = TensorParallel(model, devices, tensor_parallel_config=config)   # what the preset would do

The original returned its own preset for a model type (bloom, t5, bert, gpt2, gpt_neox, codegen, llama,
Falcon), written for transformers <= 4.35. Here the preset is tensorshard's, for the transformers installed,
and each entry becomes the rules that ask for the same split:

    entry on a module                       state rules (weight, bias)             module rules
    ColwiseParallel(blocks=...)             Split / SplitInChunks / SplitIn-       output "gather -1" if
                                            GroupedChunks of the output features    gather_output
    RowwiseParallel(blocks=...)             the same, of the input features;       output "sum"
                                            bias Scale
    EmbeddingParallel(split="vocab")        Split dim 0                            output "sum"
    EmbeddingParallel(split="embedding")    Split dim 1                            output "gather -1"
    Heads(attrs=...)                        -                                      attr rules: each device's
                                                                                   value (`PerDevice`)

Head blocks are cut in chunks of one KV group (query heads with their KV head), so the rules give every
device whole groups, as the preset does. Patterns are regular expressions for the base model's names as
the original's were (``.*self_attn$``), found in any head class of the model type, so the Config is the same
for every class; a pattern is made longer only where a short one would also match other modules. Per-head inputs
(BLOOM's ALiBi) become input rules that slice them (`SliceHeads`, as the original's ``split_alibi``). Where an
entry has no rule equivalent (KV heads replicated on several devices, experts, per-head norms,
a head count inside a config object), the function logs why and returns None, as the original did for model
types without a preset: ``tensor_parallel_config=None`` then splits with the preset itself.
"""

from __future__ import annotations

import copy
import re
import sys
from typing import Any, Iterable

import torch
from torch import nn

from ..layers import CONV, EMBEDDING, layer_kind
from ..logs import get_logger
from ..partition import HeadGroups, parse_block
from ..plans.plan import Plan, match_pattern
from ..plans.presets import PRESETS, base_model, preset_for
from ..styles import ColwiseParallel, EmbeddingParallel, Heads, HeadsWithValues, RowwiseParallel, ShardParams, Style
from ..styles.attention_heads import AttentionHeads
from .check import UntranslatableConfig
from .config import Config
from .head_inputs import SliceHeads
from .state_actions import Scale, Split, SplitInChunks, SplitInGroupedChunks

logger = get_logger(__name__)


class PerDevice:
    """An attribute rule giving device r the value ``values[r]`` (called as ``rule(value, rank=r)``)."""

    def __init__(self, values: Iterable[Any]) -> None:
        self.values = tuple(values)

    def __call__(self, value: Any, rank: int) -> Any:
        return self.values[rank]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerDevice) and other.values == self.values

    def __hash__(self) -> int:
        return hash(self.values)

    def __repr__(self) -> str:
        return f"PerDevice({self.values})"


class _NoRule(Exception):
    """An entry of the preset that no tensor_parallel rule expresses; the message says which and why."""


def preset_config(model_config: Any, world_size: int) -> Config | None:
    """The Config for `model_config`'s model type over `world_size` devices, or None (see the module doc)."""
    model_type = getattr(model_config, "model_type", None)
    if model_type not in PRESETS:
        logger.warning(
            "no tensorshard preset for model_type %r: tensor_parallel_config=None splits it with a plan inferred "
            "from the model", model_type,
        )
        return None
    models = _meta_models(model_config)
    try:
        tables = _Tables(world_size)
        for rel, where in _entries(models).items():
            tables.add(rel, where)
        config = Config(tables.state, tables.inputs, tables.outputs, tables.attrs)
        for model in models[1:] or models:  # the rules translate back (a head class holds the base model's modules)
            config.to_plan(model, world_size)
    except (_NoRule, UntranslatableConfig) as e:
        logger.warning(
            "tensorshard's %s preset over %d device(s) has no tensor_parallel Config equivalent (%s); returning "
            "None: tensor_parallel_config=None splits with the preset itself", model_type, world_size, e,
        )
        return None
    return config


def _meta_models(model_config: Any) -> list[nn.Module]:
    """The model type's classes, built on the meta device: the base model, then the head classes named in the
    config's ``architectures`` (else the causal or the sequence-to-sequence LM, whichever exists)."""
    transformers = sys.modules["transformers"]  # a transformers config means it is imported
    named = [getattr(transformers, n, None) for n in getattr(model_config, "architectures", None) or []]
    named = [cls for cls in named if isinstance(cls, type)]
    with torch.device("meta"):
        models = [transformers.AutoModel.from_config(copy.deepcopy(model_config))]
        models += [cls(copy.deepcopy(model_config)) for cls in named]
        for auto in [] if named else [transformers.AutoModelForCausalLM, transformers.AutoModelForSeq2SeqLM]:
            try:
                models.append(auto.from_config(copy.deepcopy(model_config)))
                break
            except ValueError:  # this auto class has no model for the config's type
                continue
    return models


def _entries(models: list[nn.Module]) -> dict[str, list[tuple[nn.Module, str, Style, Plan]]]:
    """Each preset entry by its pattern relative to the base model, with every (model, full pattern, style,
    plan) it appears in."""
    out: dict[str, list] = {}
    for model in models:
        plan = preset_for(model)
        prefix, _ = base_model(model)
        for pattern, style in plan.items():
            rel = pattern[len(prefix):] if prefix and pattern.startswith(prefix) else pattern
            out.setdefault(rel, []).append((model, pattern, style, plan))
    for rel, where in out.items():
        if len({repr(style) for _, _, style, _ in where}) > 1:
            raise _NoRule(f"{rel!r} has different styles in different model classes")
    return out


class _Tables:
    """The four rule tables, filled entry by entry."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.state: dict[str, Any] = {}
        self.inputs: dict[str, dict] = {}
        self.outputs: dict[str, dict] = {}
        self.attrs: dict[str, dict] = {}

    def add(self, rel: str, where: list[tuple[nn.Module, str, Style, Plan]]) -> None:
        style = where[0][2]
        modules = [(model, name, module, plan) for model, pattern, _, plan in where
                   for name, module in model.named_modules() if match_pattern(pattern, name)]
        if not modules:
            return
        if isinstance(style, Heads):
            self._heads(rel, where, style, modules)
            return
        rx = _regex(rel, where)
        _, name, module, plan = modules[0]
        kind = layer_kind(module)
        if isinstance(style, EmbeddingParallel) and kind is EMBEDDING:
            dim, out = (0, "sum") if style.split == "vocab" else (1, "gather -1")
            self._state(rx, modules[0], Split(self.world, dim), None)
            self.outputs[rx] = {0: out}
        elif isinstance(style, (ColwiseParallel, RowwiseParallel)) and kind not in (None, EMBEDDING) and not (
            kind is CONV and module.groups != 1
        ):
            column = isinstance(style, ColwiseParallel)
            dim = kind.weight_out_dim if column else kind.weight_in_dim
            size = module.weight.shape[dim]
            action = self._cut(style.blocks, size, dim, name, plan)
            bias = self._cut(style.blocks, size, 0, name, plan) if column else Scale(self.world)
            self._state(rx, modules[0], action, bias)
            if not column:
                self.outputs[rx] = {0: "sum"}
            elif style.gather_output:
                self.outputs[rx] = {0: f"gather {kind.feature_dim}"}
        elif isinstance(style, ShardParams) and (style.input, style.output) == ("split", "split"):
            # Tensors split, nothing communicated: T5's per-head position bias, BERT's holder of the decoder's bias.
            for tname, spec in style.params.items():
                dim, blocks = (spec["dim"], spec.get("blocks")) if isinstance(spec, dict) else (spec, None)
                t = getattr(module, tname)
                self._own(tname, rx, modules[0], self._cut(blocks, t.shape[dim], dim % t.dim(), name, plan))
        else:
            raise _NoRule(f"{rel}: {style!r} on a {type(module).__name__}")
        for _, other_name, other, _ in modules[1:]:  # every module of the entry must read the same rules
            if type(other) is not type(module) or _shapes(other) != _shapes(module):
                raise _NoRule(f"{rel}: {name} and {other_name} differ in type or shapes")

    def _state(self, rx: str, where: tuple, weight_action, bias_action) -> None:
        """Rules for the layer's own weight and bias."""
        self._own("weight", rx, where, weight_action)
        if getattr(where[2], "bias", None) is not None:
            self._own("bias", rx, where, bias_action)

    def _own(self, tname: str, rx: str, where: tuple, action) -> None:
        """The rule for tensor `tname` of the entry's modules; a tensor tied to one named earlier (an output head
        tied to the embedding) follows that name's rule, as the original matches each tensor by its first name."""
        model, name, module, _ = where
        first = {id(t): n for n, t in list(model.named_parameters()) + list(model.named_buffers())}
        if first.get(id(getattr(module, tname))) == f"{name}.{tname}".lstrip("."):
            self.state[rx[:-1] + rf"\.{re.escape(tname)}$"] = action

    def _cut(self, blocks, size: int, dim: int, name: str, plan: Plan):
        """The state action cutting `size` features along `dim` as the style's blocks say."""
        if blocks is None:
            return Split(self.world, dim)
        heads, kv = self._geometry(name, plan)
        weights = []
        for block in blocks:
            unit, count = parse_block(block)
            if unit == "plain":
                raise _NoRule(f"{name}: blocks of plain features {blocks}")
            weights.append(count * (heads if unit == "q" else kv))  # in heads of head_dim features
        head_dim, rest = divmod(size, sum(weights))
        if rest or len(set(weights)) > 1 or (weights[0] * head_dim) % kv:
            raise _NoRule(f"{name}: blocks {blocks} of {size} features do not cut into {kv} KV groups alike")
        chunk = weights[0] * head_dim // kv  # one KV group's share of a block
        if len(blocks) == 1:
            return SplitInChunks(self.world, dim, chunk)
        return SplitInGroupedChunks(self.world, dim, len(blocks), chunk)

    def _geometry(self, name: str, plan: Plan) -> tuple[int, int]:
        parts = name.split(".")
        for depth in range(len(parts) - 1, -1, -1):
            hit = plan.match(".".join(parts[:depth]))
            if hit is not None and isinstance(hit[1], Heads):
                style = hit[1]
                if style.kv < self.world:
                    raise _NoRule(f"{name}: its {style.kv} KV head(s) would be replicated on several of {self.world} devices")
                return style.num_heads, style.kv
        raise _NoRule(f"{name}: head blocks without a Heads entry above it")

    def _heads(self, rel: str, where, style: Heads, modules) -> None:
        if isinstance(style, AttentionHeads) and style.whole_kv_groups:
            raise _NoRule(f"{rel}: KV groups fused in one block (whole_kv_groups) have no rule equivalent")
        groups = HeadGroups.build(style.num_heads, style.kv, self.world, where=rel)
        if groups.kv_replicated:
            raise _NoRule(f"{rel}: its {style.kv} KV head(s) would be replicated on several of {self.world} devices")
        local = [groups.local(r) for r in range(self.world)]
        if style.head_dim is not None:
            for counts in local:
                counts |= {"features": counts["heads"] * style.head_dim, "kv_features": counts["kv_heads"] * style.head_dim}
        values = {attr: PerDevice(counts[q] for counts in local) for attr, q in style.attrs.items()}
        if isinstance(style, HeadsWithValues):
            values |= {attr: PerDevice(v) for attr, v in style.values.items()}
        module = modules[0][2]
        for path, rule in values.items():
            owner, _, attr = path.rpartition(".")
            if owner and not _has_submodule(module, owner):
                raise _NoRule(f"{rel}: attribute {path!r} lives in a {type(getattr(module, owner.split('.')[0], None)).__name__}, "
                              "which attribute rules cannot reach")
            sub = f"{rel}.{owner}" if owner else rel
            target = [(m, f"{p}.{owner}" if owner else p, s, pl) for m, p, s, pl in where]
            self.attrs.setdefault(_regex(sub, target), {})[attr] = rule
        if isinstance(style, AttentionHeads) and style.head_inputs:  # BLOOM's ALiBi: each device its heads' rows
            slices = {arg: SliceHeads(layout, style.num_heads, self.world) for arg, layout in style.head_inputs.items()}
            self.inputs.setdefault(_regex(rel, where), {}).update(slices)


def _shapes(module: nn.Module) -> list:
    return [(n, tuple(t.shape)) for n, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))]


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _regex(rel: str, where: list[tuple[nn.Module, str, Any, Any]]) -> str:
    """The shortest of ``.*<tail>$``, ``(^|.*\\.)<tail>$`` and the whole relative glob as a regex (tail: the
    segments after the last wildcard one) that matches, in every model, exactly the modules the entry's
    glob matches."""
    segments = rel.split(".") if rel else []
    last = max((i for i, s in enumerate(segments) if s in ("*", "**")), default=-1)
    tail = r"\.".join(_segment(s) for s in segments[last + 1:])
    whole = r"\.".join(r".*" if s == "**" else _segment(s) for s in segments)
    candidates = [f".*{tail}$", rf"(^|.*\.){tail}$", rf"(^|.*\.){whole}$"] if tail else [rf"(^|.*\.){whole}$"]
    for rx in candidates:
        compiled = re.compile(rx)
        if all(
            {n for n, _ in model.named_modules() if compiled.search(n)} == {n for n, _ in model.named_modules() if match_pattern(pattern, n)}
            for model, pattern, _, _ in where
        ):
            return rx
    raise _NoRule(f"no regular expression matches exactly the modules of {rel!r}")


def _segment(glob: str) -> str:
    """One glob segment as a regex that stays inside the segment: ``wi*`` -> ``wi[^.]*``."""
    out = []
    i = 0
    while i < len(glob):
        c = glob[i]
        if c == "*":
            out.append(r"[^.]*")
        elif c == "?":
            out.append(r"[^.]")
        elif c == "[":
            end = glob.find("]", i)
            out.append(glob[i:end + 1].replace("[!", "[^") if end > 0 else re.escape(c))
            i = end if end > 0 else i
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)
