"""The memory contract of streaming loads, measured: a ~1 GB checkpoint in several safetensors files
streams into 4 CPU slots with little host memory beyond the shards themselves.

The load runs in a fresh subprocess that resets its peak-RSS counter (/proc/self/clear_refs) just before
`tp.from_pretrained` and reads VmHWM after it. Extra memory = peak - RSS before - bytes the shards hold.
"""

import json
import os
import subprocess
import sys

import pytest

from support.checkpoints import write_stack_checkpoint
from support.harness import child_env

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

DIM, HIDDEN, LAYERS = 2048, 4096, 16  # 16 x 2 x (4096 x 2048) fp32 = 1.07 GB; largest tensor 32 MiB
FILES = 4

CHILD = r"""
import functools, json, os, sys
import torch
import tensorshard as tp
from support.models import ResidualStack

torch.set_num_threads(1)
DIM, HIDDEN, LAYERS = {dim}, {hidden}, {layers}

Stack = functools.partial(ResidualStack, DIM, HIDDEN, LAYERS)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

plan = tp.Plan({{"blocks.*.up": tp.ColwiseParallel(), "blocks.*.down": tp.RowwiseParallel()}})
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS counter
before = status("VmRSS")
model = tp.from_pretrained(sys.argv[1], ["cpu"] * 4, model=Stack, plan=plan, sharded=False, progress=False)
peak = status("VmHWM")
held = sum(tp.memory_per_device(model).values())

# Spot-check the values: each device's slices equal the file's (up: rows, down: columns, norm: whole).
from safetensors import safe_open
index = json.load(open(os.path.join(sys.argv[1], "model.safetensors.index.json")))["weight_map"]
same = []
for name, dim in (("blocks.0.up.weight", 0), (f"blocks.{{LAYERS - 1}}.down.weight", 1), ("blocks.3.norm.bias", None)):
    with safe_open(os.path.join(sys.argv[1], index[name]), "pt") as f:
        full = f.get_tensor(name)
    module, attr = name.rsplit(".", 1)
    pieces = [getattr(s.get_submodule(module), attr) for s in model.module_shards]
    same.append(all(torch.equal(p, full if dim is None else full.chunk(4, dim)[r]) for r, p in enumerate(pieces)))
print(json.dumps({{"before": before, "peak": peak, "held": held, "same": same}}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
def test_a_1gb_checkpoint_streams_into_4_slots_with_bounded_extra_memory(tmp_path):
    total, largest = write_stack_checkpoint(tmp_path, layers=LAYERS, dim=DIM, hidden=HIDDEN, files=FILES, scale=1.0)
    assert total > 1e9
    env = child_env()
    script = CHILD.format(dim=DIM, hidden=HIDDEN, layers=LAYERS)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"] == [True, True, True]
    assert result["held"] >= total  # the shards hold the whole model (replicated norms 4 times)
    extra = result["peak"] - result["before"] - result["held"]
    print(f"\npeak extra host memory: {extra / 2**20:.0f} MiB (largest tensor {largest / 2**20:.0f} MiB)")
    assert extra < 0.35e9 + largest
