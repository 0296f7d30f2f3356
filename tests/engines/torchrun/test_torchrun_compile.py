"""torch.compile on a model parallelized under torchrun, and generate()'s compiled static-cache decoding.

The compiled graph holds the collectives (tensorshard's ops, comm/dist_ops.py; in generate()'s decode step, the C++
ones of comm/native/ where they load): no graph break, the counted
collectives those of the eager model, the unsplit model's logits and greedy tokens. Inductor compiles slowly
on two loaded cores (a minute or two per graph), so only two tests use it (the paths users take:
`torch.compile(model.forward, fullgraph=True)` and generate's default); the others trace with backends that
skip code generation ("aot_eager": the graph with its fake shapes and autograd, "eager": dynamo only).
"""

import copy
import inspect
import logging

import pytest
import torch

import tensorshard as tp
from support import tiny_llama
from support.harness import world_mesh
from support.helpers import log_messages
from tensorshard.comm.native import ops as native

pytestmark = pytest.mark.timeout(600)
INDUCTOR_TASK = 540  # seconds a task that compiles with inductor may take on this machine's loaded cores
# the embedding (split by vocabulary), 2 layers x (o_proj, down_proj); lm_head gathers its logits
COUNTS = {"all_reduce": 5, "all_gather": 1}


def _fresh_dynamo():
    """Each task compiles from scratch in the pool's long-lived processes; inductor in one thread (its
    worker pool would slow every later eager run, and two ranks share two cores)."""
    torch._dynamo.reset()
    torch._inductor.config.compile_threads = 1


def _split_pair(world_mesh_fn=world_mesh):
    ref = tiny_llama.build()
    return ref, tp.parallelize(copy.deepcopy(ref), world_mesh_fn(), plan=tiny_llama.plan())


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def compiled_forward_task(fullgraph: bool, backend: str) -> dict:
    _fresh_dynamo()
    ref, model = _split_pair()
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    step = torch.compile(model.forward, fullgraph=fullgraph, backend=backend)
    breaks = _graph_breaks()
    with torch.no_grad():
        with tp.count_collectives() as counted:
            logits = step(ids).logits
        with tp.count_collectives() as eager:
            model(ids)
        expected = ref(ids).logits
        again = step(ids).logits  # the compiled graph, run again: same bits
    return {"error": ((logits - expected).abs().max() / expected.abs().max()).item(), "counts": [counted.counts, eager.counts],
            "graph_breaks": _graph_breaks() - breaks, "same_again": torch.equal(logits, again)}


@pytest.mark.parametrize("fullgraph,backend", [(True, "inductor"), (False, "aot_eager")])
def test_compiled_forward_gives_the_unsplit_logits_with_the_collectives_in_the_graph(pool2, fullgraph, backend):
    for out in pool2.run(compiled_forward_task, fullgraph, backend, timeout=INDUCTOR_TASK):
        assert out["error"] < 1e-5  # fp32; inductor fuses and reorders sums: a few ulps
        assert out["graph_breaks"] == 0  # fullgraph=False too: the collectives are ops of the graph
        assert out["counts"] == [COUNTS, COUNTS]  # counted when the compiled graph runs them, as in eager
        assert out["same_again"]


