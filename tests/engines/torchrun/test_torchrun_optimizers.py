"""Optimizers that read a whole weight, under torchrun (2 and 3 ranks; 3: uneven splits of the MLP's 176 features):
Muon and Adafactor step each split weight whole (tensorshard/optimizers), a trust-ratio optimizer and an override
of Muon's step are refused before any parameter changes, an unknown subclass warns once and trains exactly.

Tolerances against the unsplit model's losses over 6 steps (fp32): 1e-5 relative (tests/support/optimizers.py says
why Muon needs its default lr for that). Counts: a Muon step costs one all-gather per split matrix it holds.
"""

import copy
import warnings

import pytest
import torch

import tensorshard as tp
from support import optimizers, tiny_llama
from support.harness import world_mesh

pytestmark = pytest.mark.timeout(180)  # the first test starts the 2- and 3-rank pools

STEPS = 6


def family_task(family: str, closure: bool = False) -> dict:
    ref = tiny_llama.build().train()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=tiny_llama.plan())
    data = optimizers.batches(STEPS)
    opts = optimizers.build(model, family)
    before = optimizers.snapshot(model)
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with tp.count_collectives() as counts:
                got = optimizers.train(model, opts, data[:1], closure=closure)
            got += optimizers.train(model, opts, data[1:], closure=closure)
        except (TypeError, RuntimeError) as e:
            return {"refused": str(e), "unchanged": optimizers.unchanged(model, before)}
    out["warnings"] = [str(w.message) for w in caught if "tensorshard assumes" in str(w.message)]
    out["worst"] = optimizers.worst_rel(got, optimizers.train(ref, optimizers.build(ref, family), data))
    out["all_gathers"] = [where for phase, kind, _, where in counts.log if kind == "all_gather" and "optimizer step" in where]
    out["matrices"] = sum(1 for n, p in model.named_parameters()
                          if p.ndim == 2 and "embed" not in n and "lm_head" not in n and tiny_llama_split(model, n))
    return out


def tiny_llama_split(model, name: str) -> bool:
    return model.tensorshard.splits.get(name) is not None


@pytest.mark.parametrize("family", ["muon", "adafactor"])
def test_whole_weight_optimizers_match_the_unsplit_model(pool2, pool3, family):
    for pool in (pool2, pool3):
        for out in pool.run(family_task, family):
            assert "refused" not in out, out
            assert out["worst"] < 1e-5, (pool.world, out["worst"])
            if family == "muon":  # one all-gather per split matrix (weight, gradient and momentum stacked)
                assert len(out["all_gathers"]) == out["matrices"] > 0


def test_a_closure_runs_once_before_the_whole_weight_step(pool3):
    """As Lightning's ModelParallelStrategy calls step(closure)."""
    for out in pool3.run(family_task, "muon", True):
        assert out["worst"] < 1e-5 and len(out["all_gathers"]) == out["matrices"]


@pytest.mark.parametrize("family", ["lamb", "muon_subclass"])
def test_what_cannot_be_exact_is_refused_before_any_change(pool2, pool3, family):
    for pool in (pool2, pool3):
        for out in pool.run(family_task, family):
            assert out["unchanged"], out
            assert "Nothing was changed" in out["refused"] and "cannot step" in out["refused"]
            assert ("LoggingMuon overrides step()" if family == "muon_subclass" else "trust ratio") in out["refused"]


def test_an_unknown_subclass_warns_once_and_steps_slices(pool2, pool3):
    for pool in (pool2, pool3):
        for out in pool.run(family_task, "unknown_subclass"):
            assert out["worst"] < 1e-5
            assert len(out["warnings"]) <= 1  # once per class and process (an earlier task may have warned)
