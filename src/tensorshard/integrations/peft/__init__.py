"""PEFT on split models: everything that imports peft or speaks PEFT's API lives here.

after_split.py: PEFT's own API around a model split first (``get_peft_model(split, ...)``,
``PeftModel.from_pretrained(split, ...)``), through a module-registration hook held by every split model
(global_hooks.py). adapter_io.py: what every way of holding an adapter on a split model shares (PEFT's saved
files, gathering the adapter, the refusals). transformers_adapters.py: transformers' own adapter methods
(``add_adapter``, ``load_adapter``) on a split transformers model.

What the engines and plans know of adapters needs no PEFT (its wrappers are recognised by their attributes):
plans/adapters.py rewrites a plan around PEFT's layers, styles/lora.py and styles/ia3.py split them, and
plans/late_adapters.py with engines/*/late_adapters.py adopt layers PEFT added after splitting. This package
drives them through those files' functions (`adopt_late_modules`, `adopt_late_adapters`).
"""