def generate_static_task() -> dict:
    """generate()'s own path on a split model, as a user calls it: static cache, default CompileConfig (inductor).
    Later tokens call the learnt graph built with inductor's C++ wrapper (engines/torchrun/cpp_step.py), and its
    Python wrapper's graph with TENSORSHARD_CPP_WRAPPER=0."""
    import os

    from tensorshard.engines.torchrun import cpp_step, direct_step
    from tensorshard.engines.torchrun.decoding import compiled_graphs

    _fresh_dynamo()
    logged, stop_logging = log_messages("tensorshard.engines.torchrun", logging.INFO)
    ref, model = _split_pair()
    ids = torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    ran: list[str] = []  # per direct step: which wrapper's graph it called
    call = direct_step.DirectStep.__call__

    def spy(self, args, kwargs):
        out = call(self, args, kwargs)
        ran.append("C++" if self.cpp is not None and self.graph() is self.cpp else "Python")  # (the graph it ran)
        return out

    direct_step.DirectStep.__call__ = spy
    build_after, cpp_step.BUILD_AFTER = cpp_step.BUILD_AFTER, 2  # (64 tokens: the test's kind is built at its 3rd)
    try:
        with torch.no_grad():
            expected = ref.generate(ids, **settings)  # the unsplit model, its default (dynamic) cache, eager
            before = compiled_graphs()
            first = model.generate(ids, cache_implementation="static", **settings)
            after_first = compiled_graphs()
            wrappers = [list(ran)]
            del ran[:]
            with tp.count_collectives() as counted, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                second = model.generate(ids, cache_implementation="static", **settings)
            wrappers.append(list(ran))
            with tp.count_collectives() as eager:
                model.generate(ids, cache_implementation="static", disable_compile=True, **settings)
            del ran[:]
            os.environ[cpp_step.ENV] = "0"
            try:
                with tp.count_collectives() as python_wrapper:
                    third = model.generate(ids, cache_implementation="static", **settings)
            finally:
                del os.environ[cpp_step.ENV]
            wrappers.append(list(ran))
    finally:
        direct_step.DirectStep.__call__ = call
        cpp_step.BUILD_AFTER = build_after
    stop_logging()
    called = sorted({e.name for e in prof.events() if e.name.startswith("tensorshard::")})
    return {"tokens": [first.tolist(), second.tolist(), third.tolist()], "expected": expected.tolist(), "logged": logged,
            "graphs": [after_first - before, compiled_graphs() - after_first], "called": called, "wrappers": wrappers,
            "counts": [counted.counts, eager.counts, python_wrapper.counts], "native": native.available()}


def test_generate_with_a_static_cache_compiles_the_decode_step_and_gives_the_unsplit_tokens(pool2):
    results = pool2.run(generate_static_task, timeout=INDUCTOR_TASK)
    for rank, out in enumerate(results):
        assert out["tokens"] == [out["expected"]] * 3
        assert out["graphs"][0] >= 1 and out["graphs"][1] == 0  # compiled once, the second generate reuses it
        # the compiled steps' collectives counted as the eager ones, on either wrapper
        assert out["counts"][0] == out["counts"][1] == out["counts"][2]
        if out["native"]:  # the decode step's collectives are the C++ ops (comm/native/): none enters Python
            assert out["called"] == ["tensorshard::native_all_gather", "tensorshard::native_all_reduce"], out["called"]
            # 4 decode steps per generate: the first generate's last two called directly on the Python wrapper's
            # graph (BUILD_AFTER 2 here), the C++ one built at the next (cpp_step.py: one C++ call per token) and run
            # from then on; the Python wrapper's again with TENSORSHARD_CPP_WRAPPER=0
            assert out["wrappers"] == [["Python"] * 2, ["C++"] * 4, ["Python"] * 4], out["wrappers"]
            built = [line for line in out["logged"] if line.startswith("built the decode step of LlamaForCausalLM with inductor's C++")]
            assert len(built) == (1 if rank == 0 else 0), out["logged"]
        compiled = [line for line in out["logged"] if line.startswith("compiled the decode step of LlamaForCausalLM")]
        assert len(compiled) == (1 if rank == 0 else 0), out["logged"]  # rank 0 logs it, with its duration
        if compiled:
            # prompt 5 + 5 new - 1: the last token is never fed back
            assert "batch 1, 1 new token(s), cache of 9 tokens (StaticCache), float32) in " in compiled[0]


def recompiles_task(world: int) -> dict:
    """What triggers a recompile (docs/torchrun.md): a new batch size or cache length; not new prompts. Dynamo
    alone (backend "eager"): the graphs are the same whatever compiles them. Also: a StaticCache passed by hand,
    and disable_compile."""
    from transformers import CompileConfig, StaticCache

    from tensorshard.engines.torchrun.decoding import compiled_graphs

    _fresh_dynamo()
    ref, model = _split_pair()
    gen = torch.Generator().manual_seed(2)
    config = CompileConfig(backend="eager")
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    graphs, same = [], []

    def run(ids, **extra):
        before = compiled_graphs()
        with torch.no_grad():
            out = model.generate(ids, **settings, **extra)
            expected = ref.generate(ids, **settings)
        graphs.append(compiled_graphs() - before)
        same.append(out.tolist() == expected.tolist())

    static = dict(cache_implementation="static", compile_config=config)
    run(torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=gen), **static)  # first compile
    run(torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=gen), **static)  # another prompt: none
    run(torch.randint(0, tiny_llama.VOCAB, (2, 5), generator=gen), **static)  # batch 2: a recompile
    run(torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=gen), **static)  # longer cache: a recompile
    run(torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=gen), **static)  # batch 1 again: its own graph
    run(torch.randint(0, tiny_llama.VOCAB, (3, 7), generator=gen), **static)  # batch 3, other length: dynamic
    run(torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=gen), **static, disable_compile=True)  # off
    ids = torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=gen)
    # by hand, of the length generate made for this prompt (prompt + new; transformers 5.0 keeps its cache on the
    # model, one token shorter); each rank sizes its heads lazily
    length = model._cache.max_cache_len if hasattr(model, "_cache") else 5 + 4
    cache = StaticCache(config=model.config, max_cache_len=length)
    keyword = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"  # < 5.24
    run(ids, **{keyword: cache}, compile_config=config)
    return {"graphs": graphs, "same": same}


