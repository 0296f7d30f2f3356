"""What `mode="reduce-overhead"` (CUDA graphs) means for the compiled decode step of an in-process split model.

A decoded token on a GPU is launch-bound: a few hundred small kernels, each queued by Python. CUDA graphs remove
that: the compiled step's kernels are captured once and replayed with one call (`torch.compile(...,
mode="reduce-overhead")`, transformers' default `CompileConfig` on CUDA). A split model's step holds collectives
(comm/thread_ops.py: the shards' threads meet in Python, and sum in rank order), which a replayed graph would skip;
those operators are tagged `cudagraph_unsafe`, and inductor's graph partitioning (its `graph_partition` option)
cuts each shard's compiled step at them, capturing the pieces in between:

    shard 0's thread (cuda:0):  [graph: embed .. o_proj] -> all_reduce -> [graph: .. down_proj] -> all_reduce -> ..
    shard 1's thread (cuda:1):  [graph: embed .. o_proj] -> all_reduce -> [graph: .. down_proj] -> all_reduce -> ..

Why segments with host-side collectives between them, not the collectives captured inside the graphs: in one
process, NCCL with graph capture over several GPUs may deadlock (NCCL's docs), a torch.distributed collective
inside a graph hangs on replay, and peer copies (`cudaMemcpyPeerAsync`) are not capturable; the collectives
between segments are the engine's eager ones, so they give the eager path's sums bit for bit and
`count_collectives()` counts them, and a GPU beside CPU slots works (inductor captures no graph of a CPU
shard's code and says so in its log). The cost is one meeting of the threads per collective.

Each shard runs in the same thread at every call (engines/inprocess/workers.py: shard 0 in the caller's, shard i
in worker i); inductor keeps its CUDA graph trees per thread and device and serialises captures across threads
(torch/_inductor/cudagraph_trees.py: `graph_capture_lock`, thread-local capture mode), so every shard records
its graphs once, at its second call of a kind, and replays them after; a replay releases the GIL, so the
shards' graphs run at the same time. A split model called from another thread records shard 0's graphs anew
for that thread (more GPU memory, the same tokens). Not yet run on a GPU, and the least sure part: the trees learn
that a new step began from a counter of the whole process (dynamo's `GenerationTracker`), so each shard's trees
also see the other shards enter their steps; they all enter before the first collective completes, so each token
should follow the one pattern recorded (tests/gpu/test_gpu_decoding.py checks tokens and launches per token).

On CPU slots only there is no CUDA graph to capture: the mode is replaced by inductor's default, and said so.
Where this torch has no `graph_partition` option, inductor would capture no graph of a step with collectives at
all: the mode is replaced too, with a warning naming the fix.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch._inductor  # (tensorshard's import loads it already: its config and its table of modes)
import torch._inductor.config as inductor_config

from ...logs import get_logger

logger = get_logger(__name__)

GRAPH_MODE = "reduce-overhead"


def partitions_supported() -> bool:
    """Whether this torch's inductor can cut a compiled graph at the operators CUDA graphs must not capture."""
    return hasattr(inductor_config, "graph_partition")


def decode_options(options: dict[str, Any], devices: Sequence[Any], *, model_name: str = "the split model") -> dict[str, Any]:
    """The `torch.compile` options for every shard's decode step, given the options asked for (a
    `CompileConfig`'s, as a dict) and the split model's devices. Only `mode="reduce-overhead"` changes:

    - with a CUDA device among `devices`: the mode as inductor's options, with `graph_partition` on (torch.compile
      takes `mode` or `options`, not both: the user's `options` are kept on top of the mode's);
    - on CPU slots only, or where inductor cannot partition: inductor's default mode, logged;
    - with another backend than inductor (whose mode it is): the backend without a mode, logged.
    """
    if options.get("mode") != GRAPH_MODE:
        return dict(options)
    rest = {k: v for k, v in options.items() if k != "mode"}
    backend = options.get("backend", "inductor")
    if backend not in ("inductor", None):
        logger.info("%s: mode=%r is inductor's; backend=%r compiles each shard's decode step without it",
                    model_name, GRAPH_MODE, backend)
        return rest
    if not any(torch.device(d).type == "cuda" for d in devices):
        logger.info(
            "%s: mode=%r asks for CUDA graphs, which CPU slots do not have; each shard's decode step is compiled "
            "with inductor's default mode instead", model_name, GRAPH_MODE,
        )
        return rest
    if not partitions_supported():
        logger.warning(
            "%s: mode=%r is not applied: torch %s's inductor has no graph_partition option, which cuts a shard's "
            "step at its collectives so the rest is captured in CUDA graphs; decoding is compiled without CUDA "
            "graphs (upgrade torch to 2.8 or later for them)", model_name, GRAPH_MODE, torch.__version__,
        )
        return rest
    # inductor's table of modes: {"triton.cudagraphs": True} for this one
    inductor = {**torch._inductor.list_mode_options(GRAPH_MODE), **(rest.get("options") or {}), "graph_partition": True}
    return {**rest, "options": inductor}

