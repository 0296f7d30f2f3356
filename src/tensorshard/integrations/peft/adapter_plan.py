"""Plans for models with PEFT adapters: each adapter follows the split of the layer it wraps.

PEFT replaces an adapted layer by a wrapper at the same name: a LoRA layer keeps the original as
``.base_layer`` and adds ``lora_A.<adapter>`` / ``lora_B.<adapter>``; ``modules_to_save`` keeps it as
``.original_module`` beside trainable copies in ``modules_to_save.<adapter>``. A plan written for the bare
model names the wrapper. `adapt_plan` rewrites each such entry, before anything is split:

    "...q_proj": ColwiseParallel(blocks=("q",))     ->  "...q_proj":            LoraParallel(base="column")
                                                        "...q_proj.base_layer": ColwiseParallel(blocks=("q",))
                                                        "...q_proj.lora_A.*":   LoraFactor(split="whole_input")
                                                        "...q_proj.lora_B.*":   LoraFactor(split="output", blocks=("q",))
    "...o_proj": RowwiseParallel(blocks=("q",))     ->  LoraParallel(base="row"), the base's style,
                                                        A: LoraFactor(split="input", ...), B: LoraFactor(split="whole")
    "lm_head": ColwiseParallel(gather_output=True)  ->  "lm_head.original_module" and "lm_head.modules_to_save.*"
                                                        both ColwiseParallel(gather_output=True)

DoRA adds ``"...lora_magnitude_vector.*": LoraMagnitude(...)`` (split with the output beside a column layer,
whole beside a row layer); an IA3 layer becomes ``Ia3Parallel`` on the layer, the base's style on
``.base_layer`` and ``Ia3Scale`` on its ``ia3_l`` vectors (ia3_styles.py).

Adapters on layers the plan leaves whole stay whole. An adapter that cannot follow its layer's split (LoRA
variants other than DoRA, LoRA on an embedding or on a gathered output head, other PEFT tuners such as
LoHa or VeRA) is refused with an error naming the layer and the fix, before the model changes. PEFT is never
imported: its wrappers are recognised by their attributes (recognised.py).

`resolve_plan` runs `adapt_plan` on every plan of a model holding PEFT wrappers, and `refuse_prompt_learning`
first: both are registered with plans/rewriters.py at the end of this file.
"""

from __future__ import annotations

from torch import nn

from .recognised import is_adapter_layer, is_modules_to_save
from ...logs import get_logger
from ...plans.plan import Plan, match_pattern
from ...plans.rewriters import PlanRewriter, register_rewriter
from ...styles import ColwiseParallel, Replicate, RowwiseParallel, Style
from .ia3_styles import Ia3Parallel, Ia3Scale, ia3_layer_problem
from .lora_styles import LoraFactor, LoraMagnitude, LoraParallel, lora_layer_problem

logger = get_logger(__name__)


def has_adapters(module: nn.Module) -> bool:
    """Whether `module` holds a PEFT layer wrapper (a tuner layer, or modules_to_save)."""
    return any(is_adapter_layer(m) or is_modules_to_save(m) for m in module.modules())


def refuse_prompt_learning(module: nn.Module) -> None:
    """A PeftModel with a prompt-learning method (prompt tuning, prefix tuning, P-tuning) cannot be split: its
    prompt encoder works on the whole vocabulary's embeddings, which a split model holds in slices."""
    configs = getattr(module, "peft_config", None)
    if isinstance(configs, dict) and any(getattr(c, "is_prompt_learning", False) for c in configs.values()):
        raise NotImplementedError(
            f"a {type(module).__name__} with a prompt-learning method (prompt tuning, prefix tuning, P-tuning): its "
            "prompt encoder works on the whole vocabulary's embeddings, which a split model holds in slices. Use "
            "LoRA, DoRA or IA3 on a split model, or train the prompt on the unsplit one"
        )