@pytest.mark.parametrize("world", [2, 3])  # 3 ranks: 4 query heads over 3 (2/1/1), KV heads shared
def test_recompiles_are_bounded_and_disable_compile_is_honoured(pool2, pool3, world):
    for out in (pool2 if world == 2 else pool3).run(recompiles_task, world, timeout=INDUCTOR_TASK):
        assert all(out["same"]), out
        first, other_prompt, batch2, longer, batch1_again, batch3, disabled, by_hand = out["graphs"]
        assert first == 1 and other_prompt == 0  # one graph for the whole decode step; new prompts reuse it
        # dynamo's automatic dynamic shapes: the first new batch size, then the first new cache length, each
        # compile a graph with that size symbolic; size 1 keeps a graph of its own; after that nothing compiles
        assert batch2 == 1 and longer == 1 and batch1_again <= 1 and batch3 == 0
        assert disabled == 0  # generation_config.disable_compile: eager decoding
        assert by_hand == 0  # a StaticCache of the shape generate makes: the same graph


def recompile_limit_task() -> dict:
    """A model past dynamo's recompile limit on its own (1 here; 8 by default): its second batch size would compile a
    second graph, so dynamo runs that kind eagerly, with the same tokens, and rank 0 says so once (WARNING). The
    calls after that must not skip the guards (unguarded.py): under that stance dynamo refuses to compile and
    raises. A model parallelized next has a limit of its own (its step's code is its own: engines/own_code.py)."""
    from transformers import CompileConfig

    from tensorshard.engines.torchrun.decoding import compiled_graphs

    _fresh_dynamo()
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static",
                    compile_config=CompileConfig(backend="eager"))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, tiny_llama.VOCAB, (batch, 5), generator=gen) for batch in (1, 2, 1, 2)]
    same, graphs = [], []
    warnings, stop = log_messages("tensorshard", logging.WARNING)
    try:
        with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
            for build in (tiny_llama.build, tiny_llama.build_uneven_heads):
                ref = build()
                model = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=tp.preset_for(ref))
                for ids in prompts if build is tiny_llama.build else prompts[:1]:
                    before = compiled_graphs()
                    same.append(model.generate(ids, **settings).tolist() == ref.generate(ids, **settings).tolist())
                    graphs.append(compiled_graphs() - before)
    finally:
        stop()
    return {"same": same, "graphs": graphs, "warnings": warnings}


def test_a_model_past_the_recompile_limit_decodes_eagerly_and_says_so(pool2):
    for rank, out in enumerate(pool2.run(recompile_limit_task, timeout=INDUCTOR_TASK)):
        assert all(out["same"]) and out["graphs"] == [1, 0, 0, 0, 1], out
        assert len(out["warnings"]) == (1 if rank == 0 else 0), out["warnings"]
        if rank == 0:
            assert "recompile limit" in out["warnings"][0] and "StaticCache" in out["warnings"][0], out["warnings"]


