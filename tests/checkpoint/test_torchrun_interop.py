"""Interoperation with torch.distributed.checkpoint (DCP) across real processes (gloo on CPU, the session's
3-rank pool).

Three ranks hold DTensors (Shard(0), uneven: 176 rows -> 59/59/58) and
1. save them with DCP, in its own format (``.distcp``, what Lightning writes) and in its safetensors format;
   the in-process engine then loads both at 2 devices, exactly, and the ranks load the ``.distcp`` folder
   into a model split by `parallelize` with `tp.load_sharded`;
2. load a tensorshard checkpoint saved in-process at 2 devices with DCP alone (HuggingFaceStorageReader),
   no tensorshard code on the ranks, exactly;
3. save a model split by `parallelize` the way Lightning does (DCP of its DTensor state dict): uneven and
   fused splits are in the padded "stacked" layout there, which the in-process engine refuses by name.
"""

import copy
import os

import pytest
import torch

import tensorshard as tp
from support import plans
from support.checkpoints import build, gathered
from support.harness import world_mesh
from support.models import Transformer

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def dcp_task(folder: str) -> list[str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = world_mesh()
    full = build().state_dict()
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    dcp.save({"model": sharded}, checkpoint_id=os.path.join(folder, "distcp"))
    dcp.save(sharded, storage_writer=HuggingFaceStorageWriter(os.path.join(folder, "hf"), save_distributed=True))

    wrong = []
    empty = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
    dcp.load(empty, storage_reader=HuggingFaceStorageReader(os.path.join(folder, "tensorshard")))
    wrong += [f"dcp.load {k}" for k, v in empty.items() if not torch.equal(v.full_tensor(), full[k])]

    torch.manual_seed(1)
    model = tp.parallelize(Transformer(n_heads=8, n_kv_heads=2, bias=True), mesh, plan=plans.transformer(8, 2))
    tp.load_sharded(model, os.path.join(folder, "distcp"), progress=False)  # DCP's own format, under torchrun
    wrong += [f"load_sharded {k}" for k, v in gathered(model).items() if not torch.equal(v, full[k])]

    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(folder, "lightning"))
    return wrong


def test_dcp_checkpoints_of_three_ranks_load_in_process_and_back(pool3, tmp_path):
    ref = build()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plans.transformer(8, 2), sharded=True)
    tp.save_sharded(model, tmp_path / "tensorshard")

    assert pool3.run(dcp_task, str(tmp_path)) == [[]] * 3

    assert len(list((tmp_path / "hf").glob("*.safetensors"))) == 3  # one file per rank, offsets inside
    for layout in ("distcp", "hf"):
        loaded = tp.tensor_parallel(Transformer(n_heads=8, n_kv_heads=2, bias=True), ["cpu"] * 2, plan=plans.transformer(8, 2))
        tp.load_sharded(loaded, tmp_path / layout, progress=False)
        state = gathered(loaded)
        for key, value in ref.state_dict().items():
            assert torch.equal(state[key], value), (layout, key)

    # A model split over 3 ranks keeps its query heads (8, in 2 KV groups: slices of unequal size) padded to
    # the longest slice in its DTensors: DCP stores that storage layout, which only DCP at 3 ranks puts back.
    loaded = tp.tensor_parallel(Transformer(n_heads=8, n_kv_heads=2, bias=True), ["cpu"] * 2, plan=plans.transformer(8, 2))
    before = {k: v.clone() for k, v in gathered(loaded).items()}
    with pytest.raises(ValueError, match=r"(?s)layers.0.attn.wq.weight: checkpoint \[96, 64\], model \[64, 64\].*stacked"):
        tp.load_sharded(loaded, tmp_path / "lightning", progress=False)
    assert all(torch.equal(v, before[k]) for k, v in gathered(loaded).items())
