"""Translate a transformers config's own tensor-parallel plan (`base_model_tp_plan`) into a tensorshard Plan.

transformers 5.x ships a plan for ~130 model families, as ``{pattern: style name}`` over the base model's
module (or parameter) names. It is a starting point for architectures without a hand-written preset:

    colwise, local_colwise            -> ColwiseParallel (q / k / v on head boundaries, see below)
    colwise_gather_output, colwise_rep -> ColwiseParallel(gather_output=True)
    rowwise, local_rowwise,
    rowwise_split_input, rowwise_rep  -> RowwiseParallel (a whole input is split locally)
    packed_colwise (a fused gate|up)  -> ColwiseParallel(blocks=(I, I))
    embedding_rowwise / _colwise      -> EmbeddingParallel(split="vocab" / "embedding")
    experts' gate_up_proj / down_proj
      under moe_tp_experts            -> ShardParams on the experts module (dims 1 and 2 of the 3-D weights)
    replicated_with_grad_allreduce    -> SumGradients (inside an attention split by heads; else nothing)
    sequence_parallel, ep_router, ... -> nothing: the module stays whole (its gradient is whole anyway)

Attention: transformers splits q/k/v evenly, which only works when the heads divide the devices. Here,
when a module's children named like q/k/v projections are column-parallel without gathering, a `Heads`
entry built from the config (num_attention_heads, num_key_value_heads) goes on that module, q and k/v split
on head and KV-head boundaries, and the output projection on query heads; the module's head-count
attributes found among the usual names are set to local values. Any entry this file cannot translate makes
its parent module (an attention, an MLP) stay whole, with a warning naming it: slower, never wrong.
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from ...logs import get_logger
from ...styles import ColwiseParallel, EmbeddingParallel, Heads, Replicate, RowwiseParallel, ShardParams, Style, SumGradients
from ..plan import Plan, match_pattern

logger = get_logger(__name__)

COLWISE = {"colwise", "local_colwise"}
ROWWISE = {"rowwise", "local_rowwise", "rowwise_split_input", "rowwise_rep"}
# transformers 5.0 named a column-parallel layer whose output is gathered "colwise_rep", and a row-parallel one
# whose whole input is split locally "rowwise_rep"; later releases renamed them colwise_gather_output and
# rowwise_split_input (olmo2's attention, where a norm over all heads follows q and k).
GATHERED_COLWISE = {"colwise_gather_output", "colwise_rep"}
# transformers 5.0 marks fused experts "gather" and their 3-D weights local_colwise / local_rowwise without saying
# which dim holds the experts' hidden features (deepseek_v2's fused gate|up is local_colwise, deepseek_v3's the
# same layout local_rowwise); later releases say packed_colwise / rowwise under moe_tp_experts. Such experts stay
# whole.
UNSPECIFIED_EXPERTS = {"local_colwise", "local_rowwise"}
WHOLE = {  # styles whose module is simply replicated here
    "sequence_parallel", "replicate", "ep_router", "grouped_gemm", "ep_dispatch_experts", "moe_identity_expert",
    "gather", "local",
}
PARTIAL_GRADS = "replicated_with_grad_allreduce"  # a whole module run on this device's heads only
QUERY = {"q_proj", "q", "query", "wq"}
KEY_VALUE = {"k_proj", "v_proj", "k", "v", "key", "value", "wk", "wv"}
# Attributes attention forwards commonly reshape with, and the local quantity each takes.
HEAD_ATTRS = {
    "num_key_value_groups": "groups",
    "num_heads": "heads",
    "num_attention_heads": "heads",
    "n_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "num_kv_heads": "kv_heads",
}


def translate_tp_plan(tp_plan: dict[str, str], config, base: nn.Module) -> Plan:
    """A Plan for `base` (the base model, e.g. LlamaModel) from its config's `base_model_tp_plan`."""
    modules = dict(base.named_modules())
    entries: dict[str, Style] = {}
    partial_grads: list[str] = []  # replicated_with_grad_allreduce entries, kept if their attention splits
    param_splits: dict[str, dict] = defaultdict(dict)  # owner pattern -> ShardParams params (3-D experts)
    untranslated: dict[str, str] = {}  # parent pattern -> why it stays whole

    for pattern, value in tp_plan.items():
        parent, _, leaf = pattern.rpartition(".")
        targets = [m for n, m in modules.items() if match_pattern(pattern, n)]
        if not targets:  # a parameter (experts' 3-D weights) or something this model class lacks
            owners = [m for n, m in modules.items() if match_pattern(parent, n)]
            param = getattr(owners[0], leaf, None) if owners else None
            if isinstance(param, nn.Parameter) and param.dim() == 3 and value in UNSPECIFIED_EXPERTS:
                untranslated[parent] = f"{leaf}: {value!r} on 3-D experts weights (no dim for the hidden features)"
            elif isinstance(param, nn.Parameter) and param.dim() >= 2:
                out_dim = param.dim() - 2  # (out, in), or (experts, out, in) for 3-D experts
                if value == "packed_colwise":  # [gate | up] along the output features
                    half = param.shape[out_dim] // 2
                    param_splits[parent][leaf] = {"dim": out_dim, "blocks": [half, half]}
                elif value in COLWISE:
                    param_splits[parent][leaf] = out_dim
                elif value in ROWWISE:
                    param_splits[parent][leaf] = param.dim() - 1
                elif value not in WHOLE:
                    untranslated[parent] = f"{leaf}: {value!r}"
            continue
        if value in WHOLE or value == "moe_tp_experts":
            continue
        if value == PARTIAL_GRADS:
            partial_grads.append(pattern)
            continue
        style = _module_style(value, targets[0])
        if style is None:
            untranslated[parent or pattern] = f"{leaf}: {value!r}"
        else:
            entries[pattern] = style

    for parent, params in param_splits.items():
        entries[parent] = ShardParams(params=params)

    # Attention: q/k/v column-parallel without gathering -> split on heads, with a Heads entry on the parent.
    by_parent: dict[str, dict[str, Style]] = defaultdict(dict)
    for pattern, style in entries.items():
        parent, _, leaf = pattern.rpartition(".")
        by_parent[parent][leaf] = style
    for parent, children in by_parent.items():
        split_qkv = [leaf for leaf, s in children.items() if isinstance(s, ColwiseParallel) and not s.gather_output]
        if not any(leaf in QUERY for leaf in split_qkv):
            continue
        unknown = [leaf for leaf in split_qkv if leaf not in QUERY | KEY_VALUE]
        if unknown:
            untranslated[parent] = f"column-parallel {unknown} inside an attention: layout unknown"
            continue
        for leaf, style in children.items():
            blocks = ("q",) if leaf in QUERY or isinstance(style, RowwiseParallel) else ("kv",)
            entries[f"{parent}.{leaf}"] = type(style)(blocks=blocks)
        attention = next(m for n, m in modules.items() if match_pattern(parent, n))
        entries = {parent: _heads(config, attention), **entries}
        for pattern in partial_grads:  # e.g. q_norm / k_norm over head_dim, now applied to local heads only
            if pattern.startswith(parent + "."):
                entries[pattern] = SumGradients()

    for parent, why in untranslated.items():
        logger.warning("base_model_tp_plan of %r: %s is not translated; %s stays whole", config.model_type, why, parent)
        entries = {p: s for p, s in entries.items() if not (p == parent or p.startswith(parent + "."))}
        entries = {parent: Replicate(), **entries}
    return Plan(entries)


def _module_style(value: str, module: nn.Module) -> Style | None:
    if value in COLWISE:
        return ColwiseParallel()
    if value in GATHERED_COLWISE:
        return ColwiseParallel(gather_output=True)
    if value in ROWWISE:
        return RowwiseParallel()
    if value == "packed_colwise" and isinstance(module, nn.Linear):
        half = module.out_features // 2
        return ColwiseParallel(blocks=(half, half))
    if value in ("embedding_rowwise", "embedding_colwise") and isinstance(module, nn.Embedding):
        return EmbeddingParallel(split="vocab" if value == "embedding_rowwise" else "embedding")
    return None


def _heads(config, attention: nn.Module) -> Heads:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    attrs = {name: quantity for name, quantity in HEAD_ATTRS.items() if isinstance(getattr(attention, name, None), int)}
    return Heads(num_heads=heads, num_kv_heads=kv, attrs=attrs)