def many_models_task(models: int) -> dict:
    """A notebook's session under torchrun: `models` split models parallelized one after another in one job (two
    shapes), each decoding with the static cache, with dynamo's recompile limit at 2. Every model's step compiles
    one graph on code of its own, and its later tokens call that graph directly; a model let go of frees its
    weights. Dynamo alone (backend "eager"): what is tested is where the graphs live, not inductor's code."""
    import gc
    import weakref

    from transformers import CompileConfig

    from tensorshard.engines.torchrun import direct_step
    from tensorshard.engines.torchrun.decoding import compiled_graphs

    _fresh_dynamo()
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")
    config = CompileConfig(backend="eager")
    ids = torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    ran: list[bool] = []  # per direct call of the graph: whether it ran
    call = direct_step.DirectStep.__call__

    def spy(self, args, kwargs):
        out = call(self, args, kwargs)
        ran.append(out is not None)
        return out

    results = []
    direct_step.DirectStep.__call__ = spy
    try:
        with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
            for i in range(models):
                ref = (tiny_llama.build_uneven_heads if i % 3 == 2 else tiny_llama.build)(seed=i)
                model = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=tp.preset_for(ref))
                del ran[:]
                before = compiled_graphs()
                with tp.count_collectives() as counted:
                    out = model.generate(ids, compile_config=config, **settings)
                graphs = compiled_graphs() - before
                direct = list(ran)
                with tp.count_collectives() as eager:
                    model.generate(ids, disable_compile=True, **settings)
                weight = weakref.ref(model.model.layers[0].mlp.down_proj.weight)
                del model
                gc.collect()
                results.append({"same": out.tolist() == ref.generate(ids, **settings).tolist(), "graphs": graphs,
                                "direct": direct, "counts": [counted.counts, eager.counts], "freed": weight() is None})
    finally:
        direct_step.DirectStep.__call__ = call
    return {"models": results}


@pytest.mark.slow  # (10 models traced: ~20 s on 2 loaded cores)
def test_every_model_parallelized_in_a_job_decodes_on_its_own_compiled_graph(pool2):
    for out in pool2.run(many_models_task, 10, timeout=INDUCTOR_TASK):
        for i, model in enumerate(out["models"]):
            assert model["same"] and model["graphs"] == 1, (i, model)
            # 4 decode steps: the first compiles, the second (every guard) learns the graph, the rest call it
            assert model["direct"] == [True, True], (i, model)
            assert model["counts"][0] == model["counts"][1] and model["counts"][1]["all_reduce"] > 0, (i, model)
            assert model["freed"], f"model {i}'s weights are still alive after it was deleted"


def compiled_training_task() -> dict:
    """A training step through the compiled forward: the ops' backward (comm/dist_ops.py) gives eager's gradients."""
    import torch.nn.functional as F

    _fresh_dynamo()
    ref, compiled_model = _split_pair()
    eager_model = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=tiny_llama.plan())
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    step = torch.compile(compiled_model.forward, fullgraph=True, backend="aot_eager")

    def loss_of(out):
        return F.cross_entropy(out.logits[:, :-1].reshape(-1, tiny_llama.VOCAB), ids[:, 1:].reshape(-1))

    counts = []
    for forward in (step, eager_model):
        with tp.count_collectives() as counted:
            loss_of(forward(ids)).backward()
        counts.append([dict(counted.forward), dict(counted.backward)])
    grads = {n: p.grad.to_local() for n, p in compiled_model.named_parameters()}
    error = max((grads[n] - p.grad.to_local()).abs().max().item() for n, p in eager_model.named_parameters())
    return {"error": error, "counts": counts}


def test_a_compiled_training_step_gives_the_eager_gradients(pool2):
    for out in pool2.run(compiled_training_task, timeout=INDUCTOR_TASK):
        assert out["error"] < 1e-6  # fp32, the same ops in another order
        compiled, eager = out["counts"]
        assert compiled[0] == eager[0] == COUNTS
        # q, k and v (gate and up) share one input-gradient all-reduce, compiled as in eager: 2 per layer, and lm_head
        assert compiled[1] == eager[1] == {"all_reduce": 2 * 2 + 1}


def capturable_collectives_task() -> dict:
    """The decode step with torch's functional collectives (comm/graph_collectives.py), which CUDA graphs capture
    on NCCL; here on gloo (they run there too), with the native ones off, to check the wiring and the counting
    on CPUs. Dynamo and aot_autograd only ("aot_eager"): what is checked is the graph, not inductor's code."""
    from transformers import CompileConfig

    from tensorshard.comm import graph_collectives

    _fresh_dynamo()
    ref, model = _split_pair()
    guard = model.tensorshard.comm.guard
    saved = guard.native_asked, guard.native  # (the pool's group: given back after the task, for the later tests)
    guard.native_asked, guard.native = True, None  # the native collectives off: the traced ones decide
    graph_collectives.DEVICE_TYPES, graph_collectives.BACKENDS = ("cpu",), ("gloo",)
    ids = torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    static = dict(cache_implementation="static", compile_config=CompileConfig(backend="aot_eager"))
    try:
        with torch.no_grad():
            expected = ref.generate(ids, **settings)
            first = model.generate(ids, **static, **settings)
            with tp.count_collectives() as counted, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                second = model.generate(ids, **static, **settings)
            with tp.count_collectives() as eager:
                model.generate(ids, **static, disable_compile=True, **settings)
    finally:
        graph_collectives.DEVICE_TYPES, graph_collectives.BACKENDS = ("cuda",), ("nccl",)
        guard.native_asked, guard.native = saved
    called = sorted({e.name for e in prof.events() if e.name.startswith(("tensorshard::", "_c10d_functional::"))})
    return {"tokens": [first.tolist(), second.tolist()], "expected": expected.tolist(), "called": called,
            "counts": [counted.counts, eager.counts], "bytes": [counted.bytes, eager.bytes]}


