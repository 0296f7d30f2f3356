"""`tensorshard plan`'s predicted collectives per token against what `tp.count_collectives()` measures on the
split model: a tiny Llama (preset plan) full precision, NF4 and LLM.int8() at 2 and 3 devices, and a custom
MLP (inferred plan). The model runs in eval mode (no ZeRO-3 gathers of the replicated parameters, which the
CLI does not count), one forward and one backward of its output's sum: counts must be equal, per collective."""

import re
import sys
import types

import pytest
import torch

import tensorshard as tp
from tensorshard.cli import main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(180)


def predicted(capsys, spec: str, devices: int, quantize: str | None) -> tuple[dict, dict]:
    args = ["plan", spec, "--devices", str(devices)] + (["--quantize", quantize] if quantize else [])
    assert main(args) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("per token, forward:"))
    forward, _, backward = line.partition("; backward:")
    counts = lambda text: {k: int(n) for n, k in re.findall(r"(\d+) x (\w+)", text)}  # noqa: E731
    return counts(forward), counts(backward)


def measured(model: torch.nn.Module, inputs: dict) -> tuple[dict, dict]:
    with tp.count_collectives() as counted:
        out = model(**inputs)
        (out.logits if hasattr(out, "logits") else out).float().sum().backward()
    drop = lambda c: {k: v for k, v in c.items() if v}  # noqa: E731
    return drop(dict(counted.forward)), drop(dict(counted.backward))


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("quantize", [None, "nf4", "int8"])
def test_predicted_collectives_of_a_llama_equal_the_measured(tmp_path_factory, capsys, devices, quantize):
    if quantize:
        pytest.importorskip("bitsandbytes")
    from support.quantized_models import ALIGNED, load, random_ids, save_llama

    path = save_llama(tmp_path_factory.mktemp("llama"), **ALIGNED)
    expected = predicted(capsys, path, devices, quantize)
    bits = {None: None, "nf4": 4, "int8": 8}[quantize]
    model = tp.tensor_parallel(load(path, bits), ["cpu"] * devices)
    ids = random_ids(torch.Generator().manual_seed(0))
    assert measured(model, {"input_ids": ids}) == expected  # before, quantized: 11 backward all-reduces, 5 measured


def build_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))


@pytest.mark.parametrize("devices", [2, 3])
def test_predicted_collectives_of_an_inferred_plan_equal_the_measured(capsys, devices, monkeypatch):
    models = types.ModuleType("cli_collectives_models")  # what `tensorshard plan module:function` imports
    models.build = build_mlp
    monkeypatch.setitem(sys.modules, models.__name__, models)
    expected = predicted(capsys, f"{models.__name__}:build", devices, None)
    torch.manual_seed(0)
    model = tp.tensor_parallel(build_mlp().eval(), ["cpu"] * devices)
    x = torch.randn(2, 5, 32, requires_grad=True)
    got = measured(lambda **kw: model(kw["x"]), {"x": x})
    assert got == expected and expected[0] == {"all_reduce": 1}
