"""Modules added to a model after it was split: the hook each engine calls, and who answers it.

    split = tp.tensor_parallel(model, devices)            # or tp.parallelize(model, mesh)
    model = get_peft_model(split, LoraConfig(...))        # PEFT adds layers to the split model's module tree

The engines look for such additions before each forward call (the in-process engine also before
``state_dict()`` and ``load_state_dict()``), but what an addition is, how it follows the split and what is
refused is the adding library's business: integrations/peft/late_in_process.py and late_torchrun.py register
one adopter per engine (`register_adopter`) when it is imported, which ``import tensorshard`` does, so no engine imports the
layer above it. An adopter is cheap when nothing was added (registrations.py) and raises, leaving the model
as it was, for what cannot follow the split.
"""

from __future__ import annotations

from typing import Callable, Literal

from torch import nn

Engine = Literal["inprocess", "torchrun"]
Adopter = Callable[[nn.Module], None]  # (a split model: TensorParallel, or the root module parallelize split)

_adopters: dict[str, Adopter] = {}


def register_adopter(engine: Engine, adopt: Adopter) -> Adopter:
    """Make `adopt(model)` the adopter the `engine` calls on its split models (one per engine: a later
    registration replaces an earlier one)."""
    if engine not in ("inprocess", "torchrun"):
        raise ValueError(f"engine={engine!r}: register an adopter for 'inprocess' or 'torchrun'")
    _adopters[engine] = adopt
    return adopt


def adopt_late_modules(engine: Engine, model: nn.Module) -> None:
    """Let the registered adopter look at what was added to `model` since splitting (nothing registered: nothing
    to adopt; only `import tensorshard` without its integrations would leave it so)."""
    adopt = _adopters.get(engine)
    if adopt is not None:
        adopt(model)
