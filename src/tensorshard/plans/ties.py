"""Tied weights follow the plan wherever their names live.

One tensor held by several modules (T5's ``shared.weight`` is also ``encoder.embed_tokens.weight``,
``decoder.embed_tokens.weight`` and often ``lm_head.weight``) must be split one way. A plan that names only
one holder, because its other names sit behind a prefix it does not know (``base_model.model.`` in a
PeftModel) or because the author wrote one entry, would leave the others replicated, and `shard_plan`
refuses a tensor split two ways. `follow_ties` gives every holder without an entry of its own the style
that splits the tensor alike:

- an embedding tied to a split embedding: the same style;
- a Linear tied to an embedding split by vocabulary (an output head): column-parallel, output gathered;
- a Linear tied to a split Linear: the same style.

Other combinations are left to `shard_plan`'s error, which says how to split both alike.
"""

from __future__ import annotations


from torch import nn

from ..logs import get_logger
from ..styles import ColwiseParallel, EmbeddingParallel, RowwiseParallel, Style
from .plan import Plan, escape

logger = get_logger(__name__)

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def follow_ties(module: nn.Module, plan: Plan) -> Plan:
    """`plan` plus an entry for every module holding a weight tied to a module the plan splits (see above)."""
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, mod in module.named_modules():
        for p in mod.parameters(recurse=False):
            holders.setdefault(id(p), []).append((name, mod))
    added: dict[str, Style] = {}
    for group in holders.values():
        if len(group) < 2:
            continue
        styled = [(n, m, plan.match(n)) for n, m in group]
        source = next(((n, m, hit[1]) for n, m, hit in styled if hit is not None and _splits(hit[1])), None)
        if source is None:
            continue
        for name, mod, hit in styled:
            if hit is None and name not in added:
                style = _alike(source[1], source[2], mod)
                if style is not None:
                    added[name] = style
    if not added:
        return plan
    logger.info("tied weights: %s split like the module(s) they share a weight with", ", ".join(added))
    return plan | Plan({escape(n): s for n, s in added.items()})


def _splits(style: Style) -> bool:
    return isinstance(style, (EmbeddingParallel, ColwiseParallel, RowwiseParallel))


def _alike(source: nn.Module, style: Style, target: nn.Module) -> Style | None:
    if isinstance(target, _EMBEDDINGS) and isinstance(source, _EMBEDDINGS):
        return style
    if isinstance(target, nn.Linear) and isinstance(source, nn.Linear):
        return style
    if isinstance(target, nn.Linear) and isinstance(source, _EMBEDDINGS) and getattr(style, "split", "vocab") == "vocab":
        return ColwiseParallel(gather_output=True)
    return None
