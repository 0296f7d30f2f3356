"""What integrations/peft registers with the layers below it, and that they call it: the styles' names (a plan
JSON naming a LoRA style loads wherever tensorshard is imported), the plan rewriter (plans/rewriters.py) and the
engines' adopters of modules added after splitting (engines/late_modules.py). PEFT itself is not imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import tensorshard as tp
from support.harness import child_env
from tensorshard.engines import late_modules
from tensorshard.integrations.peft.ia3_styles import Ia3Parallel, Ia3Scale
from tensorshard.integrations.peft.lora_styles import LoraFactor, LoraMagnitude, LoraParallel
from tensorshard.plans import resolve_plan, rewriters


@pytest.mark.timeout(300)
def test_a_fresh_process_reads_a_plan_naming_adapter_styles_without_importing_peft():
    plan = tp.Plan({
        "q": LoraParallel(base="column"),
        "q.lora_A.*": LoraFactor(split="whole_input"),
        "q.lora_B.*": LoraFactor(split="output", blocks=("q",)),
        "q.lora_magnitude_vector.*": LoraMagnitude(split="output"),
        "o": Ia3Parallel(base="row"),
        "o.ia3_l": Ia3Scale(split="input"),
    })
    # only the plan's own module is imported: its package's __init__ (import tensorshard) registers the styles
    code = textwrap.dedent(f"""
        import json, sys
        from tensorshard.plans.plan import Plan
        plan = Plan.from_json({plan.to_json()!r})
        print(json.dumps({{"plan": plan.to_json(), "peft": "peft" in sys.modules}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert tp.Plan.from_json(seen["plan"]) == plan
    assert seen["peft"] is False


class _Wrapped(nn.Module):
    """Stands in for a library's wrapper around a layer (the rewriter below recognises it by type)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)


def test_resolve_plan_runs_a_registered_rewriter_after_its_refusal(monkeypatch):
    calls = []

    def refuse(module):
        calls.append("refuse")
        if getattr(module, "unsplittable", False):
            raise NotImplementedError("no plan splits this")

    def rewrite(module, plan):
        calls.append("rewrite")
        return tp.Plan({f"{name}.inner": style for name, style in plan.items()})

    applies = lambda module: any(isinstance(m, _Wrapped) for m in module.modules())  # noqa: E731
    monkeypatch.setitem(rewriters._rewriters, "test wrappers",
                        rewriters.PlanRewriter("test wrappers", applies=applies, rewrite=rewrite, refuse=refuse))
    model = nn.Sequential(_Wrapped())
    resolved = resolve_plan(model, {"0": tp.ColwiseParallel()}, 2, check=False)
    assert calls == ["refuse", "rewrite"]
    assert list(resolved) == ["0.inner"]
    plain = nn.Sequential(nn.Linear(8, 8))
    assert list(resolve_plan(plain, {"0": tp.ColwiseParallel()}, 2, check=False)) == ["0"]  # does not apply
    model.unsplittable = True
    with pytest.raises(NotImplementedError, match="no plan splits this"):
        resolve_plan(model, {"0": tp.ColwiseParallel()}, 2, check=False)


def test_peft_registers_its_rewriter_and_both_engines_adopters():
    from tensorshard.integrations.peft import adapter_plan, late_in_process, late_torchrun

    assert rewriters._rewriters["PEFT adapters"].rewrite is adapter_plan.adapt_plan
    assert late_modules._adopters == {"inprocess": late_in_process.adopt_in_process,
                                      "torchrun": late_torchrun.adopt_under_torchrun}


def test_the_in_process_engine_asks_the_registered_adopter_before_each_call_and_state_dict(monkeypatch, gen):
    seen = []
    monkeypatch.setitem(late_modules._adopters, "inprocess", seen.append)
    split = tp.tensor_parallel(nn.Sequential(nn.Linear(8, 8)), ["cpu", "cpu"])
    split(torch.randn(2, 8, generator=gen))
    split.state_dict()
    assert seen == [split, split]


def test_an_adopter_for_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="engine='threads'.*'inprocess' or 'torchrun'"):
        late_modules.register_adopter("threads", lambda model: None)
