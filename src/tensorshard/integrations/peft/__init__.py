"""PEFT on split models: everything that imports peft or speaks PEFT's API lives here.

after_split.py: PEFT's own API around a model split first (``get_peft_model(split, ...)``,
``PeftModel.from_pretrained(split, ...)``), through a module-registration hook held by every split model
(global_hooks.py). adapter_io.py: what every way of holding an adapter on a split model shares (PEFT's saved
files, gathering the adapter, the refusals). transformers_adapters.py: transformers' own adapter methods
(``add_adapter``, ``load_adapter``) on a split transformers model. before_split.py: a PeftModel split whole
(``tp.tensor_parallel(peft_model, devices)``), still a PeftModel. late_adapters.py: adapters PEFT added to a
split model, planned for either engine; late_in_process.py and late_torchrun.py adopt them (registered with
engines/late_modules.py).

adapter_plan.py: plans rewritten around PEFT's layers (registered with plans/rewriters.py); lora_styles.py and
ia3_styles.py: the styles that split them (registered with the styles' names, so a plan JSON naming them loads),
over adapter_layer_style.py. None of these imports PEFT: its models and wrappers are recognised by their
attributes (recognised.py, which also makes them known to model_kind.py and layers.py below).

Importing this package registers what the layers below call (the plan rewriter, the engines' adopters, the
gathering ``save_pretrained`` of a PeftModel split by `parallelize`) and imports no PEFT:
transformers_adapters.py, which does, is loaded with the transformers integration.
"""

# each registers what the layers below it call; after_split.py defines PEFT's hooks (installed at first use)
from . import recognised  # noqa: F401  (first: the kind of a PeftModel, PEFT's layer wrappers)
from . import adapter_io, adapter_plan, after_split, late_in_process, late_torchrun  # noqa: F401
