"""Lightning: tensorshard under `ModelParallelStrategy`, for the Trainer and for Fabric.

Trainer: parallelize in the LightningModule's `configure_model` hook, on the mesh Lightning built, and use
`TensorParallelStrategy` (Lightning's `ModelParallelStrategy` plus a check that the hook split the model):

    class LitModel(L.LightningModule):
        def configure_model(self):
            tp.parallelize(self.model, self.device_mesh["tensor_parallel"])  # a preset or inferred plan; plan= to choose

    L.Trainer(accelerator="cuda", devices=4, strategy=TensorParallelStrategy()).fit(LitModel())

Fabric: hand the strategy a `parallelize_fn`:

    strategy = ModelParallelStrategy(parallelize_fn=tensorshard.integrations.lightning.parallelize_fn(plan))
    fabric = L.Fabric(accelerator="cuda", devices=4, strategy=strategy)

Lightning's strategy gives every rank of a tensor-parallel group the same batches (its sampler splits data
over the data-parallel dimension only), saves and loads distributed checkpoints through
`torch.distributed.checkpoint` (our parameters are DTensors), and applies FSDP2 when you call
`fully_shard` on `self.device_mesh["data_parallel"]` after parallelizing.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.tensor import DTensor

from ..engines.torchrun import TorchrunState, parallelize
from ..plans.plan import Plan

TP_DIM = "tensor_parallel"  # the name ModelParallelStrategy gives the tensor-parallel mesh dimension


def parallelize_fn(
    plan: Plan | dict | None = None,
    *,
    data_parallel: Callable[[nn.Module, Any], nn.Module] | None = None,
    tp_dim: str = TP_DIM,
    **kwargs: Any,
) -> Callable[[nn.Module, Any], nn.Module]:
    """A `parallelize_fn` for Fabric's `ModelParallelStrategy`: tensor parallelism on the mesh's
    `tp_dim` dimension with `plan`, then `data_parallel(module, mesh)` if given (e.g. FSDP2:
    ``lambda m, mesh: fully_shard(m, mesh=mesh["data_parallel"])``). Extra keyword arguments go to
    `tensorshard.parallelize`.
    """

    def apply(module: nn.Module, device_mesh) -> nn.Module:
        names = device_mesh.mesh_dim_names or ()
        if tp_dim not in names:
            raise ValueError(
                f"the device mesh has dimensions {names}, none named {tp_dim!r}; ModelParallelStrategy names its "
                f"dimensions ('data_parallel', 'tensor_parallel'). Pass tp_dim= to name another one."
            )
        module = parallelize(module, device_mesh[tp_dim], plan, **kwargs)
        return data_parallel(module, device_mesh) if data_parallel is not None else module

    return apply


class TensorParallelStrategy(ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` (same arguments), refusing to train a model left whole.

    Under `ModelParallelStrategy` the LightningModule splits its model in `configure_model`. If that hook
    splits nothing (it returns early, or parallelizes another module than the one trained), every rank of a
    tensor-parallel group trains the whole model on the same batches: N times the work, without an error.
    This strategy checks after `configure_model`, before the first step, and raises instead.
    """

    def setup(self, trainer) -> None:
        check_configure_model(self.lightning_module, self.device_mesh, type(self).__name__)
        super().setup(trainer)


def check_configure_model(module: nn.Module, device_mesh, strategy: str = "ModelParallelStrategy") -> None:
    """Raise when `module` (a LightningModule whose `configure_model` has run) is not split over the
    tensor-parallel dimension of `device_mesh` although that dimension has more than one rank."""
    name = type(module).__name__
    fix = (
        f"def configure_model(self): tp.parallelize(self.model, self.device_mesh[{TP_DIM!r}], plan=plan), "
        "with self.model the module training_step uses"
    )
    if not is_overridden("configure_model", module):
        raise TypeError(f"{name} has no configure_model() hook: under {strategy} the model is split there. Add {fix}.")
    tp_mesh = device_mesh[TP_DIM] if TP_DIM in (device_mesh.mesh_dim_names or ()) else device_mesh
    if tp_mesh.size() > 1 and not _split_over(module, tp_mesh):
        raise RuntimeError(
            f"{name}.configure_model() left the model whole: no parameter is split over the {tp_mesh.size()} "
            f"ranks of the tensor-parallel mesh, so each of them would train the whole model on the same batches. "
            f"Split it there ({fix}), and check that the hook does not return before it does."
        )


def _split_over(module: nn.Module, tp_mesh) -> bool:
    """True when tensorshard parallelized a submodule, or a parameter is a DTensor on the TP mesh (torch's
    own tensor parallelism; FSDP2 on top makes it a 2-D DTensor with a tensor-parallel dimension)."""

    if any(isinstance(getattr(m, "tensorshard", None), TorchrunState) for m in module.modules()):
        return True
    for p in module.parameters():
        if isinstance(p, DTensor) and (p.device_mesh == tp_mesh or TP_DIM in (p.device_mesh.mesh_dim_names or ())):
            return True
    return False
