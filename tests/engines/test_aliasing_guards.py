"""engines/aliasing_guards.py: dynamo's object-aliasing guards built in C++ for one call, the switch restored."""

import pytest
import torch

from tensorshard.engines.aliasing_guards import aliasing_guards_in_cpp

SWITCH = "use_lamba_guard_for_object_aliasing"
needs_switch = pytest.mark.skipif(not hasattr(torch._dynamo.config, SWITCH), reason="this torch has no such switch")


@needs_switch
def test_the_switch_is_off_inside_and_restored_after_even_after_an_error():
    before = getattr(torch._dynamo.config, SWITCH)
    with aliasing_guards_in_cpp():
        assert getattr(torch._dynamo.config, SWITCH) is False
    assert getattr(torch._dynamo.config, SWITCH) == before
    with pytest.raises(KeyError):
        with aliasing_guards_in_cpp():
            raise KeyError("inside")
    assert getattr(torch._dynamo.config, SWITCH) == before


@needs_switch
def test_a_function_compiled_inside_still_guards_that_two_paths_reach_one_object():
    class Box:
        def __init__(self, a, b):
            self.a, self.b = a, b

    shared = [torch.ones(3)]
    other = [torch.ones(3)]

    def f(box):
        return box.a[0] + box.b[0]

    compiled = torch.compile(f, backend="eager")
    counts = torch._dynamo.utils.counters["stats"]
    with aliasing_guards_in_cpp():
        torch._dynamo.reset()
        compiled(Box(shared, shared))  # a and b are one list: guarded as such
        first = counts["unique_graphs"]
        compiled(Box(shared, shared))  # the same aliasing: no new graph
        same = counts["unique_graphs"]
        compiled(Box(shared, other))  # two lists now: the aliasing guard fails, dynamo compiles again
        again = counts["unique_graphs"]
    torch._dynamo.reset()
    assert same == first and again == first + 1
