"""Workarounds for bugs of torch releases inside the declared range (pyproject.toml: torch>=2.10), each naming
the release that fixes it; on that release and later the plain torch call runs.

- `to_local`: before torch 2.12, the backward of `DTensor.to_local()` on an unevenly split `Shard` DTensor
  (176 features over 3 ranks: 59/59/58) rebuilds the gradient's global stride from the local gradient, which
  differs from the parameter's on the ranks that hold fewer rows; the gradient then reaches `.grad` as a whole
  `Replicate` tensor on every rank instead of this rank's slice. Here the gradient keeps the parameter's own
  global shape and stride.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

FIXED_IN = (2, 12)
_NEEDED = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < FIXED_IN


class _ToLocal(torch.autograd.Function):
    """`t.to_local()` whose backward gives the gradient `t`'s placements, global shape and stride."""

    @staticmethod
    def forward(ctx, t: DTensor) -> torch.Tensor:
        ctx.meta = (t.device_mesh, t.placements, t.shape, t.stride())
        local = t._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:
        mesh, placements, shape, stride = ctx.meta
        return DTensor.from_local(grad.contiguous(), mesh, placements, run_check=False, shape=shape, stride=stride)


def to_local(t: DTensor) -> torch.Tensor:
    """`t.to_local()`, with an exact gradient on torch releases before 2.12 (see the module docstring)."""
    return _ToLocal.apply(t) if _NEEDED else t.to_local()