def test_the_decode_step_with_capturable_collectives_gives_the_unsplit_tokens_and_counts_them(pool2):
    for out in pool2.run(capturable_collectives_task, timeout=INDUCTOR_TASK):
        assert out["tokens"] == [out["expected"]] * 2
        # every collective of the step is a functional one (no guarded Python operator), and counted as the eager
        # step's: the same kinds, counts and bytes (the prefill runs eagerly in both)
        assert "_c10d_functional::all_reduce" in out["called"] and "_c10d_functional::all_gather_into_tensor" in out["called"]
        assert not [name for name in out["called"] if name.startswith("tensorshard::")], out["called"]
        assert out["counts"][0] == out["counts"][1] and out["bytes"][0] == out["bytes"][1], out



def _two_adapters(model, ref, lora, folder: str) -> tuple:
    """LoRA adapters "first" and "second" added to the split `model` after splitting (registrations), saved, and
    loaded by plain PEFT into the unsplit `ref`; both in eval mode (PEFT makes its layers in training mode)."""
    import torch.distributed as dist
    from peft import PeftModel, get_peft_model

    torch.manual_seed(1)
    split = get_peft_model(model, lora, adapter_name="first")
    torch.manual_seed(2)
    split.add_adapter("second", lora)
    split.save_pretrained(folder)  # every rank calls it; rank 0 writes (each adapter but "default" in its folder)
    dist.barrier()
    unsplit = PeftModel.from_pretrained(ref, f"{folder}/first", adapter_name="first")
    unsplit.load_adapter(f"{folder}/second", adapter_name="second")
    return split.eval(), unsplit.eval()


def _adapter_changes(split, unsplit, check, out: dict, *, warm: bool = False) -> None:
    """`check()` (split against unsplit) into `out` with the adapter just added (and once more: `warm`), switched,
    switched back and disabled on both models alike."""
    out["adapter added"] = check()
    if warm:
        out["adapter warm"] = check()
    for name, label in (("second", "adapter switched"), ("first", "adapter switched back")):
        for peft_model in (split, unsplit):
            peft_model.set_adapter(name)
        out[label] = check()
    with split.disable_adapter(), unsplit.disable_adapter():
        out["adapters disabled"] = check()


