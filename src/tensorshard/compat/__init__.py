"""Code written for the `tensor_parallel` package (2.0), run on tensorshard: ``import tensorshard.compat as tp``.

    import tensorshard.compat as tp
    model = tp.tensor_parallel(model, ["cuda:0", "cuda:1"])                     # as before
    model = tp.tensor_parallel(model, devices, tensor_parallel_config=tp.Config(state_rules={...}, ...))
    with tp.save_tensor_parallel(model):
        torch.save(model.state_dict(), "model.pt")

    sys.modules.update(tp.ALIASES)      # one line: `import tensor_parallel ...` now imports this package

The names and arguments mean what the original's README and docstrings say; the work is done by
tensorshard's plans and engines (a `Config` becomes a `Plan`: translate.py). What differs, and why, is in
docs/migrating.md. The original's module paths that hold names of this package are `ALIASES`' keys.
"""

import sys

from ..checkpoint import infer_sharded_device_map, save_tensor_parallel
from ..styles import HeadsWithValues, PerDeviceValues
from . import pretrained_model, state_actions
from .check import UntranslatableConfig
from .config import Config
from .dispatch import convert_state_dict
from .entry import Sharded, TensorParallel, TensorParallelPreTrainedModel, tensor_parallel
from .state_actions import LegacyStateAction, Scale, Split, SplitInChunks, SplitInGroupedChunks, StateAction

# The original's module paths, for ``sys.modules.update(ALIASES)``: its package, and each module whose public
# names this package has (the others held its engine's internals: docs/migrating.md lists them).
ALIASES = {
    "tensor_parallel": sys.modules[__name__],
    "tensor_parallel.state_actions": state_actions,
    "tensor_parallel.pretrained_model": pretrained_model,
    "tensor_parallel.config": sys.modules[f"{__name__}.config"],
    "tensor_parallel.dispatch": sys.modules[f"{__name__}.dispatch"],
    "tensor_parallel.factory": sys.modules[f"{__name__}.entry"],
    "tensor_parallel.tensor_parallel": sys.modules[f"{__name__}.entry"],
    "tensor_parallel.legacy": sys.modules[f"{__name__}.entry"],
}

__all__ = [
    "ALIASES",
    "Config",
    "HeadsWithValues",
    "LegacyStateAction",
    "PerDeviceValues",
    "Scale",
    "Sharded",
    "Split",
    "SplitInChunks",
    "SplitInGroupedChunks",
    "StateAction",
    "TensorParallel",
    "TensorParallelPreTrainedModel",
    "UntranslatableConfig",
    "convert_state_dict",
    "infer_sharded_device_map",
    "pretrained_model",
    "save_tensor_parallel",
    "state_actions",
    "tensor_parallel",
]
