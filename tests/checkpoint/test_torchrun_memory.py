"""The memory contract of `from_pretrained(path, mesh=...)` under torchrun, measured: each rank's peak
host memory stays within its share of the model plus about one tensor.

A 128 MiB checkpoint (largest tensor 8 MiB) in 4 safetensors files is loaded by 2 ranks of the session
pool. Each rank first loads a small checkpoint the same way (imports and one-time set-up), then resets its
peak-RSS counter (/proc/self/clear_refs) just before the load and reads VmHWM after it: extra = peak -
RSS before - bytes of its own shards. Measured here: 8 MiB, the pages of the largest tensor's file a
rank touches (a mapped file counts in RSS); a loader that held the model whole would add 64 MiB.
"""

import functools
import os

import pytest
import torch

import tensorshard as tp
from support.checkpoints import write_stack_checkpoint
from support.harness import world_mesh
from support.models import ResidualMLP, ResidualStack

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

DIM, HIDDEN, LAYERS, FILES = 1024, 2048, 8, 4  # 8 x 2 x (2048 x 1024) fp32 = 128 MiB; largest 8 MiB
PLAN = tp.Plan({"blocks.*.up": tp.ColwiseParallel(), "blocks.*.down": tp.RowwiseParallel()})


Block = functools.partial(ResidualMLP, DIM, HIDDEN)
Stack = functools.partial(ResidualStack, DIM, HIDDEN, LAYERS)


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def memory_task(folder: str, warm_up: str) -> dict:
    import ctypes
    import gc

    # The same load on a small checkpoint first: imports and one-time set-up are not the load's memory.
    tp.from_pretrained(warm_up, mesh=world_mesh(), model=Block, plan=tp.Plan({"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()}), progress=False)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # memory freed by earlier tasks goes back to the system
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter
    before = status("VmRSS")
    model = tp.from_pretrained(folder, mesh=world_mesh(), model=Stack, plan=PLAN, progress=False)
    peak = status("VmHWM")
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(x)
    return {"extra": peak - before - held, "held": held, "out": out}


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
def test_each_rank_holds_its_share_plus_about_one_tensor(pool2, tmp_path):
    from safetensors.torch import save_file

    total, largest = write_stack_checkpoint(tmp_path, layers=LAYERS, dim=DIM, hidden=HIDDEN, files=FILES, scale=0.02)
    (tmp_path / "small").mkdir()
    save_file({k: v.contiguous() for k, v in Block().state_dict().items()}, tmp_path / "small" / "model.safetensors")
    results = pool2.run(memory_task, str(tmp_path), str(tmp_path / "small"))
    for r in results:
        assert r["held"] < 0.55 * total  # its half of the big matrices, the norms whole
        print(f"\nrank held {r['held'] / 2**20:.0f} MiB, peak extra {r['extra'] / 2**20:.1f} MiB (largest tensor {largest / 2**20:.0f} MiB)")
        assert r["extra"] < largest + 16 * 2**20
    assert torch.equal(results[0]["out"], results[1]["out"])