def adapt_plan(module: nn.Module, plan: Plan) -> Plan:
    """`plan` with every entry that names a PEFT wrapper rewritten for the wrapper (see the module doc)."""
    wrappers = {n: m for n, m in module.named_modules() if is_adapter_layer(m) or is_modules_to_save(m)}
    if not wrappers:
        return plan
    names = [n for n, _ in module.named_modules()]
    entries: dict[str, Style] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if match_pattern(pattern, n) and plan.match(n)[0] == pattern]
        wrapped = [n for n in hits if n in wrappers]
        if not wrapped or isinstance(style, Replicate):
            entries[pattern] = style
            continue
        if len(wrapped) == len(hits) and len({_kind(wrappers[n]) for n in wrapped}) == 1:
            targets = [pattern]  # every module it names is the same kind of wrapper: keep the glob
        else:
            targets = wrapped  # exact names for the wrappers, the pattern for the rest
        for target in targets:
            first = next(n for n in wrapped if match_pattern(target, n))
            entries |= adapter_entries(target, wrappers[first], style)
        if targets is wrapped:
            entries[pattern] = style
    adapted = Plan(entries)
    logger.info("plan adapted to %d PEFT wrapper(s): %d entries", len(wrappers), len(adapted))
    return adapted


def _kind(module: nn.Module) -> tuple:
    """What decides a wrapper's entries: wrappers named by one glob must agree on it."""
    if is_modules_to_save(module):
        return ("modules_to_save",)
    dora = tuple(sorted(getattr(module, "lora_magnitude_vector", None) or {}))
    return (type(module).__module__, type(module).__name__, getattr(module, "is_feedforward", None), dora)


def adapter_entries(name: str, wrapper: nn.Module, style: Style) -> dict[str, Style]:
    """The entries that replace `name: style` when `name` is a PEFT wrapper (raises NotImplementedError, naming
    the layer and the fix, for an adapter that cannot follow the split)."""
    if is_modules_to_save(wrapper):
        return {f"{name}.original_module": style, f"{name}.modules_to_save.*": style}
    ia3 = is_ia3_layer(wrapper)
    problem = ia3_layer_problem(wrapper) if ia3 else lora_layer_problem(wrapper)
    base = base_kind(style)
    if problem is None and base is None:
        problem = (f"{'IA3' if ia3 else 'LoRA'} on a layer split by {style.describe()} (supported: ColwiseParallel "
                   "without gather_output, RowwiseParallel)")
    if problem is not None:
        raise NotImplementedError(
            f"{name} ({type(wrapper).__module__}.{type(wrapper).__name__}): {problem} cannot follow the plan's split "
            f"of this layer ({style.describe()}). Leave the layer out of the adapter (target_modules / exclude_modules), "
            "use LoRA, DoRA or IA3 on nn.Linear layers, or keep the layer whole in the plan (tp.Replicate())"
        )
    if ia3:
        split = ia3_scale_split(base, wrapper.is_feedforward)
        return {
            name: Ia3Parallel(base=base),
            f"{name}.base_layer": style,
            f"{name}.ia3_l": Ia3Scale(split=split, blocks=None if split == "whole" else style.blocks),
        }
    a, b = factor_styles(base, style.blocks)
    entries = {
        name: LoraParallel(base=base),
        f"{name}.base_layer": style,
        f"{name}.lora_A.*": a,
        f"{name}.lora_B.*": b,
    }
    if getattr(wrapper, "lora_magnitude_vector", None):  # DoRA
        entries[f"{name}.lora_magnitude_vector.*"] = magnitude_style(base, style.blocks)
    return entries


def is_ia3_layer(module: nn.Module) -> bool:
    return isinstance(getattr(module, "ia3_l", None), nn.ParameterDict)


def ia3_scale_split(base: str, feedforward: bool) -> str:
    """How an IA3 vector splits beside a `base` layer: with the features it scales (ia3_styles.py)."""
    if base == "column":
        return "whole" if feedforward else "output"
    return "input" if feedforward else "whole"


def magnitude_style(base: str, blocks=None) -> LoraMagnitude:
    """DoRA's magnitude beside a `base` ("column" or "row") layer split by `blocks`."""
    return LoraMagnitude(split="output", blocks=blocks) if base == "column" else LoraMagnitude(split="whole")


def factor_styles(base: str, blocks=None) -> tuple[LoraFactor, LoraFactor]:
    """(A's style, B's style) beside a `base` ("column" or "row") layer split by `blocks`."""
    if base == "column":
        return LoraFactor(split="whole_input"), LoraFactor(split="output", blocks=blocks)
    return LoraFactor(split="input", blocks=blocks), LoraFactor(split="whole")


def base_kind(style: Style) -> str | None:
    """"column" or "row" for the splits an adapter can follow, else None."""
    if type(style) is ColwiseParallel and not style.gather_output:
        return "column"
    if type(style) is RowwiseParallel:
        return "row"
    return None


register_rewriter(PlanRewriter("PEFT adapters", applies=has_adapters, rewrite=adapt_plan,
                               refuse=refuse_prompt_learning))
