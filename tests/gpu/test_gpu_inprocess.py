"""The in-process engine on the device lists one GPU reaches (support/gpu.py): a plain PyTorch transformer split
with its hand-written plan gives the unsplit model's outputs and AdamW training, with and without activation
checkpointing, and each device holds its own slices.

Against the unsplit model on the CPU: forward within 1e-4 relative and after three AdamW steps within 1e-3
(fp32; GPU kernels add in other orders than the CPU's, a little more rounding than the CPU tests' 1e-5 / 1e-4;
torch leaves TF32 off for matmuls by default, so the GPU computes in full fp32).
"""

import copy

import pytest
import torch

import tensorshard as tp
from support import plans
from support.gpu import ONE_GPU, WITH_ONE_GPU, WITH_ONE_GPU_IDS, assert_on_their_devices
from support.helpers import check_training_parity, rel_err
from support.hf_parity import gathered_grads
from support.models import ResidualStack, Transformer

pytestmark = ONE_GPU + [pytest.mark.timeout(300)]

FORWARD_TOL, TRAIN_TOL = 1e-4, 1e-3


@pytest.mark.parametrize("devices", WITH_ONE_GPU, ids=WITH_ONE_GPU_IDS)
def test_transformer_outputs_and_adamw_training_match_unsplit(devices, gen):
    torch.manual_seed(0)
    ref = Transformer(n_heads=8, n_kv_heads=2)
    model = tp.tensor_parallel(copy.deepcopy(ref), devices, plan=plans.transformer(8, 2), sharded=False)
    assert_on_their_devices(model, devices)
    tokens = torch.randint(0, 96, (2, 7), generator=gen)
    with torch.no_grad():
        out = model(tokens)
    assert out.device.type == torch.device(devices[0]).type  # outputs land on the first device
    check_training_parity(
        ref, model, lambda: torch.randint(0, 96, (2, 7), generator=gen), forward_tol=FORWARD_TOL, train_tol=TRAIN_TOL
    )


@pytest.mark.parametrize("devices", WITH_ONE_GPU, ids=WITH_ONE_GPU_IDS)
def test_zero3_partitioned_training_matches_unsplit(devices, gen):
    """sharded=True (the default for a model in train mode): the replicated norms are partitioned over the
    devices and gathered per call, across the GPU and the CPU slots."""
    torch.manual_seed(0)
    ref = Transformer(n_heads=8, n_kv_heads=2).train()
    model = tp.tensor_parallel(copy.deepcopy(ref), devices, plan=plans.transformer(8, 2), sharded=True)
    check_training_parity(
        ref, model, lambda: torch.randint(0, 96, (2, 7), generator=gen), forward_tol=FORWARD_TOL, train_tol=TRAIN_TOL
    )


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("devices", WITH_ONE_GPU, ids=WITH_ONE_GPU_IDS)
def test_activation_checkpointing_gives_the_unsplit_gradients(devices, reentrant, gen):
    """Each shard recomputes its checkpointed blocks in its own backward pass (on a GPU: in that GPU's
    autograd thread), meeting the other shards at the recomputed collectives."""
    plan = {"blocks.*.up": tp.ColwiseParallel(), "blocks.*.down": tp.RowwiseParallel()}
    torch.manual_seed(0)
    ref = ResidualStack(16, 64, 4, reentrant=reentrant)
    model = tp.tensor_parallel(copy.deepcopy(ref), devices, plan=plan, sharded=False)
    x = torch.randn(3, 5, 16, generator=gen)
    x_split, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = model(x_split)
    out.square().mean().backward()
    ref_out = ref(x_ref)
    ref_out.square().mean().backward()
    assert rel_err(out, ref_out) < FORWARD_TOL and rel_err(x_split.grad, x_ref.grad) < FORWARD_TOL
    grads = gathered_grads(model)
    assert grads.keys() == {k for k, _ in ref.named_parameters()}
    assert all(rel_err(grads[k], p.grad) < FORWARD_TOL for k, p in ref.named_parameters())


@pytest.mark.parametrize("devices", WITH_ONE_GPU[1:], ids=WITH_ONE_GPU_IDS[1:])
def test_per_device_optimizer_steps_each_device_in_its_own_thread(devices, gen):
    torch.manual_seed(0)
    ref = Transformer(n_heads=8, n_kv_heads=2)
    model = tp.tensor_parallel(copy.deepcopy(ref), devices, plan=plans.transformer(8, 2), sharded=False)
    opt = tp.per_device_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        tokens = torch.randint(0, 96, (2, 7), generator=gen)
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(tokens).square().mean().backward()
            o.step()
    tokens = torch.randint(0, 96, (2, 7), generator=gen)
    with torch.no_grad():
        assert rel_err(model(tokens), ref(tokens)) < TRAIN_TOL
