"""Static KV caches and the compiled decoding path of split transformers models, in one process.

`generate(..., cache_implementation="static")` on a split model gives the unsplit model's greedy tokens, with every
device's cache holding its own heads; with compiling allowed (the default) every shard's decode step is compiled
once and replayed (integrations/transformers/fast_decode.py), with the same tokens and the same collectives per
token. Compiling is slow on 2 cores, so the compiled cases use the tiniest models and few tokens.
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading

import pytest
import torch
from transformers import CompileConfig, StaticCache

import tensorshard as tp
from tensorshard.engines.class_forwards import ClassForward
from tensorshard.engines.inprocess import stitched_decode
from tensorshard.engines.inprocess.stitched_decode import STITCHES
from tensorshard.integrations.transformers.fast_decode import compiled_call
from tensorshard.integrations.transformers.cache import rank_caches
from support.hf_configs import tiny_config, tiny_model
from support.helpers import log_messages

pytestmark = pytest.mark.timeout(600)

# Before torch 2.13 the fast path keeps one compiled graph per shard (stitched_decode.py): those tests skip there.
needs_stitching = pytest.mark.skipif(not STITCHES, reason="the shards' steps are stitched from torch 2.13 on")

FAMILIES = ["llama", "gemma2", "gpt2", "mixtral", "falcon", "t5"]  # GQA, sliding window, fused qkv, MoE, MQA, enc-dec


def _ids(batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(0))


def _greedy(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, **kwargs)


def _cache_keyword(model) -> str:
    """The name of a cache passed in: `cache` where the model's forward takes it (transformers 5.24), else
    `past_key_values` (generate() passes it on under the forward's name)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_gives_the_unsplit_tokens(family, devices):
    model = tiny_model(family)
    ids = _ids()
    expected = _greedy(model, ids)  # the dynamic cache, unsplit
    assert torch.equal(_greedy(model, ids, cache_implementation="static", disable_compile=True), expected)
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * devices)
    assert torch.equal(_greedy(split, ids, cache_implementation="static", disable_compile=True), expected)
    assert not split.__dict__.get("_tensorshard_compiled_steps"), "disable_compile=True compiled nonetheless"


def test_a_static_cache_passed_in_holds_each_devices_heads():
    model = tiny_model("llama")  # 9 heads in 3 KV groups: 2 KV heads on the first device, 1 on the second
    ids = _ids()
    expected = _greedy(model, ids)
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    cache = StaticCache(config=model.config, max_cache_len=16)
    out = _greedy(split, ids, disable_compile=True, **{_cache_keyword(split): cache})
    assert torch.equal(out, expected)
    heads = [own.layers[0].keys.shape[1] for own in rank_caches(cache)]
    assert heads == [2, 1]


def test_a_static_cache_the_unsplit_model_used_and_reset_is_reallocated_per_device():
    """reset() zeroes a static cache but keeps its tensors, sized for all 3 KV heads (transformers 5.0's generate()
    reuses one so, kept on the model): each device allocates its own heads' instead."""
    model = tiny_model("llama")
    ids = _ids()
    expected = _greedy(model, ids)
    cache = StaticCache(config=model.config, max_cache_len=16)
    _greedy(model, ids, disable_compile=True, **{_cache_keyword(model): cache})
    cache.reset()
    assert cache.layers[0].keys.shape[1] == 3 and cache.get_seq_length() == 0
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    out = _greedy(split, ids, disable_compile=True, **{_cache_keyword(split): cache})
    assert torch.equal(out, expected)
    assert [own.layers[0].keys.shape[1] for own in rank_caches(cache)] == [2, 1]


def _logged(run):
    """`run()`'s result and the messages the in-process engine logged meanwhile (INFO and above)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("tensorshard.engines.inprocess")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return run(), [r.getMessage() for r in records]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture(scope="module")
def compiled_llama():
    """A tiny Llama split over 2 CPU slots that decoded once on the fast path (inductor), and the log."""
    model = tiny_model("llama")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    out, messages = _logged(lambda: _greedy(split, _ids(), cache_implementation="static"))
    return model, split, out, messages


def test_compiled_decoding_gives_the_unsplit_tokens(compiled_llama):
    """On CPU slots the shards' steps are stitched into one graph (after two tokens run per shard), logged once."""
    model, split, out, messages = compiled_llama
    assert torch.equal(out, _greedy(model, _ids()))
    if not STITCHES:
        assert len([m for m in messages if "compiled the decode step" in m]) == 1, messages
        return
    stitched = [m for m in messages if "stitched the decode steps" in m]
    assert len(stitched) == 1 and "2 shards" in stitched[0], messages
    assert "inductor's cache, 1 graph: 1 " in stitched[0], stitched  # (found, or compiled anew: engines/inductor_cache.py)
    assert not [m for m in messages if "compiled the decode step" in m or "not one stitched graph" in m], messages


