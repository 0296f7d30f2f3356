"""tensorshard[quant]: a plain MLP of bitsandbytes 4-bit layers split over 2 CPU slots gives the unsplit outputs."""

import bitsandbytes as bnb
import torch

import tensorshard as tp


def mlp():
    torch.manual_seed(0)
    layers = [bnb.nn.Linear4bit(128, 256, quant_type="nf4"), torch.nn.GELU(), bnb.nn.Linear4bit(256, 128, quant_type="nf4")]
    return torch.nn.Sequential(*layers).to("cpu").eval()  # bitsandbytes quantizes on the move to a device


x = torch.randn(4, 128)
reference, model = mlp(), tp.tensor_parallel(mlp(), ["cpu", "cpu"])
with torch.no_grad():
    want, got = reference(x), model(x)
err = ((got - want).norm() / want.norm()).item()
# on CPUs with bf16 kernels bitsandbytes may round the 4-bit scales to bf16 on the first forward: 1e-2, not 1e-5
assert err < 1e-2, err
print(f"quant ok: relative error {err:.1e}")