def direct_task(folder: str) -> dict:
    """Later decode steps call the compiled graph itself, without dynamo (engines/torchrun/direct_step.py): the
    unsplit model's tokens and logits, the dynamo path's collectives, and each change made once the direct call is
    set up followed: weights changed in place, a split weight replaced by a write into its module's table (no
    registration: read afresh, a new local view), one replaced by assignment (a registration: another kind of
    call, run by dynamo with every guard, then learnt again), PEFT adapters added, switched and disabled (the
    unsplit PeftModel loads what the split one saved). Dynamo alone (backend "eager"): the graph called is
    whatever the backend made."""
    import gc
    import os
    import weakref

    import torch.distributed as dist
    from peft import LoraConfig
    from torch import nn
    from transformers import CompileConfig

    from tensorshard.engines.torchrun import direct_step

    _fresh_dynamo()
    ref, model = _split_pair()
    ran: list[bool] = []
    replayed: set[str] = set()  # attributes the direct steps set as dynamo's code did after the graph
    call = direct_step.DirectStep.__call__

    graphs: list[int] = []  # the graph each direct step of a case called (its id)
    every_graph: set[int] = set()  # ... of every case

    def spy(self, args, kwargs):
        replayed.update(name for _, name, _ in self.stores)
        graphs.append(id(self.compiled))
        every_graph.add(id(self.compiled))
        out = call(self, args, kwargs)
        ran.append(out is not None)
        return out

    def same(ids, split=None, unsplit=None, backend="eager") -> tuple[bool, float, int, dict]:
        """Greedy tokens and logits of both models; the split model's decode steps run directly; its collectives."""
        settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                        output_logits=True)
        del ran[:], graphs[:]
        with torch.no_grad():
            with tp.count_collectives() as counted:
                got = (split or model).generate(input_ids=ids, cache_implementation="static",
                                                compile_config=CompileConfig(backend=backend), **settings)
            want = (unsplit or ref).generate(input_ids=ids, **settings)
        error = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got.logits, want.logits))
        return torch.equal(got.sequences, want.sequences), error, sum(ran), counted.counts

    ids = torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=torch.Generator().manual_seed(5))
    down, ref_down = model.model.layers[0].mlp.down_proj, ref.model.layers[0].mlp.down_proj
    out = {}
    direct_step.DirectStep.__call__ = spy
    try:
        out["first"] = same(ids)  # compiles at its first step, every guard at the second, direct at the third
        out["warm"] = same(ids)
        with torch.no_grad():
            for split, unsplit in ((model, ref), (down, ref_down)):
                for name in ("model.layers.1.self_attn.q_proj.weight", "model.norm.weight") if split is model else ("weight",):
                    split.get_parameter(name).mul_(0.5)  # (a DTensor: its local tensor, in place)
                    unsplit.get_parameter(name).mul_(0.5)
        out["in place"] = same(ids)
        with torch.no_grad():
            down._parameters["weight"] = nn.Parameter(down.weight.detach() * 2)  # no registration
            ref_down.weight.mul_(2)
        out["table written"] = same(ids)
        replaced = weakref.ref(down.weight)
        with torch.no_grad():
            down.weight = nn.Parameter(down.weight.detach() * 3)  # registered: another kind of call
            ref_down.weight.mul_(3)
        out["assigned"] = same(ids)
        gc.collect()
        out["replaced weight freed"] = replaced() is None  # (the steps learnt before the registration dropped)
        out["assigned, warm"] = same(ids)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        split, unsplit = _two_adapters(model, ref, lora, folder)
        _adapter_changes(split, unsplit, lambda: same(ids, split, unsplit), out)
        eager_graphs = set(every_graph)
        out["other compile config"] = same(ids, split, unsplit, backend="aot_eager")  # transformers compiles anew
        out["graph of the new config"] = not eager_graphs & set(graphs)
        os.environ[direct_step.ENV] = "0"
        try:
            out["switched off"] = same(ids)
        finally:
            del os.environ[direct_step.ENV]
    finally:
        direct_step.DirectStep.__call__ = call
    out["replayed"] = sorted(replayed)
    return out


def test_later_decode_steps_call_the_graph_directly_and_follow_changed_weights_and_adapters(pool2, tmp_path):
    for out in pool2.run(direct_task, str(tmp_path), timeout=300):
        assert out.pop("replaced weight freed")
        assert out.pop("graph of the new config")  # not the steps learnt with the former one
        assert "_traced_gathered" in out.pop("replayed")  # the engine's reset after a traced call, as dynamo's code
        for case, (tokens, error, _, _) in out.items():
            assert tokens and error < 1e-5, (case, out[case])  # fp32, the same kernels but summed per rank: ulps
        direct = {case: steps for case, (_, _, steps, _) in out.items()}
        assert direct["first"] == 1 and direct["warm"] == 3  # of 3 decode steps per generate
        assert direct["other compile config"] == 1  # compiled, learnt, direct
        assert direct["in place"] == 3 and direct["table written"] == 3  # read afresh: the same kind of call
        # a new kind: its first step runs every guard (dynamo compiles nothing: weights are its inputs) and is learnt
        assert direct["assigned"] == 2 and direct["assigned, warm"] == 3
        # each adapter change: its first step runs every guard (dynamo compiles the new graph), the second is
        # learnt, the third direct; back to the first adapter: direct at once
        assert direct["adapter added"] == direct["adapter switched"] == direct["adapters disabled"] == 1, direct
        assert direct["adapter switched back"] == 3
        assert direct["switched off"] == 0  # TENSORSHARD_DIRECT_STEP=0
        counts = [out[case][3] for case in ("first", "warm", "in place", "table written", "assigned", "switched off")]
        assert all(c == counts[0] for c in counts), counts  # the direct steps' collectives counted as dynamo's


