"""engines/graph_inputs.py: a graph's inputs found again by identity among a module's weights and a call's
arguments (keyword and positional), read back in one pass, and the call's output rebuilt; what cannot be found is
refused with the input named. No process group: split weights' local views are covered by the torchrun compile
tests (tests/engines/torchrun/test_torchrun_compile.py, the direct step)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tensorshard.engines.graph_inputs import (
    Argument, CacheTensor, InputReader, Item, NotLocated, SizeInput, Weight, build_output, call_arguments,
    locate_inputs, output_builder, output_fields,
)


def _call():
    """A module, and a call's arguments: a positional tensor, a keyword tensor, a dict of masks, a cache."""
    module = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1), values=torch.ones(1)) for _ in range(2)])
    args = (torch.tensor([[4]]),)
    kwargs = {"mask": {"full": torch.ones(1, 1)}, "cache": cache, "position": torch.tensor([7])}
    return module, args, kwargs


def test_every_kind_of_input_is_found_again_and_read_back_in_the_graphs_order():
    module, args, kwargs = _call()
    arguments = call_arguments(args, kwargs)
    inputs = [kwargs["cache"].layers[1].values, module[0].weight, args[0], 5, kwargs["mask"]["full"],
              kwargs["position"], module[1].bias]
    sources = locate_inputs(module, arguments, inputs, sizes={3})
    assert [type(s) for s in sources] == [CacheTensor, Weight, Argument, SizeInput, Item, Argument, Weight]
    assert sources[2].name == 0 and sources[5].name == "position"  # (a position by its index, a keyword by name)
    read = InputReader(sources)
    assert all(a is b for a, b in zip(read(arguments), [s(arguments) for s in sources], strict=True))
    assert read(arguments)[3] == 0  # (an int input: the caller fills it in)
    # a later call: new arguments, a weight replaced in its module's table, the same cache
    later = call_arguments((torch.tensor([[9]]),), {**kwargs, "position": torch.tensor([8])})
    module[0].weight = nn.Parameter(torch.zeros(2, 3))
    got = read(later)
    assert got[0] is kwargs["cache"].layers[1].values and got[1] is module[0].weight
    assert got[2] is later[0] and got[5] is later["position"]


def test_keyword_only_calls_read_their_keywords_without_a_copy():
    kwargs = {"ids": torch.zeros(1)}
    assert call_arguments((), kwargs) is kwargs


def test_an_input_found_nowhere_is_refused_with_its_index_and_name():
    module, args, kwargs = _call()
    with pytest.raises(NotLocated, match=r"graph input 1 l_stray \(Tensor\) is neither a weight"):
        locate_inputs(module, call_arguments(args, kwargs), [args[0], torch.ones(2)], ["l_ids", "l_stray"])


def test_the_output_is_rebuilt_from_graph_outputs_and_arguments():
    module, args, kwargs = _call()
    arguments = call_arguments(args, kwargs)
    logits = torch.randn(1, 2)
    output = {"logits": logits, "past_key_values": kwargs["cache"]}

    class Output(dict):
        pass

    fields = output_fields(Output(output), (torch.zeros(1), logits), arguments)
    assert fields["logits"] == 1 and fields["past_key_values"].name == "cache"
    new_logits, later = torch.randn(1, 2), call_arguments(args, {**kwargs, "cache": SimpleNamespace(layers=[])})
    rebuilt = build_output(Output, output_builder(fields), (None, new_logits), later)
    assert type(rebuilt) is Output and rebuilt["logits"] is new_logits and rebuilt["past_key_values"] is later["cache"]
    with pytest.raises(NotLocated, match="output field 'logits' is neither a graph output nor an argument"):
        output_fields(Output(output), (torch.zeros(1),), arguments)
    with pytest.raises(NotLocated, match="not a ModelOutput of graph outputs"):
        output_fields(logits, (logits,), arguments)
