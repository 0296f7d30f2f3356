"""The in-process engine: one Python process, one shard per device, one thread per shard (engine.py).

engine.py builds and runs `TensorParallel`; workers.py runs the shards' threads, boundary.py moves inputs
and outputs across devices (and gives each shard its own KV cache and other per-device objects),
shard_backward.py runs every shard's own backward pass, rollback.py undoes a half-built split, zero.py adds
ZeRO-3 for the parameters the plan leaves whole, per_device_optimizer.py steps an optimizer per device in the
shards' threads (default_step.py makes that the default step of plain torch.optim optimizers on CPU
slots), views.py runs a submodule of every shard as a split model of its own (`TensorParallel.view`).

Importing this package installs nothing: default_step.py defines torch.optim's global step hooks, and the first
split model that needs them installs them when it is made (global_hooks.py `split_model_made`); they go with the
last such model.
"""

from .engine import TensorParallel, current_rank
from .per_device_optimizer import PerDeviceOptimizer, per_device_optimizer
from . import default_step  # noqa: F401  (defines the step hooks that split models hold; installs nothing)

__all__ = ["PerDeviceOptimizer", "TensorParallel", "current_rank", "per_device_optimizer"]
