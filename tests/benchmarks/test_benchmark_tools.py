"""The benchmark suite's measuring and reporting tools (benchmarks/suite), on tiny inputs: no timings here.

The benchmarks themselves run with `make bench`; these tests keep their arithmetic honest: which bytes count
as activations, parameters, gradients and optimizer state; which targets a result meets; how errors are read
from a failed job's output.
"""

import importlib.util
import sys

import pytest
import torch
from torch import nn

from support import ROOT


def _load_suite() -> None:
    """benchmarks/suite as the package `suite` (its modules import each other by that name), without putting
    benchmarks/ on sys.path (its coverage.py would shadow the coverage package)."""
    folder = ROOT / "benchmarks" / "suite"
    spec = importlib.util.spec_from_file_location("suite", folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["suite"] = module
    spec.loader.exec_module(module)


_load_suite()

from suite import measure  # noqa: E402
from suite.config import canonical_name, is_split_weight  # noqa: E402
from suite.launch import last_error  # noqa: E402
from suite.targets import TARGETS  # noqa: E402


def test_saved_activations_count_each_saved_storage_once_and_skip_parameters():
    layer = nn.Linear(8, 16, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    acts = measure.SavedActivations(exclude=list(layer.parameters()))
    with acts.hooks():
        y = layer(x)  # saves x (its weight is a parameter: excluded)
        z = torch.relu(y)  # saves its output z
        (z * z).sum().backward()  # mul saves z twice: one storage
    assert acts.bytes == (4 * 8 + 4 * 16) * 4


def test_state_bytes_counts_parameters_gradients_and_adamw_state_of_the_selected_names():
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    named = list(model.named_parameters())
    every = measure.state_bytes(named, opt)
    n = sum(p.numel() for p in model.parameters())
    assert every == {"params": 4 * n, "grads": 4 * n, "optim": 8 * n}  # exp_avg and exp_avg_sq; step counters skipped
    linear = measure.state_bytes(named, opt, lambda name: name.startswith("0."))
    assert linear["params"] == 4 * (4 * 6 + 6)


def test_split_weight_names_are_read_through_every_wrapper():
    assert canonical_name("module_shards.3.model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert canonical_name("wrapped_model.module_shards.1.model.layers.0.mlp.tp_wrapped_module.down_proj.weight").endswith(
        "model.layers.0.mlp.down_proj.weight")
    assert is_split_weight("llama", "model.layers.2.mlp.gate_proj.weight")
    assert is_split_weight("llama", "lm_head.weight")
    assert not is_split_weight("llama", "model.layers.2.input_layernorm.weight")
    assert is_split_weight("ff", "w2.weight")


def test_last_error_finds_the_exception_of_a_traceback():
    output = "\n".join([
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "RuntimeError: Error(s) in loading state_dict for LlamaForCausalLM:",
        '\tUnexpected key(s) in state_dict: "model.layers.1.mlp.up_proj.weight".',
        "[rank0]: something else",
    ])
    assert last_error(output) == (
        'RuntimeError: Error(s) in loading state_dict for LlamaForCausalLM: Unexpected key(s) in state_dict: '
        '"model.layers.1.mlp.up_proj.weight".'
    )
    assert last_error("all fine\n") == ""


def _speed(plain_step: float, one: float, two: float) -> dict:
    def v(system, world, step):
        return {"system": system, "world": world, "step": {"median": step}}
    return {"train": [v("plain", 1, plain_step), v("ours-torchrun", 1, one), v("ours-torchrun", 2, two)], "infer": []}


@pytest.mark.parametrize("two, met", [(0.5, True), (0.6, False)])
def test_the_torchrun_training_target_is_a_speed_up_of_1_8x(two, met):
    target = next(t for t in TARGETS if t.key == "torchrun-train")
    result = target.check(_speed(1.0, 1.0, two))
    assert result["met"] is met
    assert result["value"] == pytest.approx(1.0 / two)


def test_overhead_targets_compare_one_device_with_the_unsplit_model():
    target = next(t for t in TARGETS if t.key == "overhead-ours-torchrun-step")
    assert target.check(_speed(1.0, 1.02, 0.5))["met"] is True
    assert target.check(_speed(1.0, 1.05, 0.5))["met"] is False
    assert target.check({"train": [], "infer": []})["value"] is None  # a failed run is reported, not judged


def _bench(name: str):
    """benchmarks/NAME.py, loaded as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- benchmarks/gpu.py (measured on a CUDA machine; here its refusal and its report) ------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what it says where no GPU is visible")
def test_gpu_benchmark_says_it_needs_a_gpu():
    with pytest.raises(SystemExit, match=r"benchmarks/gpu.py measures on a GPU, and none is visible here \(torch "):
        _bench("gpu").main([])


def test_gpu_section_reports_ratios_and_memory_and_replaces_itself():
    gpu = _bench("gpu")
    task = lambda unsplit, shard, peak: {  # noqa: E731
        "unsplit": {"median_s": unsplit, "min_s": unsplit, "peak_above_weights": {"cuda:0": peak}},
        "1 shard": {"median_s": shard, "min_s": shard, "peak_above_weights": {"cuda:0": peak + 2**29}},
    }
    run = {
        "meta": {"date": "2026-11-26", "gpus": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "torch": "2.13.0", "cuda": "13.0",
                 "transformers": "5.24.0", "python": "3.11.7", "size": "1b", "dtype": "bfloat16", "batch": 4, "seq": 512,
                 "prompt": 32, "new_tokens": 64, "repeats": 10, "parameters": 1.1e9},
        "result": {"weights": {"unsplit": {"cuda:0": 2**31}, "1 shard": {"cuda:0": 2**31}},
                   "tasks": {"forward": task(0.100, 0.103, 2**30), "train": task(0.400, 0.396, 2**32), "decode": task(0.02, 0.0202, 0)}},
    }
    body = gpu.section(run)
    assert "on NVIDIA H100 80GB HBM3 (1 visible), torch 2.13.0" in body
    assert "| forward (ms) | 100.00 | 103.00 | 1.03x |" in body
    assert "| training step (ms) | 400.00 | 396.00 | 0.99x |" in body
    assert "| decoding (ms per token) | 20.00 | 20.20 | 1.01x |" in body
    assert "| weights | 2.00 | 2.00 |" in body and "| train peak above weights | 4.00 | 4.50 |" in body
    page = "# Benchmarks\n\n## 3. Speed on CPU\n\ntimes\n\n## The run\n\njobs\n"
    once = gpu.replace_section(page, body)
    assert once.index(gpu.TITLE) < once.index("## The run") and "## 3. Speed on CPU\n\ntimes\n" in once
    assert gpu.replace_section(once, body) == once  # measured again: the section is replaced, not added


# --- benchmarks/generation.py --device cuda (measured on a CUDA machine; here its refusals) -------------------


def test_generation_on_gpus_needs_one_gpu_per_device_of_a_split_row():
    problem = _bench("generation").device_problem
    assert problem("cpu", [1, 2, 4, 8], 0) is None and problem("cuda", [1, 2], 2) is None
    assert "no GPU is visible here" in problem("cuda", [1], 0)
    assert problem("cuda", [1, 2, 4, 8], 1) == (
        "--devices 1 2 4 8: the split rows need as many GPUs as devices (one GPU appears once in a device list) "
        "and 1 is visible; pass --devices up to 1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what it says where no GPU is visible")
def test_generation_on_gpus_says_it_needs_a_gpu_before_building_anything(capsys):
    with pytest.raises(SystemExit):
        _bench("generation").main(["--device", "cuda", "--quick"])
    assert "--device cuda: no GPU is visible here" in capsys.readouterr().err


def test_a_gpu_run_writes_its_own_results_file():
    results = _bench("generation").results_file
    assert results("smollm", "cuda").name == "generation-smollm-cuda.json" and results("small").name == "generation.json"


def test_torchrun_generation_on_gpus_needs_one_gpu_per_rank():
    module = _bench("generation_torchrun")
    assert module.gpu_problem("cpu", [2, 4], 0) is None and module.gpu_problem("cuda", [2], 2) is None
    assert "no GPU is visible here" in module.gpu_problem("cuda", [1], 0)
    assert "each rank needs a GPU of its own" in module.gpu_problem("cuda", [2], 1)


# --- benchmarks/first_call.py (its timings are a run's; here its table and refusals) --------------------------


def test_the_first_call_table_gives_the_slowest_rank_and_every_rank_s_cpu():
    bench = _bench("first_call")
    rank = {"wall_s": 10.0, "cpu_s": 8.0, "children_cpu_s": 1.0, "bytecodes": 900, "call_impl_bytecodes": 0}
    result = {"phases_s": {"entire_frame_compile": 5.0}, "graphs": 1, "log": ["compiled the decode step in 9 s"],
              "cache": {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0, "fxgraph_cache_bypass": 0, "aot_autograd_cache_hit": 1}}
    text = bench.table({"unsplit": {**result, "ranks": [rank]}, "torchrun": {**result, "ranks": [rank, {**rank, "wall_s": 12.0, "cpu_s": 9.0}]}},
                       model="tiny", cache="warm", devices=2, load=0.5)
    assert "| unsplit | 10.0 | 8.0 | 1.0 | 5.0 |" in text
    assert "| torchrun | 12.0 | 8.0 / 9.0 | 1.0 / 1.0 | 5.0 |" in text  # the slowest rank's wall, each rank's CPU
    assert "| 1/0/0 | 1 | 900 (0) / 900 (0) |" in text and "- torchrun: compiled the decode step in 9 s" in text


def test_the_first_call_script_refuses_a_split_of_one_device(capsys):
    with pytest.raises(SystemExit):
        _bench("first_call").main(["--devices", "1"])
    assert "--devices 1: a split needs at least 2" in capsys.readouterr().err