def local_views_task() -> dict:
    """LocalViews.all_local (engines/torchrun/local_views.py), what generate's compiled step runs inside: without
    gradients in eval mode every DTensor is its local view for the call and each module's wrapper passes through
    (the same logits), then every DTensor is back (also after an error); with gradients on, nothing changes."""
    from torch.distributed.tensor import DTensor

    ref, model = _split_pair()
    state = model.tensorshard
    ids = torch.randint(0, tiny_llama.VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    before = dict(model.named_parameters())
    split = sorted(n for n, p in before.items() if isinstance(p, DTensor))
    out = {"split": len(split)}
    with torch.no_grad():
        expected = model(ids).logits
        with state.views.all_local(state.mesh):
            inside = dict(model.named_parameters())
            out["local_inside"] = all(
                not isinstance(inside[n], DTensor) and inside[n].shape == before[n].to_local().shape for n in split)
            out["active"] = state.views.active
            out["same_logits"] = torch.equal(model(ids).logits, expected)
        out["restored"] = all(p is before[n] for n, p in model.named_parameters())
        try:
            with state.views.all_local(state.mesh):
                raise KeyError("inside")
        except KeyError:
            pass
        restored = all(p is before[n] for n, p in model.named_parameters())
        out["restored_after_error"] = restored and not state.views.active
    with state.views.all_local(state.mesh):  # gradients on: the wrappers swap as before, per call
        out["untouched_with_grad"] = all(p is before[n] for n, p in model.named_parameters()) and not state.views.active
    return out


def test_a_compiled_call_puts_every_local_view_in_place_once(pool2):
    for out in pool2.run(local_views_task, timeout=120):
        assert out["split"] > 0
        assert out["local_inside"] and out["active"] and out["same_logits"]
        assert out["restored"] and out["restored_after_error"] and out["untouched_with_grad"]


def unguarded_task(folder: str) -> dict:
    """Later decode steps run without dynamo's guard tree (engines/torchrun/unguarded.py). Each change below is one
    the skipped guards would have caught: the call after it still gives the unsplit model's tokens and logits, and
    is run with every guard. Dynamo alone (backend "eager"): guards do not depend on the backend. The unsplit
    PeftModel holds the adapters the split one made (saved by it, loaded by plain PEFT)."""
    import os

    import torch.distributed as dist
    from peft import LoraConfig
    from transformers import CompileConfig

    from tensorshard.engines.torchrun import direct_step, unguarded

    _fresh_dynamo()
    ref, model = _split_pair()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    skipped: list[bool] = []
    direct: list[int] = []  # decode steps that called the graph directly (direct_step.py)
    may_skip, direct_call = unguarded.Unguarded.may_skip, direct_step.DirectStep.__call__

    def spy(self, key, quiet):
        skipped.append(may_skip(self, key, quiet))
        return skipped[-1]

    def direct_spy(self, args, kwargs):
        out = direct_call(self, args, kwargs)
        if out is not None:
            direct.append(len(skipped) - 1)  # (the step's index)
        return out

    def same(split, unsplit, ids) -> tuple[bool, float, list[bool], list[int]]:
        """Greedy tokens and logits of both models; which of the split model's decode steps skipped the guards,
        and which of those called the graph directly."""
        settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                        output_logits=True)
        del skipped[:], direct[:]
        with torch.no_grad():
            got = split.generate(input_ids=ids, cache_implementation="static",
                                 compile_config=CompileConfig(backend="eager"), **settings)
            want = unsplit.generate(input_ids=ids, **settings)
        error = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got.logits, want.logits))
        return torch.equal(got.sequences, want.sequences), error, list(skipped), list(direct)

    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=gen)
    out = {}
    unguarded.Unguarded.may_skip, direct_step.DirectStep.__call__ = spy, direct_spy
    try:
        with torch._dynamo.config.patch(recompile_limit=64):  # (every change below is a graph of its own)
            out["first"] = same(model, ref, ids)  # compiles at its first step, every guard at the second
            out["warm"] = same(model, ref, torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=gen))
            out["longer prompt"] = same(model, ref, torch.randint(0, tiny_llama.VOCAB, (1, 8), generator=gen))
            out["batch 2"] = same(model, ref, torch.randint(0, tiny_llama.VOCAB, (2, 5), generator=gen))
            model.train()
            ref.train()  # (no dropout in the tiny Llama: the same numbers, another graph)
            out["training mode"] = same(model, ref, ids)
            model.eval()
            ref.eval()
            out["eval again"] = same(model, ref, ids)
            split, unsplit = _two_adapters(model, ref, lora, folder)
            _adapter_changes(split, unsplit, lambda: same(split, unsplit, ids), out, warm=True)
            os.environ[unguarded.ENV] = "0"
            try:
                out["switched off"] = same(split, unsplit, ids)
            finally:
                del os.environ[unguarded.ENV]
    finally:
        unguarded.Unguarded.may_skip, direct_step.DirectStep.__call__ = may_skip, direct_call
    return out


