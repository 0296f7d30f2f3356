"""Presets: short declarative plans for known architectures, looked up from the model.

A preset is a function ``config -> Plan`` registered under transformers ``model_type`` names, written for
the *base* model (``LlamaModel``: ``"layers.*.self_attn.q_proj"``). `preset_for(model)` finds the base model
inside the model it is given (``model.`` in LlamaForCausalLM, ``transformer.`` in GPT2LMHeadModel, nothing
for LlamaModel itself), prefixes the patterns, drops entries for parts this model class does not have (the
decoder of a T5EncoderModel), and adds the two ends:

- the input embedding, split by vocabulary (one all-reduce), if the preset did not place it;
- the output head (``get_output_embeddings()``, usually ``lm_head``), column-parallel with its output
  gathered: every device gets whole logits. A tied head splits exactly like the embedding it shares its
  weight with; a bias tied to another module's parameter (BERT's ``cls.predictions.bias``) is split alike.

Architectures without a preset whose config carries ``base_model_tp_plan`` get a plan translated from it
(see translate.py); a warning says so.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ...layers import wrapped_layer
from ...logs import get_logger
from ...styles import ColwiseParallel, EmbeddingParallel, ShardParams, Style
from ..plan import Plan, match_pattern
from ..ties import follow_ties
from . import decoders, encoders, gpt  # noqa: F401  (importing the families registers their presets)
from .registry import PRESETS, preset  # noqa: F401  (preset: the decorator, for presets written elsewhere)
from .hf_tp_plan import translate_tp_plan

logger = get_logger(__name__)

def preset_for(module: nn.Module) -> Plan | None:
    """The preset plan for `module`'s architecture (a transformers model), or None."""
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        return None
    prefix, base = base_model(module)
    if model_type in PRESETS:
        plan, source = PRESETS[model_type](config), "preset"
    elif getattr(config, "base_model_tp_plan", None):
        plan, source = translate_tp_plan(dict(config.base_model_tp_plan), config, base), "translated"
        logger.warning(
            "no hand-written preset for model_type %r; using a plan translated from its config's "
            "base_model_tp_plan (a starting point: check it with print(model.plan))", model_type
        )
    else:
        return None
    plan = complete(module, Plan((prefix + p, s) for p, s in plan.items()))
    logger.info("%s plan for %s (model_type %r): %d entries", source, type(module).__name__, model_type, len(plan))
    return plan


def base_model(module: nn.Module) -> tuple[str, nn.Module]:
    """(pattern prefix, base model): ("model.", LlamaModel) for LlamaForCausalLM, ("", m) for a base model."""
    name = getattr(module, "base_model_prefix", "")
    base = getattr(module, name, None) if name else None
    if isinstance(base, nn.Module) and base is not module:
        return f"{name}.", base
    return "", module


def complete(module: nn.Module, plan: Plan) -> Plan:
    """Drop entries that match nothing in `module`, then add its input embedding and output head."""
    names = [n for n, _ in module.named_modules()]
    entries = {p: s for p, s in plan.items() if any(match_pattern(p, n) for n in names)}
    dropped = [p for p in plan if p not in entries]
    if dropped:
        logger.debug("preset entries with no module in %s: %s", type(module).__name__, dropped)
    kept = Plan(entries)
    extra: dict[str, Style] = {}
    by_id = {id(m): n for n, m in module.named_modules()}
    embedding = _call(module, "get_input_embeddings")
    if isinstance(_unwrapped(embedding), nn.Embedding) and id(embedding) in by_id and kept.match(by_id[id(embedding)]) is None:
        extra[by_id[id(embedding)]] = EmbeddingParallel()
    head = _call(module, "get_output_embeddings")
    if _plain_linear(_unwrapped(head)) and id(head) in by_id and kept.match(by_id[id(head)]) is None:
        extra[by_id[id(head)]] = ColwiseParallel(gather_output=True)
        if _unwrapped(head).bias is not None:
            extra |= _tied_bias(module, _unwrapped(head))
    return follow_ties(module, Plan({**entries, **extra}))


def _plain_linear(module) -> bool:
    """An nn.Linear computing nn.Linear's forward: a subclass with a forward of its own (Dory's head scales each
    token's logit by a parameter of its own) may do anything to its outputs, and stays whole unless a plan says
    otherwise."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _unwrapped(module):
    """The layer inside a layer wrapper (layers.py; PEFT's modules_to_save: split like the layer, and
    integrations/peft/adapter_plan.py rewrites the entry)."""
    inner = wrapped_layer(module)
    return inner if inner is not None else module


def _call(module: nn.Module, method: str):
    try:
        return getattr(module, method)()
    except (AttributeError, NotImplementedError):
        return None


def _tied_bias(module: nn.Module, head: nn.Linear) -> dict[str, Style]:
    """The head's bias split by vocabulary means its other owners must split it alike (no forward change:
    the owner only holds it, as BERT's cls.predictions does for cls.predictions.decoder)."""
    out = {}
    for name, owner in module.named_modules():
        for pname, p in owner.named_parameters(recurse=False):
            if p is head.bias and owner is not head:
                out[name] = ShardParams(params={pname: 0}, input="split", output="split")
    return out


__all__ = ["PRESETS", "base_model", "complete", "preset", "preset_for"]
