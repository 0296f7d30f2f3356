"""engines/torchrun/cpp_step.py: which learnt decode graphs are built again with inductor's C++ wrapper, and the
Python wrapper's graph kept where one is not (no process group: the direct step on a small module of one rank).
The C++ path on a real split model is checked in test_torchrun_compile.py (generate's static-cache decoding)."""

from types import SimpleNamespace

import pytest
import torch
from torch import fx, nn

from tensorshard.comm.native import ops as native
from tensorshard.engines.torchrun import cpp_step
from tensorshard.engines.torchrun.direct_step import DirectSteps


@torch.library.custom_op("tensorshard_test::python_double", mutates_args=())
def python_double(x: torch.Tensor) -> torch.Tensor:
    """An operator whose kernel is Python (as comm/dist_ops.py's collectives are)."""
    return x * 2


@python_double.register_fake
def _(x):
    return torch.empty_like(x)


class _Step(nn.Module):
    """A decode-step-like module: a weight, an operator, a dict output (direct_step.py builds it from its fields)."""

    def __init__(self, python_op: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.python_op = python_op

    def forward(self, x):
        y = self.proj(x)
        return {"y": python_double(y) if self.python_op else torch.relu(y)}


def test_only_graphs_of_aten_prims_and_native_collectives_run_without_python():
    def plain(x):
        return torch.ops.aten.relu.default(x) + 1

    assert cpp_step.why_not(fx.symbolic_trace(plain)) is None
    reason = cpp_step.why_not(fx.symbolic_trace(lambda x: torch.ops.tensorshard_test.python_double.default(x)))
    assert "tensorshard_test::python_double" in reason and "not aten's" in reason
    if native.available():  # the native collectives are C++ dispatcher operators: allowed
        def collective(x):
            return torch.ops.tensorshard.native_all_reduce.default(x, 1, 0, "layer")

        assert cpp_step.why_not(fx.symbolic_trace(collective)) is None


def test_no_candidate_for_another_backend_dynamic_shapes_or_a_python_operator():
    gm, x = fx.symbolic_trace(lambda x: torch.relu(x)), torch.ones(2)
    assert cpp_step.candidate((gm, {}), [x], dynamic=False, name="M") == (gm, {})
    assert cpp_step.candidate(None, [x], dynamic=False, name="M") is None  # ("eager", "aot_eager": no inductor graph)
    assert cpp_step.candidate((gm, {}), [x], dynamic=True, name="M") is None  # (an int input: a dynamic size)
    python_op = fx.symbolic_trace(lambda x: torch.ops.tensorshard_test.python_double.default(x))
    assert cpp_step.candidate((python_op, {}), [x], dynamic=False, name="M") is None


def test_the_switch_is_read_at_each_call(monkeypatch):
    assert cpp_step.enabled()
    monkeypatch.setenv(cpp_step.ENV, "0")
    assert not cpp_step.enabled()


def _learn_and_run(model: nn.Module):
    """The module compiled through direct_step's capturing backend (inductor), a call learnt, then a direct call."""
    torch._dynamo.reset()
    state = SimpleNamespace(views=SimpleNamespace(swaps=[]), mesh=SimpleNamespace(device_type="cpu"))
    direct = DirectSteps(model, state)
    config = direct.capturing(SimpleNamespace(backend="inductor", mode=None, options=None, dynamic=False))
    compiled = torch.compile(model, backend=config.backend, dynamic=False)
    x = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        compiled(x)  # compiles
        with direct.watching() as seen:
            out = compiled(x)
        direct.learn("kind", seen, (x,), {}, out)
        later = torch.randn(1, 8, generator=torch.Generator().manual_seed(1))
        got = direct.run("kind", (later,), {})
        expected = model(later)
    return direct.steps["kind"], got, expected


@pytest.mark.slow  # (an inductor compile of a small graph)
@pytest.mark.timeout(300)
def test_a_graph_holding_a_python_operator_keeps_the_python_wrapper_and_still_runs_directly():
    step, got, expected = _learn_and_run(_Step(python_op=True))
    assert step.pending is None and step.cpp is None and step.graph() is step.compiled  # no C++ wrapper to build
    torch.testing.assert_close(got["y"], expected["y"])  # fp32, inductor's fused kernels: a few ulps
