"""The examples of docs/checkpoints.md run: the in-process ```python blocks in order, in one namespace, and
examples/torchrun/checkpoints.py at 2 ranks, then 3 ranks, then in one process, resuming each time: the
9 losses match one unsplit model trained 9 steps (fp32 rounding: 1e-5 relative)."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import tensorshard as tp
from support import ROOT
from support.harness import world_mesh

pytestmark = pytest.mark.timeout(120)

DOC = ROOT / "docs" / "checkpoints.md"


def example():
    spec = importlib.util.spec_from_file_location("checkpoints_example", ROOT / "examples" / "torchrun" / "checkpoints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_task(folder: str) -> list[float]:
    ex = example()
    torch.manual_seed(0)
    model = tp.parallelize(nn.Sequential(ex.Block(), ex.Block()), world_mesh(), plan=ex.PLAN)
    return ex.train(model, Path(folder))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_docs_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    assert len(blocks) >= 6
    namespace: dict = {}
    for block in blocks:
        if "torchrun --nproc_per_node" in block:
            continue  # run below, under the process pool
        exec(compile(block, str(DOC), "exec"), namespace)


def test_torchrun_example_resumes_across_rank_counts(pool2, pool3, tmp_path):
    ex = example()
    losses = pool2.run(example_task, str(tmp_path))[0] + pool3.run(example_task, str(tmp_path))[0]
    model = tp.tensor_parallel(nn.Sequential(ex.Block(), ex.Block()), ["cpu"], plan=ex.PLAN)
    losses += ex.train(model, tmp_path)
    assert tp.checkpoint.read_index(tmp_path)["metadata"] == {"step": "9"}

    torch.manual_seed(0)
    ref = nn.Sequential(ex.Block(), ex.Block())
    unsplit = []
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(9):
        x = torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(step))
        loss = ref(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        unsplit.append(loss.item())
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, unsplit)), (losses, unsplit)

    from safetensors.torch import load_file

    plain = nn.Sequential(ex.Block(), ex.Block())
    plain.load_state_dict(load_file(tmp_path / "unsplit" / "model.safetensors"))  # what the last run saved, unsplit
    with tp.save_tensor_parallel(model):
        assert all(torch.equal(plain.state_dict()[k], v) for k, v in model.state_dict().items())
