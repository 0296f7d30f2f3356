"""Interoperation with torch.distributed.checkpoint across real processes (gloo on CPU).

Three spawned ranks hold DTensors (Shard(0), uneven: 176 rows -> 59/59/58) and
1. save them with DCP, in its own format (``.distcp``, what Lightning writes) and in its safetensors format;
   the in-process engine then loads both at 2 devices, exactly;
2. load a tensorshard checkpoint saved in-process at 2 devices with DCP alone (HuggingFaceStorageReader),
   no tensorshard code on the ranks, exactly.
"""

import copy
import os

import pytest
import torch

import plans_for_tests as plans
import tensorshard as tp
from models import Transformer

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

WORLD = 3


def reference() -> Transformer:
    torch.manual_seed(0)  # every process builds the same weights
    return Transformer(n_heads=8, n_kv_heads=2, bias=True)


def _rank(rank: int, init_file: str, folder: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        full = reference().state_dict()
        sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        dcp.save({"model": sharded}, checkpoint_id=os.path.join(folder, "distcp"))
        dcp.save(sharded, storage_writer=HuggingFaceStorageWriter(os.path.join(folder, "hf"), save_distributed=True))

        empty = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
        dcp.load(empty, storage_reader=HuggingFaceStorageReader(os.path.join(folder, "tensorshard")))
        for k, v in empty.items():
            if not torch.equal(v.full_tensor(), full[k]):
                raise AssertionError(f"rank {rank}: {k} differs after loading the tensorshard checkpoint")
    finally:
        dist.destroy_process_group()


def gathered(model) -> dict:
    with tp.save_tensor_parallel(model):
        return model.state_dict()


def test_dcp_checkpoints_of_three_ranks_load_in_process_and_back(tmp_path):
    import torch.multiprocessing as mp

    ref = reference()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plans.transformer(8, 2), sharded=True)
    tp.save_sharded(model, tmp_path / "tensorshard")

    mp.start_processes(_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, start_method="spawn")

    assert len(list((tmp_path / "hf").glob("*.safetensors"))) == WORLD  # one file per rank, offsets inside
    for layout in ("distcp", "hf"):
        loaded = tp.tensor_parallel(Transformer(n_heads=8, n_kv_heads=2, bias=True), ["cpu"] * 2, plan=plans.transformer(8, 2))
        tp.load_sharded(loaded, tmp_path / layout, progress=False)
        state = gathered(loaded)
        for key, value in ref.state_dict().items():
            assert torch.equal(state[key], value), (layout, key)
