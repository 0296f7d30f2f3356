"""PEFT on split models: everything that imports peft or speaks PEFT's API lives here.

after_split.py: PEFT's own API around a model split first (``get_peft_model(split, ...)``,
``PeftModel.from_pretrained(split, ...)``), through a module-registration hook held by every split model
(global_hooks.py). adapter_io.py: what every way of holding an adapter on a split model shares (PEFT's saved
files, gathering the adapter, the refusals). transformers_adapters.py: transformers' own adapter methods
(``add_adapter``, ``load_adapter``) on a split transformers model. late_adapters.py: adapters PEFT added to a
split model, adopted by either engine (registered with engines/late_modules.py).

What plans and styles know of adapters needs no PEFT (its wrappers are recognised by their attributes):
plans/adapters.py rewrites a plan around PEFT's layers, styles/lora.py and styles/ia3.py split them.

Importing this package registers what the layers below call (the engines' adopters) and imports no PEFT:
transformers_adapters.py, which does, is loaded with the transformers integration.
"""

from . import after_split, late_adapters  # noqa: F401  (registers the engines' adopters; defines PEFT's hooks)
