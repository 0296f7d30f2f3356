"""A save killed half-way leaves the previous checkpoint loadable, whole and unmixed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tensorshard as tp
from support import plans
from support.harness import child_env
from support.models import FeedForward

pytestmark = pytest.mark.timeout(90)

# Saves generation after generation, every weight set to the generation number, until killed.
CHILD = r"""
import sys, torch
import tensorshard as tp
from support import plans
from support.models import FeedForward
torch.set_num_threads(1)
model = tp.tensor_parallel(FeedForward(1024, 8192), ["cpu"] * 2, plan=plans.FEED_FORWARD)
generation = 0
while True:
    generation += 1
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(generation))
    tp.save_sharded(model, sys.argv[1])
"""


def temp_files(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name] if folder.exists() else []


def committed_generation(folder: Path) -> int:
    try:
        return tp.checkpoint.read_index(folder)["generation"]
    except (OSError, ValueError):
        return 0


def test_killing_a_save_half_way_leaves_the_previous_checkpoint_loadable(tmp_path):
    folder = tmp_path / "ckpt"
    (tmp_path / "notes.txt").write_text("not ours")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder)], env=child_env(), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        caught = None
        while time.monotonic() < deadline and caught is None:
            # Wait for a committed checkpoint, then for the data files of the next one being written.
            if committed_generation(folder) >= 2 and temp_files(folder):
                os.kill(child.pid, signal.SIGKILL)
                caught = temp_files(folder)
            elif child.poll() is not None:
                pytest.fail(f"the saving process died: {child.stderr.read().decode()[-2000:]}")
            time.sleep(0.001)
        assert caught, "never caught a save in progress"
    finally:
        child.kill()
        child.wait()
    generation = committed_generation(folder)
    assert generation >= 2

    # The committed checkpoint loads (at another device count) and is all one generation.
    model = tp.tensor_parallel(FeedForward(1024, 8192), ["cpu"] * 3, plan=plans.FEED_FORWARD)
    tp.load_sharded(model, folder, progress=False)
    assert all(torch.equal(p, torch.full_like(p, float(generation))) for p in model.parameters())

    # The next save removes the leftovers of the killed one, and nothing that is not ours.
    tp.save_sharded(model, folder)
    assert not temp_files(folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted(["tensorshard.json"] + tp.checkpoint.read_index(folder)["files"])
    assert (tmp_path / "notes.txt").exists()


class RowMeans(torch.optim.Optimizer):
    """Keeps one number per row of each parameter: state that is not shaped like the parameter."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["row_mean"] = p.detach().mean(-1)


def test_a_failing_save_leaves_no_trace(tmp_path):
    model = tp.tensor_parallel(FeedForward(16, 32), ["cpu"] * 2, plan=plans.FEED_FORWARD)
    tp.save_sharded(model, tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    opt = RowMeans(model.parameters())
    opt.step()
    with pytest.raises(NotImplementedError, match="only state shaped like its parameter"):
        tp.save_sharded(model, tmp_path, optimizer=opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert committed_generation(tmp_path) == 1


def test_saving_over_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    model = tp.tensor_parallel(FeedForward(16, 32), ["cpu"] * 2, plan=plans.FEED_FORWARD)
    with pytest.raises(NotADirectoryError, match="is a file"):
        tp.save_sharded(model, tmp_path / "file")