@needs_stitching
def test_the_capture_leaves_every_split_layer_with_its_own_class_and_forward(compiled_llama):
    """The capturing calls trace each split layer through a class forward (engines/class_forwards.py); after them
    every layer is again of its own class with its style's forward, and a later eager call gives the same tokens."""
    model, split, _, _ = compiled_llama
    modules = [m for shard in split.module_shards for m in shard.modules()]
    assert not [m for m in modules if isinstance(m, ClassForward) or "_instance_forward" in m.__dict__]
    assert sum(callable(m.__dict__.get("forward")) for m in modules) >= 2 * 7  # (q, k, v, o, gate, up, down per shard)
    assert torch.equal(_greedy(split, _ids()), _greedy(model, _ids()))


@needs_stitching
def test_stitched_decoding_runs_no_shard_thread_per_token(compiled_llama):
    """Once stitched, a generate calls the shards' threads for its prefill only: every token is one graph run from
    the calling thread."""
    model, split, _, _ = compiled_llama
    calls = []
    run_modules = split.run_modules
    split.run_modules = lambda *a, **k: calls.append(1) or run_modules(*a, **k)
    try:
        assert torch.equal(_greedy(split, _ids(), cache_implementation="static"), _greedy(model, _ids()))
    finally:
        del split.run_modules
    assert len(calls) == 1, f"{len(calls)} calls through the shards' threads (the prefill's only expected)"


@needs_stitching
def test_a_stitched_step_is_not_reused_for_a_call_with_other_flags(compiled_llama):
    """A stitched graph has no guards: a call of the same shapes asking for more (``output_hidden_states``, a flag
    dynamo would guard on) is another kind of call, not the stitched step of the first (it gets the unsplit model's
    hidden states; a tuple of them is an output field the stitcher does not map, so that kind runs per shard)."""
    model, split, _, _ = compiled_llama
    ask = dict(output_hidden_states=True, return_dict_in_generate=True)
    out, messages = _logged(lambda: _greedy(split, _ids(), cache_implementation="static", **ask))
    expected = _greedy(model, _ids(), **ask)
    assert torch.equal(out.sequences, expected.sequences)
    assert any("not one stitched graph" in m and "hidden_states" in m for m in messages), messages
    for got, want in zip(out.hidden_states[-1], expected.hidden_states[-1], strict=True):  # the last token's layers
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_stitching
def test_a_call_under_autocast_is_stitched_on_its_own(compiled_llama):
    """Autocast changes what every matmul computes, and a stitched graph has no guard for it: a call under
    ``torch.autocast("cpu", torch.bfloat16)`` is another kind, stitched on its own, whose logits are the eager split
    model's under the same autocast (within bfloat16's rounding); the float32 kind keeps its stitched step."""
    model, split, _, _ = compiled_llama
    ask = dict(output_logits=True, return_dict_in_generate=True, cache_implementation="static")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, messages = _logged(lambda: _greedy(split, _ids(), **ask))
        eager = _greedy(split, _ids(), disable_compile=True, **ask)
    assert any("stitched the decode steps" in m for m in messages), messages
    assert not any("not one stitched graph" in m for m in messages), messages
    for got, want in zip(fast.logits, eager.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)  # bfloat16 matmuls, fused or not
    plain, messages = _logged(lambda: _greedy(split, _ids(), **ask))
    assert torch.equal(plain.sequences, _greedy(model, _ids()))
    assert not any("compiled" in m or "not one stitched graph" in m for m in messages), messages


def test_compiled_decoding_reuses_its_graphs(compiled_llama):
    """A second generate of the same shapes compiles nothing: no new dynamo frame, the same steps object."""
    model, split, _, _ = compiled_llama
    steps = dict(split.__dict__["_tensorshard_compiled_steps"])
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(_greedy(split, _ids(), cache_implementation="static"), _greedy(model, _ids()))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert split.__dict__["_tensorshard_compiled_steps"] == steps