def test_later_decode_steps_skip_the_guards_and_still_follow_every_change(pool2, tmp_path):
    for out in pool2.run(unguarded_task, str(tmp_path), timeout=300):
        for case, (tokens, error, _, _) in out.items():
            assert tokens and error < 1e-5, (case, out[case])  # fp32, the same kernels but summed per rank: ulps
        steps = {case: skipped for case, (_, _, skipped, _) in out.items()}
        # every step that skipped the guards called the graph directly, once its kind was learnt
        # (after the longer prompt, dynamo's graphs take the cache length and the batch as ints: dynamic shapes, read
        # from the tensor inputs); the logits above say each change made after that was followed
        for case, (_, _, skipped, direct) in out.items():
            assert direct == [i for i, skip in enumerate(skipped) if skip], (case, skipped, direct)
        assert steps["first"] == [False, False, True]  # compiled; every guard, nothing compiled; unguarded
        assert steps["warm"] == [True] * 3  # another prompt of the same length: the same kind of call
        # each change: its first steps run every guard (dynamo recompiles where it must), then unguarded again
        for case in ("longer prompt", "batch 2", "adapter added", "adapter switched", "adapters disabled"):
            assert steps[case][0] is False and steps[case][-1] is True, (case, steps[case])
        # back to a kind already run: unguarded at once, dynamo's differentiating guards (the training flag and the
        # adapter's name failed once, so they are among them) choosing its graph; the logits above say it did
        for case in ("adapter warm", "eval again", "adapter switched back"):
            assert steps[case] == [True] * 3, (case, steps[case])
        assert steps["training mode"] == [False] * 3  # never without guards while a module trains
        assert steps["switched off"] == [False] * 3  # TENSORSHARD_SKIP_GUARDS=0


def class_forwards_task() -> dict:
    """The decode step dynamo traces under torchrun calls each split layer through its class's forward
    (engines/class_forwards.py): nn.Module's call machinery is not traced for them (what made a split rank's first
    fast call trace ~37,000 more bytecodes than the unsplit model's on SmolLM2's shape), the classes are put back
    after the call, and later calls (guards evaluated, then skipped) compile nothing more. Dynamo alone (backend
    "eager"): the graphs are the same whatever compiles them."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase as translator
    from transformers import CompileConfig

    from tensorshard.engines.torchrun.decoding import compiled_graphs

    _fresh_dynamo()
    ref, model = _split_pair()
    wrapped = {name: type(m) for name, m in model.named_modules() if callable(m.__dict__.get("forward"))}
    ids = torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    traced: list[str] = []
    step = translator.step

    def counting(self):
        traced.append(self.f_code.co_name)
        return step(self)

    translator.step = counting
    try:
        with torch.no_grad():
            static = dict(cache_implementation="static", compile_config=CompileConfig(backend="eager"))
            tokens = model.generate(ids, **settings, **static).tolist()
            before = compiled_graphs()
            again = model.generate(ids, **settings, **static).tolist()
            expected = ref.generate(ids, **settings).tolist()
    finally:
        translator.step = step
    after = {name: type(m) for name, m in model.named_modules() if callable(m.__dict__.get("forward"))}
    return {"wrapped": len(wrapped), "restored": after == wrapped, "same": tokens == again == expected,
            "call_impl": traced.count("_call_impl"), "traced": len(traced), "recompiled": compiled_graphs() - before}


def test_the_decode_step_traces_split_layers_through_their_class_forward(pool2):
    for out in pool2.run(class_forwards_task, timeout=300):
        assert out["wrapped"] > 0 and out["restored"], out
        assert out["same"], out
        assert out["traced"] > 0 and out["call_impl"] == 0, out
        assert out["recompiled"] == 0, out  # the second generate: guarded, then unguarded calls, no new graph
