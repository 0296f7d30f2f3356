"""Many split models made one after another in one process (a notebook's session): each decodes on its own compiled
steps, and a split model let go of frees its weights (engines/own_code.py).

Dynamo keeps graphs, guards and its recompile limit per code object. Each split model's compiled steps run on code
of their own, so the 9th model of a process is compiled like the first, and clearing that code's cache when the
model is gone frees what dynamo's tables would otherwise keep. The limit is lowered to 2 here, so that models
sharing one code object would fall back to eager from the 3rd: what is checked is that every model's graphs ran
(the backend counts its graphs and their runs; the stitched path's log and step), not timing. A limit one model
reaches on its own (a new compile per cache length) is said once, at WARNING.
"""

from __future__ import annotations

import copy
import gc
import logging
import weakref

import pytest
import torch
from transformers import CompileConfig

import tensorshard as tp
from tensorshard.engines.inprocess.stitched_decode import STITCHES
from support.hf_configs import tiny_config, tiny_model
from support.helpers import log_messages

pytestmark = pytest.mark.timeout(600)

MODELS = 10
NEW = 5  # new tokens per generate: the prefill, then NEW - 1 compiled decode steps
LIMIT = 2  # dynamo's recompile limit in these tests (8 by default)
STITCHED = 4  # models on the stitched path (an inductor compile each, found in inductor's cache after the first)


@pytest.fixture(autouse=True)
def _low_limit():
    """Models sharing one code object would run eagerly from the 3rd on."""
    with torch._dynamo.config.patch(recompile_limit=LIMIT):
        yield


class Counting:
    """A torch.compile backend (dynamo only) that counts the graphs it is given and their runs."""

    def __init__(self) -> None:
        self.graphs: list[int] = []
        self.runs: list[int] = []  # (appended from the shards' threads: a list's append is atomic)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        self.graphs.append(1)

        def run(*inputs):
            self.runs.append(1)
            return gm.forward(*inputs)

        return run

    def __deepcopy__(self, memo: dict) -> "Counting":  # (a CompileConfig's to_dict deep-copies its backend)
        return self


def _model(i: int):
    """The i-th model of the session: the tiny Llama's shape, or (every third) a wider one; random weights each."""
    config = tiny_config("llama")
    if i % 3 == 2:
        config.hidden_size, config.intermediate_size = 2 * config.hidden_size, 2 * config.intermediate_size
    torch.manual_seed(i)
    return tiny_model("llama", config)


def _ids(length: int = 5) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(0))


def _greedy(model, new: int = NEW, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(_ids(), attention_mask=torch.ones_like(_ids()), max_new_tokens=new, do_sample=False,
                              **kwargs)


def _freed(split) -> weakref.ref:
    """A weak reference to one of `split`'s shard weights, taken before the caller lets go of it."""
    return weakref.ref(split.module_shards[0].get_parameter("model.layers.0.mlp.down_proj.weight"))


@pytest.mark.slow  # (10 split models traced: ~20 s on 2 loaded cores)
def test_every_split_model_of_a_process_runs_its_own_compiled_graphs():
    """The per-shard compiled path (another backend than inductor: no stitching), dynamo only. Two unsplit models
    (two shapes), each split again and again: the 3rd split model would be the first past the limit of a shared
    code object."""
    unsplit = {}  # shape -> (model, its tokens, the eager split step's collectives)
    for shape in (0, 2):
        model = _model(shape)
        with tp.count_collectives() as eager:
            _greedy(tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"]), cache_implementation="static",
                    disable_compile=True)
        unsplit[shape] = model, _greedy(model), eager.counts
    warnings, stop = log_messages("tensorshard", logging.WARNING)
    try:
        for i in range(MODELS):
            model, expected, eager = unsplit[2 if i % 3 == 2 else 0]
            split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
            backend = Counting()
            with tp.count_collectives() as counted:
                out = _greedy(split, cache_implementation="static", compile_config=CompileConfig(backend=backend))
            assert torch.equal(out, expected), i
            # one graph per shard, each run at every decode step: nothing ran eagerly
            assert (len(backend.graphs), len(backend.runs)) == (2, 2 * (NEW - 1)), (i, backend.graphs, backend.runs)
            assert counted.counts == eager and eager["all_reduce"] > 0, i
            weight = _freed(split)
            del split, out
            gc.collect()
            assert weight() is None, f"split model {i}'s weights are still alive after it was deleted"
    finally:
        stop()
    assert not warnings, warnings


@pytest.mark.slow  # (4 split models traced and stitched: ~15 s on 2 loaded cores)
@pytest.mark.skipif(not STITCHES, reason="the shards' steps are stitched from torch 2.13 on")
def test_every_split_model_of_a_process_is_stitched_and_freed():
    """The default fast path on CPU slots (inductor): each model's shards captured and stitched into one graph that
    runs every later token; the same shapes each time, so inductor's cache serves the stitched graph after the
    first model. Before, every split model stitched so stayed alive after `del` (dynamo's cache kept its captured
    graphs, which read its weights)."""
    model = _model(0)
    expected = _greedy(model)
    for i in range(STITCHED):
        split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
        messages, stop = log_messages("tensorshard.engines.inprocess", logging.INFO)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        try:
            out = _greedy(split, cache_implementation="static")
        finally:
            stop()
        assert torch.equal(out, expected), i
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2, (i, messages)  # one per shard
        assert [m for m in messages if "stitched the decode steps" in m], (i, messages)
        assert not [m for m in messages if "not one stitched graph" in m], (i, messages)
        calls = []
        run_modules = split.run_modules
        split.run_modules = lambda *a, **k: calls.append(1) or run_modules(*a, **k)
        assert torch.equal(_greedy(split, cache_implementation="static"), expected), i
        assert len(calls) == 1, (i, calls)  # the prefill; every token ran the stitched graph
        del split.run_modules, run_modules
        weight = _freed(split)
        del split, out
        gc.collect()
        assert weight() is None, f"split model {i}'s weights are still alive after it was deleted"


def test_a_split_model_that_reaches_the_recompile_limit_on_its_own_says_so_once():
    """Each cache length compiles a graph per shard (static shapes; no stitching here); at a limit of 2 the third
    length runs eagerly, with the same tokens, and the engine says so once, with the fix."""
    model = tiny_model("llama")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    backend = Counting()
    config = CompileConfig(backend=backend, dynamic=False)  # (one config: the same compiled steps for every call)
    warnings, stop = log_messages("tensorshard", logging.WARNING)
    try:
        for new in (3, 4, 5, 6):  # (each a cache length of its own)
            out = _greedy(split, new, cache_implementation="static", compile_config=config)
            assert torch.equal(out, _greedy(model, new)), new
    finally:
        stop()
    # a graph per length and shard until the limit; then dynamo runs the step eagerly (on shard 0 at least: dynamo
    # does not count shard 1's entries alike)
    assert 2 * LIMIT <= len(backend.graphs) < 2 * 4, backend.graphs
    assert len(warnings) == 1 and "recompile limit" in warnings[0] and "StaticCache" in warnings[0], warnings
