"""The state of optimizers that step split weights whole (tensorshard/optimizers) saves at one device count and
resumes at another: Adafactor's factored moments (a row moment sliced with a row-split weight, whole with a
column-split one, and the reverse for the column moment), Muon's momentum (shaped like its weight).

Resuming at 3 devices from a 2-device checkpoint (and 3 -> 2) continues like the unsplit model that never
stopped: losses within 1e-5 relative (fp32).
"""

import copy

import pytest
import torch

import tensorshard as tp
from support import optimizers, tiny_llama

pytestmark = pytest.mark.timeout(120)


def build(model, family):
    if family == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=1e-2)
    for name, p in model.named_parameters():  # one optimizer per checkpoint: Muon on the blocks' matrices alone
        p.requires_grad_(p.ndim == 2 and "embed" not in name and "lm_head" not in name)
    return torch.optim.Muon([p for p in model.parameters() if p.requires_grad], lr=optimizers.MUON_LR)


@pytest.mark.parametrize("family", ["adafactor", "muon"])
@pytest.mark.parametrize("saved, resumed", [(2, 3), (3, 2)])
def test_state_saved_at_one_device_count_resumes_at_another(tmp_path, family, saved, resumed):
    ref = tiny_llama.build().train()
    data = optimizers.batches(6)
    unsplit = copy.deepcopy(ref)
    want = optimizers.train(unsplit, [build(unsplit, family)], data)

    first = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * saved, sharded=False)
    opt = build(first, family)
    got = optimizers.train(first, [opt], data[:3])
    tp.save_sharded(first, tmp_path, optimizer=opt)

    second = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * resumed, sharded=False)
    opt = build(second, family)
    tp.load_sharded(second, tmp_path, optimizer=opt, progress=False)
    got += optimizers.train(second, [opt], data[3:])
    assert optimizers.worst_rel(got, want) < 1e-5
