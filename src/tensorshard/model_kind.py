"""What kind of model the front door was handed, decided once.

`model_kind(module)` sorts a model into one of a few kinds, and the answer carries what the steps after it need:

    kind = model_kind(module)
    kind.name        # "module" | "transformers" | "peft" | "wrapper"
    kind.inner_path  # where the transformers model sits inside it ("" for a transformers model itself)
    kind.inner       # that transformers model

- **module**: any other `nn.Module` (a LightningModule too, unless it holds a transformers model): the engine's
  `TensorParallel`, with a preset or inferred plan for the module itself;
- **transformers**: a transformers `PreTrainedModel`: split as an instance of its own class
  (integrations/transformers/model.py);
- a kind an integration registers (`register_holder_kind`) for modules of its own holding a transformers model:
  integrations/peft/ registers **peft**, a PEFT `PeftModel` around one, split still a PeftModel;
- **wrapper**: any other module holding a transformers model (a user's classifier around a language model, a
  LightningModule holding one): the inner model's plan under its path, its ``generate`` and ``save_pretrained``
  (integrations/transformers/wrapped.py).

A PeftModel around a plain module (no transformers model inside) is a **module**: PEFT adds nothing to how it is
split but its adapter layers (integrations/peft/adapter_plan.py). When a module holds several transformers
models, the outermost first in module order is the one; nothing is searched again later. Neither transformers
nor peft is imported here: a model of theirs means they are loaded already.

Asked once per split: the front door (api.py `tensor_parallel`) asks and hands the answer on (`kind=`) to the
engine, the plan resolution (plans.resolve_plan) and the automatic plan (plan_inference/auto.py), which plans a
PEFT model or a wrapper from its inner model's kind (`ModelKind.inner_kind`), known without asking again. Only
an entry that did not pass the front door (torchrun's `parallelize`, the CLI, hand loading) is asked where its
plan is resolved.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from typing import Callable

from .layers import is_transformers_model

MODULE, TRANSFORMERS, WRAPPER = "module", "transformers", "wrapper"

# Kinds of module holding a transformers model that an integration splits its own way, in registration order:
# (name, test). integrations/peft/ registers its PeftModel's. Any other holder is a WRAPPER.
_HOLDER_KINDS: list[tuple[str, Callable[[nn.Module], bool]]] = []


def register_holder_kind(name: str, is_one: Callable[[nn.Module], bool]) -> None:
    """Give the modules `is_one` accepts, when they hold a transformers model, the kind `name` (not WRAPPER)."""
    if all(n != name for n, _ in _HOLDER_KINDS):
        _HOLDER_KINDS.append((name, is_one))


@dataclass(frozen=True)
class ModelKind:
    """One model's kind (see the module docstring)."""

    name: str  # MODULE, TRANSFORMERS, WRAPPER or a registered holder kind
    inner_path: str | None = None  # the transformers model's module path: "" for the model itself; None for MODULE
    inner: nn.Module | None = None  # the transformers model at that path (the unsplit one, consumed by splitting)

    @property
    def holds_transformers_model(self) -> bool:
        """True for every kind but MODULE: the transformers integration splits it."""
        return self.inner is not None

    @property
    def holds_inner(self) -> bool:
        """True when the transformers model is inside, not the model itself (a WRAPPER or a registered holder)."""
        return bool(self.inner_path)

    def inner_kind(self) -> "ModelKind":
        """The kind of the transformers model inside (TRANSFORMERS, itself at path ""), without asking again."""
        if self.inner is None:
            raise ValueError(f"a {self.name!r} model holds no transformers model")
        return ModelKind(TRANSFORMERS, "", self.inner)


def model_kind(module: object) -> ModelKind:
    """The kind of `module` (anything: what is not an nn.Module is a MODULE, which the engine then refuses)."""
    if not isinstance(module, nn.Module):
        return ModelKind(MODULE)
    if is_transformers_model(module):
        return ModelKind(TRANSFORMERS, "", module)
    found = next(((path, m) for path, m in module.named_modules() if is_transformers_model(m)), None)
    if found is None:
        return ModelKind(MODULE)
    name = next((n for n, is_one in _HOLDER_KINDS if is_one(module)), WRAPPER)
    return ModelKind(name, *found)
