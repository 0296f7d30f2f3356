"""Engines: how split shards run. Each takes a module and a resolved Plan and reports a `SplitLayout`
(plans/slices.py: which slice of which original tensor each device or rank holds).

- inprocess/: one process, a list of devices, one thread per shard (`TensorParallel`).
- torchrun/: one process per device under torchrun, shards as DTensors (`parallelize`).

Both look for modules added to a split model after splitting through late_modules.py (PEFT's adapters:
integrations/peft registers the adopters).
"""
