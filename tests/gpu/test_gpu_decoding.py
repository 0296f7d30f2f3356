"""The fast decoding path on GPUs with CUDA graphs (`CompileConfig(mode="reduce-overhead")`), in both engines.

In-process (engines/inprocess/cuda_graph_mode.py): each GPU shard's compiled step is captured by inductor's CUDA
graph trees in the shard's thread, cut at its collectives (the engine's own, run between the replays): greedy
tokens identical to the unsplit model's and to the split model's eager step, the collectives counted as the eager
step's, graphs recorded and replayed. Under torchrun on NCCL (comm/graph_collectives.py): the collectives are
torch's functional ones, captured inside the graphs; tokens identical, collectives counted per call, no guarded
Python collective left in the step.

Greedy tokens are compared exactly against the unsplit model on the CPU, as tests/gpu/test_gpu_transformers.py
does (fp32, TF32 off: the tiny model's top logits are far apart next to the GPU's rounding).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import tensorshard as tp
from support.gpu import ONE_GPU, TWO_GPUS
from support.harness import child_env
from support.hf_configs import VOCAB, tiny_model

pytestmark = ONE_GPU + [pytest.mark.timeout(600)]

GENERATE = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)


def _graphs_recorded(device_index: int) -> int:
    """CUDA graphs inductor's tree manager of this thread recorded on the device (0 where it has none)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    if manager is None:
        return 0
    count, todo = 0, [node for nodes in manager.roots.values() for node in nodes]
    while todo:
        node = todo.pop()
        count += 1
        todo.extend(child for nodes in node.children.values() for child in nodes)
    return count


def _graph_launches(run) -> int:
    """How many CUDA graphs `run()` launched (the profiler's runtime calls)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run()
    return sum(1 for e in prof.events() if "cudaGraphLaunch" in e.name)


@pytest.mark.parametrize(
    "devices",
    [["cuda:0", "cpu"], pytest.param(["cuda:0", "cuda:1"], marks=TWO_GPUS)],
    ids=["gpu+cpu", "2gpus"],
)
def test_inprocess_cuda_graphs_give_the_unsplit_tokens_and_count_the_collectives(devices):
    from transformers import CompileConfig

    torch._dynamo.reset()
    ref = tiny_model("llama")
    split = tp.tensor_parallel(copy.deepcopy(ref), devices)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    expected = ref.generate(ids, **GENERATE)
    graphs = dict(cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"), **GENERATE)
    with torch.no_grad():
        x = ids.to(split.device)
        first = split.generate(x, **graphs).cpu()  # compiles, warms up and records the graphs
        with tp.count_collectives() as counted:
            second = split.generate(x, **graphs).cpu()
        launches = _graph_launches(lambda: split.generate(x, **graphs))
        with tp.count_collectives() as eager:
            eager_tokens = split.generate(x, cache_implementation="static", disable_compile=True, **GENERATE).cpu()
    assert torch.equal(first, expected) and torch.equal(second, expected) and torch.equal(eager_tokens, expected)
    # the collectives run between the replays, the eager path's: counted as the eager step's, kinds and bytes
    assert counted.counts == eager.counts and counted.bytes == eager.bytes, (counted.counts, eager.counts)
    # shard 0 runs in this thread: its step was captured in several graphs (cut at the collectives) and replayed
    assert _graphs_recorded(0) > 1
    assert launches >= GENERATE["max_new_tokens"] - 1


SCRIPT = textwrap.dedent("""
    import copy, json
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import CompileConfig
    import tensorshard as tp
    from support.hf_configs import VOCAB, tiny_model

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    ref = tiny_model("llama")
    split = tp.parallelize(copy.deepcopy(ref).cuda(), init_device_mesh("cuda", (world,)))
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    graphs = dict(cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))
    out = {}
    with torch.no_grad():
        expected = ref.generate(ids, **settings)
        x = ids.cuda()
        first = split.generate(x, **graphs, **settings).cpu()
        with tp.count_collectives() as counted:
            second = split.generate(x, **graphs, **settings).cpu()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            split.generate(x, **graphs, **settings)
        with tp.count_collectives() as eager:
            eager_tokens = split.generate(x, cache_implementation="static", disable_compile=True, **settings).cpu()
    names = [e.name for e in prof.events()]
    out["same"] = [torch.equal(t, expected) for t in (first, second, eager_tokens)]
    out["counts"] = [counted.counts, eager.counts, counted.bytes, eager.bytes]
    out["launches"] = sum("cudaGraphLaunch" in n for n in names)
    out["guarded"] = sorted({n for n in names if n.startswith("tensorshard::")})
    print("RESULT " + json.dumps(out))
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=TWO_GPUS)])
def test_torchrun_cuda_graphs_capture_the_collectives(world, tmp_path):
    """world 1 runs on one GPU (no collective: the wrapper's path on CUDA); world 2 needs two GPUs (NCCL refuses two
    ranks on one GPU) and checks the captured collectives."""
    script = tmp_path / "decode.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", str(script)],
        env=child_env(OMP_NUM_THREADS="1"), cwd=tmp_path, capture_output=True, text=True, timeout=540,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = [json.loads(line.removeprefix("RESULT ")) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == world
    for out in results:
        assert out["same"] == [True, True, True], out
        counted, eager, counted_bytes, eager_bytes = out["counts"]
        assert counted == eager and counted_bytes == eager_bytes, out  # counted per call from the traced notes
        assert out["launches"] >= 7, out  # every token after the prefill: replayed graphs
        if world > 1:  # no guarded Python collective left: the NCCL calls are inside the graphs
            assert out["guarded"] == [], out

