"""The state of optimizers that step split weights whole (tensorshard/optimizers) saves at one device count and
resumes at another: Adafactor's factored moments (a row moment sliced with a row-split weight, whole with a
column-split one, and the reverse for the column moment), Muon's momentum (shaped like its weight).

Resuming at 3 devices from a 2-device checkpoint (and 3 -> 2) continues like the unsplit model that never
stopped: losses within 1e-5 relative (fp32). Saved in-process at 2 devices, resumed under torchrun at 3 ranks: the same.
"""

import copy

import pytest
import torch

import tensorshard as tp
from support import optimizers, tiny_llama
from support.harness import world_mesh

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("family", ["adafactor", "muon"])
@pytest.mark.parametrize("saved, resumed", [(2, 3), (3, 2)])
def test_state_saved_at_one_device_count_resumes_at_another(tmp_path, family, saved, resumed):
    ref = tiny_llama.build().train()
    data = optimizers.batches(6)
    unsplit = copy.deepcopy(ref)
    want = optimizers.train(unsplit, [optimizers.single(unsplit, family)], data)

    first = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * saved, sharded=False)
    opt = optimizers.single(first, family)
    got = optimizers.train(first, [opt], data[:3])
    tp.save_sharded(first, tmp_path, optimizer=opt)

    second = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * resumed, sharded=False)
    opt = optimizers.single(second, family)
    tp.load_sharded(second, tmp_path, optimizer=opt, progress=False)
    got += optimizers.train(second, [opt], data[3:])
    assert optimizers.worst_rel(got, want) < 1e-5


def resume_task(folder: str, family: str) -> list[float]:
    model = tp.parallelize(tiny_llama.build().train(), world_mesh(), plan=tiny_llama.plan())
    opt = optimizers.single(model, family)
    tp.load_sharded(model, folder, optimizer=opt, progress=False)
    return optimizers.train(model, [opt], optimizers.batches(6)[3:])


@pytest.mark.parametrize("family", ["adafactor", "muon"])
def test_state_saved_in_process_resumes_under_torchrun_at_3_ranks(tmp_path, pool3, family):
    ref = tiny_llama.build().train()
    data = optimizers.batches(6)
    unsplit = copy.deepcopy(ref)
    want = optimizers.train(unsplit, [optimizers.single(unsplit, family)], data)
    first = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, sharded=False)
    opt = optimizers.single(first, family)
    got = optimizers.train(first, [opt], data[:3])
    tp.save_sharded(first, tmp_path, optimizer=opt)
    for rest in pool3.run(resume_task, str(tmp_path), family):
        assert optimizers.worst_rel(got + rest, want) < 1e-5
