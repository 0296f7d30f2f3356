"""Lightning: tensorshard under `ModelParallelStrategy`, for the Trainer and for Fabric.

Trainer: parallelize in the LightningModule's `configure_model` hook, on the mesh Lightning built:

    class LitModel(L.LightningModule):
        def configure_model(self):
            tp.parallelize(self.model, self.device_mesh["tensor_parallel"], plan=plan)

    L.Trainer(accelerator="cuda", devices=4, strategy=ModelParallelStrategy()).fit(LitModel())

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

from torch import nn

from ..engines.torchrun import parallelize
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
