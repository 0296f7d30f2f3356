"""Lightning's tensor-parallel guide example with tensorshard: Trainer and Fabric on CPU with gloo.

In the process pool the job looks launched by torchrun (Lightning then uses the existing processes);
one test lets Lightning launch its own processes from a script, as `python train.py` would.
"""

import copy
import os
import subprocess
import sys

import lightning as L
import pytest
import torch

from support import lightning_example as ex
from support.harness import child_env
from support.helpers import rel_err
from support.models import FeedForward

pytestmark = pytest.mark.timeout(180)

HERE = os.path.dirname(__file__)


def _assert_same(weights, expected, tol):
    for name in expected:
        assert rel_err(weights[name], expected[name]) < tol, name


def trainer_checkpoint_task(folder: str) -> str:
    """Fit 2 epochs; and fit 1 epoch, save, resume in a fresh Trainer to 2: both match unsplit training."""
    L.seed_everything(0)
    straight = ex.LitModel()
    ref_model, data = copy.deepcopy(straight.model), straight.data
    ex.trainer(max_epochs=2).fit(straight)
    applied = straight.model.tensorshard.plan.assign(straight.model)
    assert {n: a.style for n, a in applied.items()} == ex.PLAN  # configure_model inferred the guide's plan
    expected = ex.train_unsplit(ref_model, ex.lightning_batches(data, epochs=2))
    _assert_same(ex.full_weights(straight.model), expected, 1e-4)  # fp32, 16 AdamW steps

    L.seed_everything(0)
    first = ex.LitModel()
    trainer = ex.trainer(max_epochs=1)
    trainer.fit(first)
    path = os.path.join(folder, "epoch1.ckpt")
    trainer.save_checkpoint(path)
    assert os.path.isdir(path) and any(f.endswith(".distcp") for f in os.listdir(path))  # a distributed checkpoint

    torch.manual_seed(1)  # other initial weights (seed_everything would also reseed the sampler)
    resumed = ex.LitModel()
    resumed.data = first.data
    ex.trainer(max_epochs=2).fit(resumed, ckpt_path=path)
    _assert_same(ex.full_weights(resumed.model), expected, 1e-4)
    return "ok"


def test_trainer_fit_save_and_resume(pool2, tmp_path):
    assert pool2.run(trainer_checkpoint_task, str(tmp_path), timeout=150) == ["ok", "ok"]


def fabric_task(folder: str) -> str:
    from lightning.fabric.strategies import ModelParallelStrategy

    from tensorshard.integrations.lightning import parallelize_fn

    strategy = ModelParallelStrategy(parallelize_fn=parallelize_fn(ex.PLAN))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randn(8, 64, generator=gen) for _ in range(5)]

    def setup(seed):
        torch.manual_seed(seed)
        model = fabric.setup(FeedForward(64, 64))
        return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))

    def train(model, opt, steps):
        for batch in steps:
            opt.zero_grad()
            fabric.backward(model(batch).sum())
            opt.step()

    torch.manual_seed(0)
    ref = FeedForward(64, 64)
    expected = ex.train_unsplit(ref, batches)

    model, opt = setup(0)
    assert isinstance(model.w1.weight, torch.distributed.tensor.DTensor)
    train(model, opt, batches[:3])
    path = os.path.join(folder, "step3")
    fabric.save(path, {"model": model, "optimizer": opt, "step": 3})
    train(model, opt, batches[3:])
    _assert_same(ex.full_weights(model.module), expected, 1e-4)

    resumed, opt2 = setup(1)
    state = {"model": resumed, "optimizer": opt2}
    rest = fabric.load(path, state)
    assert rest == {"step": 3}
    train(resumed, opt2, batches[3:])
    _assert_same(ex.full_weights(resumed.module), expected, 1e-4)
    return "ok"


def test_fabric_parallelize_fn_save_and_load(pool2, tmp_path):
    assert pool2.run(fabric_task, str(tmp_path)) == ["ok", "ok"]


@pytest.mark.slow
def test_trainer_launches_its_own_processes(tmp_path):
    """`python script.py` with devices=2: Lightning starts the second process itself."""
    env = child_env()
    script = os.path.join(HERE, "lightning_fit.py")
    done = subprocess.run(
        [sys.executable, script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=150, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed from epoch 1: weights match" in done.stdout
