"""A hand-written plan's column/row pairs under torchrun (tp.parallelize), at 2 and 3 ranks: the cases of
tests/support/plan_pairs.py (an op between a hand-placed ColwiseParallel and its RowwiseParallel partner) match
the unsplit model (fp32, 1e-5 relative) or are refused on every rank before the model changes, naming the
module path and the op; with check=True a refused pair stays whole (its weights are not split)."""

import copy

import pytest
import torch

import tensorshard as tp
from support.harness import world_mesh
from support.helpers import rel_err
from support.plan_pairs import CASES, build, example, split_layers

pytestmark = pytest.mark.timeout(180)


def pairs_task() -> dict:
    mesh = world_mesh()
    out: dict[str, tuple] = {}
    with torch.no_grad():
        for name, (_, _, verdict, _) in CASES.items():
            # check=True on the exact cases self-checks numerically; the in-process tests cover all, here one
            for check in (None, True) if verdict == "refused" or name == "gate * up" else (None,):
                ref, plan, _, op = build(name)
                x = example(name)
                model = copy.deepcopy(ref)
                try:
                    tp.parallelize(model, mesh, plan=plan, check=check)
                except ValueError as e:
                    message = str(e)
                    out[f"{name} {check}"] = ("refused", op in message and "in mid (" in message,
                                              torch.equal(model.up.weight, ref.up.weight))
                    continue
                whole = [model.tensorshard.splits[f"{layer}.weight"] is None for layer in split_layers(name)]
                out[f"{name} {check}"] = ("ran", rel_err(model(x), ref(x)), all(whole))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_pairs_are_exact_or_refused_under_torchrun(pool2, pool3, world):
    results = (pool2 if world == 2 else pool3).run(pairs_task, timeout=170)
    for rank, result in enumerate(results):
        for name, (_, _, verdict, _) in CASES.items():
            default, checked = result[f"{name} None"], result.get(f"{name} True", result[f"{name} None"])
            if verdict == "refused":
                assert default == ("refused", True, True), (rank, name, default)  # named the op; model untouched
                assert checked[0] == "ran" and checked[1] < 1e-5 and checked[2], (rank, name, checked)  # kept whole
            else:
                for got in (default, checked):
                    assert got[0] == "ran" and got[1] < 1e-5 and not got[2], (rank, name, got)  # split, exact
