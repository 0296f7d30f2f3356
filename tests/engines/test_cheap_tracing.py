"""engines/cheap_tracing.py: while dynamo traces a split model's decode step, configs read as plain objects,
transformers' forward wrappers called past, the styles' shorter forwards: fewer bytecodes traced, the same graphs,
the same tokens, and every module as it was after."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import tensorshard as tp
from tensorshard.engines.cheap_tracing import cheap_tracing
from tensorshard.engines.class_forwards import ClassForward, unwrapped_class
from tensorshard.engines.config_snapshots import PlainConfig
from tensorshard.engines.inprocess import stitched_decode
from tensorshard.engines.inprocess.stitched_decode import STITCHES
from support.hf_configs import FAMILIES, tiny_model

pytestmark = pytest.mark.timeout(600)

_translator = getattr(getattr(torch._dynamo, "symbolic_convert", None), "InstructionTranslatorBase", None)


def _state(split) -> list:
    """Every module's class, forward and config: what the context changes and must put back."""
    return [(type(m), m.__dict__.get("forward"), m.__dict__.get("config"))
            for shard in split.module_shards for m in shard.modules()]


def test_inside_configs_read_plainly_wrappers_are_skipped_and_after_everything_is_as_before():
    model = tp.tensor_parallel(tiny_model("llama"), ["cpu", "cpu"])
    before = _state(model)
    config = model.module_shards[0].model.config
    with pytest.raises(KeyError), torch.no_grad():  # (a style's shorter forward is for calls without gradients)
        with cheap_tracing(model.module_shards):
            shard = model.module_shards[0]
            plain = shard.model.config
            assert isinstance(plain, PlainConfig) and type(plain).__name__ == type(config).__name__
            assert plain.to_dict() == config.to_dict() and plain.hidden_size == config.hidden_size
            assert type(plain).__getattribute__ is object.__getattribute__
            layer = shard.model.layers[0]
            assert type(layer) is unwrapped_class(type(layer).__mro__[1])  # (past deprecate_kwarg and checkpointing)
            assert type(layer.self_attn).__mro__[1].__name__ == "LlamaAttention"
            q = layer.self_attn.q_proj  # column: its class forward without gradients
            assert "forward" not in q.__dict__ and type(q) is nn.Linear
            assert isinstance(layer.self_attn.o_proj, ClassForward)  # row: its style's shorter forward
            raise KeyError("inside")
    assert _state(model) == before


def test_a_write_to_a_snapshot_reaches_the_config():
    model = tiny_model("llama")
    with cheap_tracing([model]):
        model.model.config.use_cache = False
    assert model.config.use_cache is False and not isinstance(model.config, PlainConfig)


def _nodes(graph) -> list[tuple]:
    """A captured graph as its operators in order: each node's kind, target and arguments' kinds (the names of
    intermediate values differ: a style's `y` is the class forward's `linear`; a collective's group number too,
    being another split model's), the inputs by name."""
    def kind(a):
        return a.op if isinstance(a, torch.fx.Node) else type(a).__name__

    return [(n.op, n.name if n.op == "placeholder" else str(n.target),
             tuple(torch.fx.node.map_aggregate(n.args, kind)), sorted(n.kwargs)) for n in graph.graph.nodes]


def _generate(split, ids):
    with torch.no_grad():
        return split.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                              cache_implementation="static")


@pytest.mark.skipif(not STITCHES or not hasattr(_translator, "step"), reason="the shards' steps are captured from torch 2.13 on")
@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_the_captured_graphs_are_the_same_with_far_fewer_bytecodes_and_the_tokens_the_unsplit_models(family, monkeypatch):
    monkeypatch.setenv("TENSORSHARD_CAPTURE_CACHE", "0")  # (a trace each time, not the kept captures)
    model = tiny_model(family)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    graphs: list[list[str]] = []
    stitch = stitched_decode.stitch
    monkeypatch.setattr(stitched_decode, "stitch",
                        lambda captures, *a: graphs.append([_nodes(c.graph) for c in captures]) or stitch(captures, *a))
    counted = [0]
    step = _translator.step

    def counting(self):
        counted[0] += 1
        return step(self)

    monkeypatch.setattr(_translator, "step", counting)
    traced = {}
    for cheap in (False, True):
        with monkeypatch.context() as patch:
            if not cheap:
                patch.setattr(stitched_decode, "cheap_tracing", lambda *a: contextlib.nullcontext())
            split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
            counted[0] = 0
            torch._dynamo.reset()
            assert torch.equal(_generate(split, ids), expected), (family, cheap)
            traced[cheap] = counted[0]
    assert len(graphs) == 2 and graphs[0] == graphs[1], family
    # SmolLM2's shape: 70,900 -> ~45,000 per shard; a tiny model has 2 layers, the config reads and wrappers remain
    assert traced[True] < 0.8 * traced[False], traced


def test_a_deprecated_keyword_is_still_renamed_inside_and_out_of_a_trace():
    from transformers.utils.deprecation import deprecate_kwarg

    class Old(nn.Module):
        @deprecate_kwarg("past", "99.0", new_name="cache")
        def forward(self, x, cache=None):
            return x if cache is None else x + cache

    module, one = Old(), torch.ones(1)
    traced = torch.compile(lambda **kw: module(one, **kw), backend="eager", fullgraph=True)
    torch._dynamo.reset()
    try:
        with cheap_tracing([module]):
            assert type(module) is not Old and isinstance(module, Old) and type(module).__name__ == "Old"
            assert module(one, past=one).item() == 2 and module(one, cache=one).item() == 2 and module(one).item() == 1
            assert traced(past=one).item() == 2 and traced(cache=one).item() == 2  # (renamed by the subclass's forward)
    finally:
        torch._dynamo.reset()
    assert type(module) is Old


_QUICK = {"t5", "gemma2", "gpt2", "falcon"}  # (an encoder-decoder copying its config, sliding windows, Conv1D, MQA)


@pytest.mark.parametrize("family", [f if f in _QUICK else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_every_familys_unsplit_graph_is_the_same_inside(family):
    """What the context changes beyond the styles (configs, transformers' wrappers, module lists) applies to any
    model: an unsplit model's forward traced inside is the graph traced outside, with the same logits."""
    model = tiny_model(family)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    extra = {"decoder_input_ids": ids} if family == "t5" else {}
    seen = {}
    for cheap in (False, True):
        graphs = []
        torch._dynamo.reset()
        try:
            with torch.no_grad(), (cheap_tracing([model]) if cheap else contextlib.nullcontext()):
                out = torch.compile(lambda: model(ids, **extra), backend=lambda gm, _: graphs.append(_nodes(gm)) or gm.forward)()
        finally:
            torch._dynamo.reset()
        seen[cheap] = (graphs, out.logits if hasattr(out, "logits") else out.last_hidden_state)
    assert seen[True][0] and seen[True][0] == seen[False][0], family
    assert torch.equal(seen[True][1], seen[False][1]), family
