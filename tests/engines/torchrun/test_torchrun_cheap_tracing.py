"""engines/cheap_tracing.py under torchrun (2 gloo ranks on CPU): the compiled decode step dynamo traces inside the
context is the same graph as without it, traced in fewer bytecodes, and gives the unsplit model's tokens."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import tensorshard as tp
from support import tiny_llama
from support.harness import world_mesh
from support.hf_configs import tiny_model

pytestmark = pytest.mark.timeout(600)

_BACKEND = "tensorshard_test_keep_graphs"
_graphs: list = []


def _nodes(gm) -> list[tuple]:
    """The graph as its operators in order (as tests/engines/test_cheap_tracing.py compares them)."""
    def kind(a):
        return a.op if isinstance(a, torch.fx.Node) else type(a).__name__

    return [(n.op, n.name if n.op == "placeholder" else str(n.target),
             tuple(torch.fx.node.map_aggregate(n.args, kind)), sorted(n.kwargs)) for n in gm.graph.nodes]


def _keep(gm, example_inputs, **settings):  # (the engine passes its mode and options on)
    _graphs.append(_nodes(gm))
    return gm.forward


def cheap_task(family: str) -> dict:
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase as translator
    from transformers import CompileConfig

    from tensorshard.engines.torchrun import decoding

    if _BACKEND not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_keep, name=_BACKEND)
    # (the torchrun tests' tiny Llama, 4 heads over 2 KV heads, with its preset; Mistral's 8 heads in 2 KV groups:
    # both split evenly over 2 ranks, so the split model's greedy tokens are the unsplit model's)
    ref, plan = (tiny_llama.build(), tiny_llama.plan()) if family == "llama" else (tiny_model(family), None)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(4))
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = ref.generate(ids, attention_mask=torch.ones_like(ids), **settings).tolist()
    counted = [0]
    step = translator.step

    def counting(self):
        counted[0] += 1
        return step(self)

    real = decoding.cheap_tracing
    out = {}
    translator.step = counting
    try:
        for cheap in (False, True):
            torch._dynamo.reset()
            _graphs.clear()
            counted[0] = 0
            decoding.cheap_tracing = real if cheap else (lambda roots: contextlib.nullcontext())
            model = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=plan)
            with torch.no_grad():
                tokens = model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation="static",
                                        compile_config=CompileConfig(backend=_BACKEND), **settings).tolist()
            out[cheap] = {"graphs": list(_graphs), "traced": counted[0], "same": tokens == expected}
    finally:
        translator.step = step
        decoding.cheap_tracing = real
        torch._dynamo.reset()
    return {"graphs": len(out[True]["graphs"]), "equal": out[True]["graphs"] == out[False]["graphs"],
            "same": (out[False]["same"], out[True]["same"]), "traced": (out[False]["traced"], out[True]["traced"])}


@pytest.mark.parametrize("family", ["llama", pytest.param("mistral", marks=pytest.mark.slow)])
def test_the_traced_step_is_the_same_graph_in_fewer_bytecodes(pool2, family):
    for out in pool2.run(cheap_task, family, timeout=400):
        assert out["graphs"] >= 1 and out["equal"], out
        assert out["same"] == (True, True), out
        without, inside = out["traced"]
        assert inside < 0.8 * without, out  # (SmolLM2's shape: 76,600 -> 43,300 per rank)
