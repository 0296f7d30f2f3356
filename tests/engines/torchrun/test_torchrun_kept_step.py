"""engines/torchrun/kept_step.py: a learnt decode step kept on disk, and the first call of its kind in a later job
built from it without entering dynamo.

One task on the pool's two gloo ranks: a split model generates with the static cache (its step learnt and kept in a
temporary TENSORSHARD_CACHE_DIR); then, dynamo reset, a new split model on a new process group (another group
name, another native region: the kept graph's collectives must be given this group's) generates again without
tracing; then refusals: one rank's entry whose traced source file changed (both ranks trace: no hang, no divergence)
and the store switched off. Dynamo alone (backend "eager"): what is tested is the store, not inductor's code.
"""

import copy
import logging
import os
import pickle

import pytest
import torch

import tensorshard as tp
from support import tiny_llama
from support.harness import world_mesh
from support.helpers import log_messages
from tensorshard.comm.native import ops as native

pytestmark = pytest.mark.timeout(300)


def _frames() -> tuple[int, int]:
    """Dynamo's counts so far: frames it converted, graphs it compiled."""
    counters = torch._dynamo.utils.counters
    return int(counters["frames"]["total"]), int(counters["stats"]["unique_graphs"])


def kept_task(folder: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import CompileConfig

    from tensorshard.comm.dist_guard import guard_for
    from tensorshard.engines import capture_store
    from tensorshard.engines.torchrun import direct_step, kept_step

    native.available()  # (loaded from the machine's cache before the cache folder moves: it holds the library too)
    # (the pool restores the environment after the task); a folder per rank, to see each rank's entries apart
    os.environ["TENSORSHARD_CACHE_DIR"] = os.path.join(folder, f"rank{dist.get_rank()}")
    os.environ["TENSORSHARD_CAPTURE_CACHE"] = "1"  # (off for the rest of the suite: tests/conftest.py)
    torch._dynamo.reset()
    logged, stop_logging = log_messages("tensorshard.engines.torchrun", logging.INFO)
    ref = tiny_llama.build()
    ids = torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    direct: list[bool] = []  # per direct call: whether it ran
    call = direct_step.DirectStep.__call__

    groups: set = set()  # the group arguments of the collectives in the graphs the direct calls ran

    def spy(self, args, kwargs):
        out = call(self, args, kwargs)
        direct.append(out is not None)
        gm = getattr(self.compiled, "__self__", None)  # (backend "eager": the graph's own forward)
        if isinstance(gm, torch.fx.GraphModule):
            groups.update(kept_step._argument(*found) for found in kept_step._group_arguments(gm))
        return out

    def generate(mesh) -> dict:
        """A new split model's generate in a fresh dynamo: tokens, collectives, dynamo's work, direct calls."""
        torch._dynamo.reset()
        model = tp.parallelize(copy.deepcopy(ref), mesh, plan=tiny_llama.plan())
        del direct[:], logged[:]
        groups.clear()
        frames, graphs = _frames()
        with torch.no_grad(), tp.count_collectives() as counted:
            out = model.generate(ids, cache_implementation="static", compile_config=CompileConfig(backend="eager"),
                                 **settings)
        now = _frames()
        own = {model.tensorshard.comm.group_name, guard_for(mesh.get_group()).native} - {None}
        return {"groups": sorted(map(str, groups)), "own groups": sorted(map(str, own)), "tokens": out.tolist(), "counts": counted.counts, "frames": now[0] - frames, "graphs": now[1] - graphs,
                "direct": list(direct), "logged": list(logged),
                "entries": sorted(p.name for p in capture_store.folder().glob("*.pkl"))}

    results = {}
    direct_step.DirectStep.__call__ = spy
    try:
        with torch.no_grad():
            results["expected"] = ref.generate(ids, **settings).tolist()
        results["fill"] = generate(world_mesh())
        # a new group: its name and native region are not the ones the kept graph names
        results["later"] = generate(DeviceMesh.from_group(dist.new_group(list(range(dist.get_world_size()))), "cpu"))
        if dist.get_rank() == 1:  # rank 1's entry: a source file dynamo traced has changed since it was kept
            (path,) = capture_store.folder().glob("*.pkl")
            entry = pickle.loads(path.read_bytes())
            some_file = next(iter(entry["files"]))
            entry["files"][some_file] = "0" * 64
            path.write_bytes(pickle.dumps(entry))
        dist.barrier()
        results["one rank changed"] = generate(world_mesh())
        os.environ["TENSORSHARD_CAPTURE_CACHE"] = "0"
        for path in capture_store.folder().glob("*.pkl"):
            path.unlink()
        results["switched off"] = generate(world_mesh())
    finally:
        direct_step.DirectStep.__call__ = call
        stop_logging()
    results["rank"] = dist.get_rank()
    return results


def test_a_later_job_builds_the_decode_step_from_its_kept_graph_without_tracing(pool2, tmp_path):
    for out in pool2.run(kept_task, str(tmp_path), timeout=280):
        rank = out["rank"]
        for case in ("fill", "later", "one rank changed", "switched off"):
            assert out[case]["tokens"] == out["expected"], case  # the unsplit model's greedy tokens
            assert out[case]["counts"] == out["fill"]["counts"], case  # the same collectives, however it ran
        fill, later = out["fill"], out["later"]
        # filling: 3 decode steps, traced at the first, guarded at the second (learnt and kept), direct at the third
        assert fill["graphs"] >= 1 and fill["direct"] == [True], fill
        assert len(fill["entries"]) == 1, fill["entries"]  # this rank's entry
        # the later job: no frame converted, no graph compiled; every decode step direct, the first built from disk
        assert later["frames"] == 0 and later["graphs"] == 0, later
        assert later["direct"] == [True] * 3, later["direct"]
        # its collectives run on the new group (named by this job's values, not the kept graph's)
        # (its native region's handle where the native collectives load, else its group's name)
        assert later["groups"] and set(later["groups"]) <= set(later["own groups"]), later
        assert set(fill["groups"]) <= set(fill["own groups"]) and later["groups"] != fill["groups"], (later, fill)
        built = [m for m in later["logged"] if m.startswith("compiled the decode step of LlamaForCausalLM from its graph kept on disk")]
        assert len(built) == (1 if rank == 0 else 0), later["logged"]
        # one rank's entry refused (its traced file changed): both ranks trace, and keep the kind again
        changed = out["one rank changed"]
        assert changed["graphs"] >= 1 and changed["direct"] == [True], changed
        refused = "another rank has none" if rank == 0 else "tracing it again"
        assert any("kept on disk was not used" in m and refused in m for m in changed["logged"]) or rank == 1, changed
        assert len(changed["entries"]) == 1
        off = out["switched off"]
        assert off["graphs"] >= 1 and off["entries"] == [], off  # traced, nothing kept


def test_each_rank_world_mesh_layout_and_collective_kind_has_its_own_entry(monkeypatch):
    """kept_step.entry_name without a process group (its distributed facts faked): an entry kept at one world size,
    rank, mesh, split layout or kind of collectives is another's key, and so is never used by the other."""
    from types import SimpleNamespace

    from tensorshard.comm.dtensor import Layout
    from tensorshard.engines.torchrun import kept_step

    monkeypatch.setenv("TENSORSHARD_CAPTURE_CACHE", "1")
    model = tiny_llama.build()
    facts = {"rank": 0, "world": 2}
    monkeypatch.setattr(kept_step.dist, "get_rank", lambda: facts["rank"])
    monkeypatch.setattr(kept_step.dist, "get_world_size", lambda: facts["world"])
    monkeypatch.setattr(kept_step.dist, "get_backend", lambda group: "gloo")

    def name(*, rank=0, world=2, mesh=(0, 1), layout=Layout(0, 4, 4, 8), native=1, kind=("decode", (1, 1))):
        facts.update(rank=rank, world=world)
        state = SimpleNamespace(mesh=SimpleNamespace(device_type="cpu", mesh=torch.tensor(mesh), mesh_dim_names=None),
                                layouts={"model.layers.0.mlp.down_proj.weight": layout})
        guard = SimpleNamespace(group=None, native=native)
        return kept_step.entry_name(model, state, guard, ("inductor", None, None, None, False), kind)

    base = name()
    assert base is not None and name() == base  # (the same facts: the same entry)
    others = [name(rank=1), name(world=3, mesh=(0, 1, 2)), name(mesh=(2, 3)), name(layout=Layout(1, 4, 4, 8)),
              name(native=None), name(kind=("decode", (2, 1)))]
    assert len({base, *others}) == 1 + len(others)
    monkeypatch.setenv("TENSORSHARD_CAPTURE_CACHE", "0")
    assert name() is None  # the store off: nothing looked up, nothing kept


@pytest.mark.slow  # (an inductor compile of a small graph)
@pytest.mark.timeout(300)
def test_a_kept_graph_compiles_from_what_dynamo_s_trace_left_in_inductor_s_cache(tmp_path, monkeypatch):
    """direct_step's backend on a small module (no process group): dynamo's graph kept as kept_step keeps it, then
    restored and compiled as a later process's first call compiles it: inductor's FX-graph cache finds the graph
    dynamo's compile put there (its key reads which inputs dynamo marked static), and the graph computes the same."""
    from types import SimpleNamespace

    from torch import nn

    from tensorshard.engines import capture_store
    from tensorshard.engines.torchrun import kept_step
    from tensorshard.engines.torchrun.direct_step import DirectSteps

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x):
            return {"y": torch.relu(self.norm(self.proj(x)))}

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # (an empty cache: what is found, this test put)
    torch._dynamo.reset()
    model = Block().eval()
    state = SimpleNamespace(views=SimpleNamespace(swaps=[]), mesh=SimpleNamespace(device_type="cpu"))
    direct = DirectSteps(model, state)
    config = direct.capturing(SimpleNamespace(backend="inductor", mode=None, options=None, dynamic=False))
    compiled = torch.compile(model, backend=config.backend, dynamic=False)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    counters = torch._dynamo.utils.counters
    with torch.no_grad():
        compiled(x)
        with direct.watching() as seen:
            compiled(x)
        (graph, inputs, _), = seen
        kept = {"graph": capture_store.portable_graph(graph.gm), "dynamo": kept_step._dynamo_meta(graph.gm)}
        assert kept["dynamo"]["static"]  # (the module's weights: static inputs)
        hits = counters["inductor"]["fxgraph_cache_hit"]
        gm = capture_store.restored_graph(kept["graph"])
        kept_step._restore_dynamo_meta(gm, kept["dynamo"])
        again = direct.backend.compile_kept(gm, list(inputs))
        assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1
        (y,) = again(*inputs)
        torch.testing.assert_close(y, model(x)["y"])  # fp32, inductor's fused kernels: a few ulps