def test_compiled_decoding_runs_the_collectives_of_the_eager_step(compiled_llama):
    """Each compiled token runs the eager token's collectives (2 per block + the embedding's + the head's), counted
    as ever: they are operators inside the graphs that call the same rendezvous."""
    _, split, _, _ = compiled_llama
    with tp.count_collectives() as eager:
        _greedy(split, _ids(), cache_implementation="static", disable_compile=True)
    with tp.count_collectives() as compiled:
        _greedy(split, _ids(), cache_implementation="static")
    assert compiled.counts == eager.counts and eager.counts["all_reduce"] > 0


@needs_stitching
def test_stitched_decoding_with_uneven_heads_over_3_devices():
    """8 heads in 4 KV groups over 3 devices (2, 1, 1 KV heads): the stitched graph gives the unsplit tokens."""
    config = tiny_config("llama")
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim = 64, 8, 4, 8
    model = tiny_model("llama", config)
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 3)
    out, messages = _logged(lambda: _greedy(split, _ids(), cache_implementation="static"))
    assert torch.equal(out, _greedy(model, _ids()))
    assert any("stitched the decode steps" in m and "3 shards" in m for m in messages), messages


@needs_stitching
def test_stitched_decoding_gives_the_unsplit_logits():
    """Falcon (parallel attention and MLP) adds the attention's all-reduced output into the MLP's in place: the
    stitched graph gives each shard its own copy of a collective's result, so the logits of every token stay within
    float32 rounding of the unsplit model's (tokens alone would not show a wrong sum on a tiny random model)."""
    model = tiny_model("falcon")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    out, messages = _logged(lambda: _greedy(split, _ids(), cache_implementation="static", output_logits=True, return_dict_in_generate=True))
    expected = _greedy(model, _ids(), output_logits=True, return_dict_in_generate=True)
    assert any("stitched the decode steps" in m for m in messages), messages
    assert torch.equal(out.sequences, expected.sequences)
    for got, want in zip(out.logits, expected.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the sums' order differs from the unsplit matmul's


@needs_stitching
def test_a_stitched_step_is_dropped_when_the_split_model_gains_a_module(monkeypatch):
    """The stitched graph skips dynamo's guards: a registration on the split model's modules since the stitch (what
    a PEFT adapter added late makes, registrations.py; here its count moved by hand) drops it, logged, and the
    per-shard graphs, whose guards see any change, decode instead."""
    from tensorshard.engines.inprocess import stitched_decode

    model = tiny_model("llama")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    assert torch.equal(_greedy(split, _ids(), cache_implementation="static"), _greedy(model, _ids()))  # stitched
    counted = stitched_decode.registrations()
    monkeypatch.setattr(stitched_decode, "registrations", lambda: counted + 1)
    out, messages = _logged(lambda: _greedy(split, _ids(), cache_implementation="static"))
    assert torch.equal(out, _greedy(model, _ids()))
    assert any("registered on a split model since the step was stitched" in m for m in messages), messages
    assert any("compiled the decode step" in m for m in messages), messages


@needs_stitching
def test_a_step_that_cannot_be_stitched_runs_per_shard_and_says_why():
    """A graph break in every shard (a hook dynamo cannot trace) leaves two graphs per shard: not stitched, logged
    with the reason, and the per-shard compiled path gives the unsplit tokens."""
    model = tiny_model("llama")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    for shard in split.module_shards:
        shard.model.layers[0].register_forward_hook(lambda module, args, out: torch._dynamo.graph_break())
    out, messages = _logged(lambda: _greedy(split, _ids(), cache_implementation="static"))
    assert torch.equal(out, _greedy(model, _ids()))
    refused = [m for m in messages if "not one stitched graph" in m]
    assert len(refused) == 1 and "2 graphs" in refused[0], messages
    assert any("compiled the decode step" in m for m in messages), messages


def test_the_dynamic_cache_is_not_compiled():
    model = tiny_model("gpt2")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    assert torch.equal(_greedy(split, _ids()), _greedy(model, _ids()))
    assert not split.__dict__.get("_tensorshard_compiled_steps")


def test_compiled_decoding_of_a_split_peft_model():
    """A PeftModel split with its LoRA adapter: generate reaches the split transformers model inside, whose shards
    (each wrapped by PEFT's layers) compile as any other (AOT autograd's tracing: inductor left out for time)."""
    import peft

    model = peft.get_peft_model(
        tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    ids = _ids()
    compiled = _greedy(split, ids, cache_implementation="static", compile_config=CompileConfig(backend="aot_eager"))
    assert torch.equal(compiled, _greedy(model, ids))


@needs_stitching
def test_a_stitched_step_follows_the_active_adapter(monkeypatch):
    """A stitched graph has no guards: switching a split PeftModel's adapter (set_adapter) after the step was
    stitched must decode with the new adapter, as the unsplit model does (it used to replay the old one's graph).
    The stitched graph runs as the FX graph it is, not compiled by inductor (for time: what is tested is which
    step a call takes)."""
    import peft

    from tensorshard.engines.inprocess import stitched_step

    monkeypatch.setattr(stitched_step, "inductor_compile", lambda gm, inputs, patches=None: gm)

    lora = dict(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(**lora), adapter_name="a")
    model.add_adapter("b", peft.LoraConfig(**lora))
    model.eval()
    ids = _ids()
    expected = {}
    for name in ("a", "b"):
        model.set_adapter(name)
        expected[name] = _greedy(model, ids)
    assert not torch.equal(expected["a"], expected["b"])
    model.set_adapter("a")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    split.eval()
    steps = compiled_call(split.get_base_model(), None)
    for name in ("a", "b", "a"):
        split.set_adapter(name)
        assert torch.equal(_greedy(split, ids, cache_implementation="static"), expected[name]), name
    assert steps.stitcher.steps, "the steps were stitched"  # (each adapter its own kind of call)
    enabled = steps.settings()
    with split.disable_adapter():  # another setting of the LoRA layers: another kind, so another stitched step
        assert steps.settings() != enabled
    assert steps.settings() == enabled


def _meeting(run, world: int, threads: list[set[int]], skip_first: bool = False):
    """`run(rank, ...)` made to wait, inside the shard's step, until all `world` shards are inside theirs: a call
    whose shards run one after another breaks the barrier (BrokenBarrierError: the call fails). Each rank's threads
    are added to `threads[rank]`. `skip_first`: a rank's first call (which compiles, one shard at a time) passes."""
    barrier = threading.Barrier(world, timeout=20)
    calls = [0] * world

    def step(rank, *args, **kwargs):
        calls[rank] += 1
        if calls[rank] > 1 or not skip_first:
            threads[rank].add(threading.get_ident())
            barrier.wait()  # every shard's step is in flight here at once
        return run(rank, *args, **kwargs)

    return step


@needs_stitching
def test_heavy_steps_run_every_shard_at_the_same_time_on_its_own_thread(monkeypatch):
    """A step that reads more weights between two collectives than `PARALLEL_BYTES` (here every step: the bound
    set to 0) is not stitched: each shard's compiled graph runs on its own thread while the others run theirs
    (every token's steps meet inside themselves, which shards run one after another never do), with the native
    collectives, logged, with the unsplit tokens and the eager step's collectives. An even split (8 heads over 4
    KV heads): with the native collectives both shards run one compiled graph (C++ wrapper), each its own rank."""
    from tensorshard.comm.native import ops as native
    from tensorshard.engines.inprocess.parallel_step import ParallelStep

    monkeypatch.setattr(stitched_decode, "PARALLEL_BYTES", 0)
    threads: list[set[int]] = [set(), set()]
    graph = ParallelStep.graph  # (each shard's compiled graph, called in its thread: the step's own, or the engine's)
    monkeypatch.setattr(ParallelStep, "graph", lambda self, rank, inputs: meet(rank, self, inputs))
    meet = _meeting(lambda rank, self, inputs: graph(self, rank, inputs), 2, threads)
    config = tiny_config("llama")
    config.num_attention_heads, config.num_key_value_heads = 8, 4  # (head_dim stays the config's 8)
    model = tiny_model("llama", config)
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    with tp.count_collectives() as compiled:
        out, messages = _logged(lambda: _greedy(split, _ids(), cache_implementation="static"))
    assert torch.equal(out, _greedy(model, _ids()))
    ran = [m for m in messages if "on its own thread at the same time" in m]
    assert len(ran) == 1 and ("native collectives" if native.available() else "Python collectives") in ran[0], messages
    if native.available():
        assert "(C++ wrapper; 1 of them sharing another's graph; inductor's cache, 1 graph: 1 " in ran[0], ran  # one compile
    assert not [m for m in messages if "stitched the decode steps" in m or "compiled the decode step of" in m], messages
    assert all(len(t) >= 1 for t in threads) and not threads[0] & threads[1], threads  # each shard on its own thread
    steps = [step for s in split.__dict__["_tensorshard_compiled_steps"].values() for step in s.stitcher.steps.values()]
    # (all its collectives native: the step's own threads run the shards, not the engine's call: step_threads.py)
    assert len(steps) == 1 and (steps[0].threads is not None) == native.available(), steps
    with tp.count_collectives() as eager:
        _greedy(split, _ids(), cache_implementation="static", disable_compile=True)
    assert compiled.counts == eager.counts and eager.counts["all_reduce"] > 0

    # A shard failing in its step: shard 0, waiting in a native collective, raises at once (the native group is
    # aborted), the call names the failure, the step is dropped (logged) and the model still decodes.
    def fail(self, rank, inputs):
        if rank == 1:
            raise RuntimeError("shard 1 broke")
        return graph(self, rank, inputs)

    monkeypatch.setattr(ParallelStep, "graph", fail)
    with pytest.raises(Exception, match="shard 1 broke"):
        _logged(lambda: _greedy(split, _ids(), cache_implementation="static"))
    assert stitched_decode.ParallelStep is ParallelStep and not [
        s for s in split.__dict__["_tensorshard_compiled_steps"].values() if s.stitcher and s.stitcher.steps
    ]
    assert torch.equal(_greedy(split, _ids(), cache_implementation="static", disable_compile=True), _greedy(model, _ids()))


def test_compiled_decoding_over_3_devices_one_shard_at_a_time_then_all_together():
    """9 heads over 3 devices (3 each; AOT autograd's tracing of the collectives, inductor left out for time): the
    compiled steps give the unsplit tokens one shard at a time (the default without stitching), then, the same
    graphs, with `run_shards_together()`: every token's three steps are in flight at once, each on its own thread."""
    model = tiny_model("qwen2")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 3)
    config = CompileConfig(backend="aot_eager")
    out = _greedy(split, _ids(), cache_implementation="static", compile_config=config)
    assert torch.equal(out, _greedy(model, _ids()))
    assert split.__dict__["_tensorshard_compiled_steps"]
    steps = compiled_call(split, config)  # the steps that generate made
    assert list(split.__dict__["_tensorshard_compiled_steps"].values()) == [steps]
    steps.run_shards_together()
    threads: list[set[int]] = [set(), set(), set()]
    compiled = list(steps.compiled)
    meet = _meeting(lambda rank, *a, **k: compiled[rank](*a, **k), 3, threads, skip_first=True)
    steps.compiled = [lambda *a, rank=rank, **k: meet(rank, *a, **k) for rank in range(3)]
    assert torch.equal(_greedy(split, _ids(), cache_implementation="static", compile_config=config), _greedy(model, _ids()))
    assert all(threads) and len(set().union(*threads)) == 3, threads


def test_reduce_overhead_on_cpu_slots_compiles_without_cuda_graphs_and_says_so_once():
    """transformers' default CompileConfig asks for mode="reduce-overhead" (CUDA graphs): on CPU slots the shards'
    steps compile with inductor's default mode (and stay stitchable), logged once per model and options, not per
    generate (engines/inprocess/cuda_graph_mode.py; on GPUs: tests/gpu/test_gpu_decoding.py)."""
    split = tp.tensor_parallel(tiny_model("llama"), ["cpu", "cpu"])
    messages, stop = log_messages("tensorshard.engines.inprocess.cuda_graph_mode", logging.INFO)
    try:
        steps = compiled_call(split, CompileConfig(mode="reduce-overhead"))  # (nothing compiles before a call)
        again = compiled_call(split, CompileConfig(mode="reduce-overhead"))
    finally:
        stop()
    assert again is steps and "mode" not in steps.options and "options" not in steps.options, steps.options
    assert (steps.stitcher is not None) == STITCHES  # the CPU fast path as with the default options
    assert len(messages) == 1 and "CPU slots do not have" in messages[0], messages
