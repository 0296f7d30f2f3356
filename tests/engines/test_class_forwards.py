"""engines/class_forwards.py: modules whose instance has its own forward, called through their class's forward while
dynamo traces, and put back as they were after."""

import pytest
import torch
from torch import nn

from tensorshard.engines.class_forwards import ClassForward, class_forwards


def _wrapped(scale: float) -> nn.Linear:
    """A Linear whose instance forward is a closure, as a style's `wrap_forward` makes it."""
    layer = nn.Linear(4, 4)
    run = layer.forward  # (the class forward, bound: what the closure calls)

    def forward(x):
        return run(x) * scale

    layer.forward = forward
    return layer


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_wrapped(2.0), nn.ReLU(), _wrapped(3.0), nn.Linear(4, 2))


def test_inside_each_wrapped_module_calls_its_own_forward_through_its_class_and_after_it_is_as_before():
    model = _model()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    expected = model(x)
    forwards = {i: m.__dict__.get("forward") for i, m in enumerate(model)}
    classes = [type(m) for m in model]
    with class_forwards([model]) as changed:
        assert changed == 2  # the two wrapped Linears; the ReLU and the plain Linear have no forward of their own
        for i in (0, 2):
            assert isinstance(model[i], ClassForward) and isinstance(model[i], nn.Linear)
            assert "forward" not in model[i].__dict__ and type(model[i]).__name__ == "Linear"
        assert type(model[1]) is nn.ReLU and type(model[3]) is nn.Linear
        assert type(model[0]) is type(model[2])  # one subclass per class (dynamo guards on it)
        assert torch.equal(model(x), expected)
    assert [type(m) for m in model] == classes
    assert {i: m.__dict__.get("forward") for i, m in enumerate(model)} == forwards
    assert torch.equal(model(x), expected)


def test_everything_is_put_back_after_an_error_and_a_nested_use_changes_nothing_more():
    model = _model()
    forward = model[0].__dict__["forward"]
    with pytest.raises(KeyError):
        with class_forwards([model, model]):  # (a module reached twice is changed once)
            with class_forwards([model]) as inner:
                assert inner == 0
            raise KeyError("inside")
    assert type(model[0]) is nn.Linear and model[0].__dict__["forward"] is forward
    assert "_instance_forward" not in model[0].__dict__


def test_dynamo_traces_the_same_graph_inside_and_compiles_nothing_more_at_a_second_call_inside():
    model = _model()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    graphs = []

    def keep(gm, example_inputs):
        graphs.append([(n.op, str(n.target)) for n in gm.graph.nodes if n.op != "placeholder"])
        return gm.forward

    torch._dynamo.reset()
    try:
        plain = torch.compile(lambda x: model(x), backend=keep, fullgraph=True)(x)
        inside_fn = torch.compile(lambda x: model(x), backend=keep, fullgraph=True)
        with class_forwards([model]):
            inside = inside_fn(x)
            inside_fn(x)  # the same classes: its guards hold, no second graph
    finally:
        torch._dynamo.reset()
    assert torch.equal(plain, inside)
    assert len(graphs) == 2 and graphs[0] == graphs[1]


_translator = getattr(getattr(torch._dynamo, "symbolic_convert", None), "InstructionTranslatorBase", None)


@pytest.mark.skipif(not hasattr(_translator, "step"), reason="this torch's dynamo has no InstructionTranslatorBase.step")
def test_inside_dynamo_does_not_trace_nn_modules_call_machinery_for_a_wrapped_module(monkeypatch):
    """What the change is for: outside, dynamo interprets nn.Module's `_call_impl` for each module with an instance
    forward; inside, it goes straight to the forward (the module doc's 12,600 bytecodes per SmolLM2 shard)."""
    model = _model()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    traced: list[str] = []
    step = _translator.step

    def counting(self):
        traced.append(self.f_code.co_name)
        return step(self)

    monkeypatch.setattr(_translator, "step", counting)
    torch._dynamo.reset()
    try:
        torch.compile(lambda x: model(x), backend="eager", fullgraph=True)(x)
        outside, traced[:] = list(traced), []
        with class_forwards([model]):
            torch.compile(lambda x: model(x), backend="eager", fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    assert "_call_impl" in outside and "_call_impl" not in traced
    assert len(traced) < len(outside)


def test_a_class_python_will_not_subclass_so_is_left_as_it_is():
    class Final(nn.Module, metaclass=type("Ordinary", (type(nn.Module),), {})):  # (a metaclass that subclasses)
        def forward(self, x):
            return x

    class Refusing(type(nn.Module)):
        def __new__(mcs, name, bases, ns, **kw):
            if any(getattr(b, "_done", False) for b in bases):
                raise TypeError("no subclasses")
            return super().__new__(mcs, name, bases, ns)

    class Closed(nn.Module, metaclass=Refusing):
        _done = True

        def forward(self, x):
            return x

    closed, final = Closed(), Final()
    closed.forward = lambda x: x + 1
    final.forward = lambda x: x + 2
    with class_forwards([closed, final]) as changed:
        assert changed == 1 and type(closed) is Closed and "forward" in closed.__dict__
        assert isinstance(final, ClassForward) and final(torch.zeros(1)).item() == 2
        assert closed(torch.zeros(1)).item() == 1
    assert type(final) is Final and final.__dict__["forward"](torch.zeros(1)).item() == 2
