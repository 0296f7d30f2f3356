"""parallelize(): what it does to the model, where the weights come from, and its errors."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import tensorshard as tp
from support import plans
from support.harness import world_mesh
from support.helpers import rel_err
from support.models import FeedForward

pytestmark = pytest.mark.timeout(120)


# --- without a process group --------------------------------------------------------------------------


def test_distributed_flag_outside_torchrun_says_how_to_launch(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match=r"torchrun --nproc_per_node=N script\.py"):
        tp.tensor_parallel(FeedForward(8, 16), plan=plans.FEED_FORWARD, distributed=True)


def test_distributed_flag_refuses_several_devices_and_sharded():
    with pytest.raises(ValueError, match="each process drives one device"):
        tp.tensor_parallel(FeedForward(8, 16), ["cpu", "cpu"], plan=plans.FEED_FORWARD, distributed=True)
    with pytest.raises(NotImplementedError, match="fully_shard"):
        tp.tensor_parallel(FeedForward(8, 16), plan=plans.FEED_FORWARD, distributed=True, sharded=True)


def test_parallelize_needs_a_device_mesh():
    with pytest.raises(TypeError, match="init_device_mesh"):
        tp.parallelize(FeedForward(8, 16), "cpu", plan=plans.FEED_FORWARD)
    with pytest.raises(TypeError, match="nn.Module"):
        tp.parallelize("model", "cpu")


# --- in the pool ----------------------------------------------------------------------------------------


def weights_from_rank_zero_task() -> float:
    """Ranks built different weights (no shared seed); all end up with TP rank 0's."""
    torch.manual_seed(dist.get_rank())
    mine = FeedForward(16, 32)
    torch.manual_seed(0)
    rank_zeros = FeedForward(16, 32)
    model = tp.parallelize(mine, world_mesh(), plan=plans.FEED_FORWARD)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert model.w1.weight.to_local().shape == (32 // dist.get_world_size(), 16)  # only this rank's rows
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    return rel_err(model(x), rank_zeros(x))


def test_weights_come_from_rank_zero(pool2):
    assert max(pool2.run(weights_from_rank_zero_task)) < 1e-6


def gloo_group_with_a_gpu_task() -> tuple[str, str, float]:
    """A gloo job on a machine with one GPU (simulated where there is none; the pool's ranks outnumber it):
    tensor_parallel(distributed=True) follows the group's backend to the CPU, not cuda:LOCAL_RANK."""
    saved = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: 1)
    try:
        torch.manual_seed(0)
        ref = FeedForward(16, 32)
        model = tp.tensor_parallel(copy.deepcopy(ref), plan=plans.FEED_FORWARD, distributed=True)
    finally:
        torch.cuda.is_available, torch.cuda.device_count = saved
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    return model.tensorshard.mesh.device_type, model.w1.weight.device.type, rel_err(model(x), ref(x))


def _mesh_builds_nccl_where_cuda_is_available() -> bool:
    """torch 2.10's DeviceMesh gives a gloo world a "cpu:gloo,cuda:nccl" group when CUDA is available: with the
    GPU only simulated, a CUDA build of torch then starts NCCL and fails (a real GPU would serve it)."""
    import inspect
    from torch.distributed.device_mesh import DeviceMesh

    source = inspect.getsource(DeviceMesh) if dist.is_nccl_available() and not torch.cuda.is_available() else ""
    return '"cpu:gloo,cuda:nccl"' in source


@pytest.mark.skipif(_mesh_builds_nccl_where_cuda_is_available(), reason="no GPU to simulate on this torch's CUDA build")
def test_distributed_flag_in_a_gloo_group_stays_on_the_cpu_where_gpus_are_visible(pool3):
    for mesh_type, weight_device, err in pool3.run(gloo_group_with_a_gpu_task):
        assert (mesh_type, weight_device) == ("cpu", "cpu") and err < 1e-5


def errors_task() -> str:
    world = dist.get_world_size()
    mesh2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = FeedForward(16, 32)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"1-D tensor-parallel mesh.*mesh\['tensor_parallel'\]"):
        tp.parallelize(model, mesh2d, plan=plans.FEED_FORWARD)
    with pytest.raises(ValueError, match="'w4' matches no module"):
        tp.parallelize(model, mesh2d["tensor_parallel"], plan={"w4": tp.ColwiseParallel()})
    with pytest.raises(ValueError, match="src_data_rank=5"):
        tp.parallelize(model, mesh2d["tensor_parallel"], plan=plans.FEED_FORWARD, src_data_rank=5)
    with pytest.raises(ValueError, match="check_inputs"):
        tp.parallelize(model, mesh2d["tensor_parallel"], plan=plans.FEED_FORWARD, check_inputs=-1)
    assert all(torch.equal(t, before[k]) and not isinstance(t, DTensor) for k, t in model.state_dict().items())

    mesh = mesh2d["tensor_parallel"]
    assert tp.parallelize(model, mesh, plan=plans.FEED_FORWARD) is model
    assert tp.parallelize(model, mesh, plan=plans.FEED_FORWARD) is model  # again: nothing to do (Lightning)
    with pytest.raises(TypeError, match="already parallelized"):
        tp.parallelize(model, mesh, plan={"w[13]": tp.ColwiseParallel(), "w2": tp.RowwiseParallel(), "w1": tp.Replicate()})
    return "ok"


def test_bad_input_leaves_the_model_alone(pool2):
    assert pool2.run(errors_task) == ["ok", "ok"]


# --- without a plan: the preset or an inferred plan, as in one process ------------------------------------


def no_plan_task() -> tuple[float, float, float, bool]:
    from support import tiny_llama  # the tests' folder is on the workers' path

    torch.manual_seed(0)
    ff = FeedForward(16, 48)
    ff_ref = copy.deepcopy(ff)
    tp.parallelize(ff, world_mesh())  # inferred: w1/w3 by columns, w2 by rows, self-checked
    inferred = {name: type(a.style).__name__ for name, a in ff.tensorshard.plan.assign(ff_ref).items()}
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    ff_err = rel_err(ff(x), ff_ref(x))
    assert isinstance(ff.w2.weight, DTensor) and ff.w2.weight.to_local().shape[1] == 48 // dist.get_world_size()

    llama = tiny_llama.build()
    ref = copy.deepcopy(llama)
    tp.parallelize(llama, world_mesh())  # the llama preset
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    out, want = llama(ids, labels=ids), ref(ids, labels=ids)
    out.loss.backward(), want.loss.backward()
    grad = llama.model.layers[0].mlp.down_proj.weight.grad.full_tensor()
    found = inferred == {"w1": "ColwiseParallel", "w2": "RowwiseParallel", "w3": "ColwiseParallel"}
    return ff_err, rel_err(out.logits, want.logits), rel_err(grad, ref.model.layers[0].mlp.down_proj.weight.grad), found


def test_without_a_plan_uses_the_preset_or_infers_one(pool2):
    for ff_err, logits_err, grad_err, found in pool2.run(no_plan_task):
        assert found and ff_err < 1e-6 and logits_err < 1e-5 and grad_err < 1e-5


def test_sequence_parallel_plans_round_trip_through_json():
    from support import tiny_llama

    plan = tiny_llama.sequence_parallel_plan()
    assert tp.Plan.from_json(plan.to_json()) == plan
    assert "RowwiseToSequence(blocks=('q',))" in plan.table() and "VocabParallelHead()" in plan.table()
    with pytest.raises(ValueError, match="input='gathered'"):
        tp.SequenceParallel(input="gathered")
    with pytest.raises(ValueError, match="never gathers"):
        tp.VocabParallelHead(gather_output=True)
