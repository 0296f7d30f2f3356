"""benchmarks/suite/scaling_torchrun.py on the tiny model: real torchrun jobs, so the accounting it reports is
checked for shape and sense (no timings are judged here)."""

import importlib.util
import sys

import pytest

from support import ROOT

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _scaling():
    path = ROOT / "benchmarks" / "suite" / "scaling_torchrun.py"
    spec = importlib.util.spec_from_file_location("scaling_torchrun", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scaling_torchrun"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_a_sweep_reports_time_work_collectives_and_python_per_rank():
    scaling = _scaling()
    results = scaling.sweep(scaling.SPECS["tiny"], worlds=[2], kinds=("train", "decode"), rounds=1, unsplit=True)
    plain, two = results
    assert (plain["unsplit"], plain["world"], two["unsplit"], two["world"]) == (True, 1, False, 2)
    assert plain["tokens"] == two["tokens"] and len(two["tokens"]) == scaling.SPECS["tiny"].new_tokens  # greedy
    for kind in ("train", "decode"):
        k = two["kinds"][kind]
        assert k["wall_s"] > 0 and k["cpu_s"] > 0 and len(k["cpu_per_rank_s"]) == 2
        assert len(k["collective_s"]) == 2 and all(0 < c < k["wall_s"] for c in k["collective_s"])
        assert all(p is not None and p >= 0 for p in k["python_s"])
        assert k["vs_unsplit"] > 0 and plain["kinds"][kind]["collectives"] == {}
    # tiny: 2 layers, 2 all-reduces per block each way, the embedding's forward and the head's input backward,
    # the loss from vocabulary slices (2 all-reduces of per-token numbers)
    assert two["kinds"]["train"]["collectives"] == {"all_reduce": 4 + 1 + 2 + 4 + 1}
    # decoding a token: 2 per block and the embedding, then the head's logits gathered
    assert two["kinds"]["decode"]["collectives"] == {"all_reduce": 4 + 1, "all_gather": 1}
    table = scaling.table(results)
    assert table.count("\n") == 1 + 4 and "ms/token" in table
