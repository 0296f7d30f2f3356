"""Optimizers over split weights: which ones step a slice exactly, and the whole-weight step of those that do not.

    import tensorshard as tp
    tp.optimizers.register_elementwise(MyAdam)      # its update of an entry reads only that entry
    tp.optimizers.register_per_tensor(MyShampoo)    # it reads its whole tensor: split weights are stepped whole

kinds.py: the registry (elementwise, per-tensor, refused); whole.py: stepping a split weight whole;
guard.py: what runs before each step (the whole-weight step, or a refusal before anything changes).
"""

from .guard import step_split_whole
from .kinds import ELEMENTWISE, PER_TENSOR, REFUSED, kind_of, register_elementwise, register_per_tensor

__all__ = ["ELEMENTWISE", "PER_TENSOR", "REFUSED", "kind_of", "register_elementwise", "register_per_tensor",
           "step_split_whole"]
