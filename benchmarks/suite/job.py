"""One measurement job in the main environment; launch.py starts it (alone, or under torchrun).

    python benchmarks/suite/job.py --task memory --model ff --systems ours-inprocess:4 --out r.json
    python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/suite/job.py \
        --task memory --model ff --systems dtensor --out r.json
    python benchmarks/suite/job.py --task train --model llama --systems plain ours-inprocess:1 ours-inprocess:2 ...

Tasks (each process, or each simulated device of an in-process engine, runs with one intra-op thread):
- memory: one warm-up training step (creates the optimizer state), then one measured step; per device the
  bytes of parameters, gradients, AdamW state and activations saved for backward (measure.py), and the
  process's resident memory.
- comm: the collectives of one forward, one backward and one greedy decode step (KV cache), by kind and
  bytes; run at two layer counts by communication.py, whose difference is the cost per block.
- train: seconds per training step (forward, backward, AdamW step, zero_grad).
- infer: seconds per forward of the training batch without gradients, and per greedy generation.
Several in-process systems in one job are timed in interleaved rounds (same conditions, drift-robust).
Rank 0 writes the JSON result (every rank's memory records included).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from contextlib import ExitStack, nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

import torch  # noqa: E402

from suite import measure  # noqa: E402
from suite.job_io import job_parser, write_result  # noqa: E402
from suite.config import Sizes, ff_batch, is_split_weight, llama_batch, llama_prompt  # noqa: E402
from suite.systems import DISTRIBUTED, build, local_device, optimizer_for  # noqa: E402


def loss_of(model_name: str, model, batch):
    if model_name == "ff":
        return model(batch).sum()  # the guide's loss
    return model(input_ids=batch, labels=batch).loss


def batch_for(model_name: str, sizes: Sizes, device) -> torch.Tensor:
    return ff_batch(sizes.ff, device) if model_name == "ff" else llama_batch(sizes.llama, device)


class Variant:
    """One system at one device count, built in this process."""

    def __init__(self, spec: str, args, sizes: Sizes, world: int, train: bool, layers: int | None = None):
        self.system, _, n = spec.partition(":")
        self.world = int(n) if n else world
        self.label = f"{self.system}:{self.world}"
        self.built = build(self.system, args.model, sizes, world=self.world, device=args.device,
                           checkpoint=args.checkpoint, layers=layers, train=train,
                           check_inputs=0 if args.task == "comm" else None)
        self.model = self.built.model
        self.device = local_device(args.device) if self.system in DISTRIBUTED else torch.device(
            "cpu" if args.device == "cpu" else "cuda:0")
        self.opt = optimizer_for(self.system, self.model) if train else None


def _barrier():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


# --- memory ------------------------------------------------------------------------------------------------


def task_memory(args, sizes: Sizes, world: int) -> dict:
    rss = measure.Rss()
    base = rss.now()
    v = Variant(args.systems[0], args, sizes, world, train=True)
    batch = batch_for(args.model, sizes, v.device)

    def step(hooks=None):
        with hooks or nullcontext():
            loss = loss_of(args.model, v.model, batch)
        loss.backward()
        v.opt.step()

    step()  # warm-up: AdamW creates its state
    v.opt.zero_grad(set_to_none=True)
    acts = [measure.SavedActivations(exclude=[p for _, p in slot]) for slot in v.built.slots]
    whole_call = None
    if v.built.slot_modules is not None:
        measure.hook_slots(v.built.slot_modules, acts)  # each device's forward runs in its own thread
    else:
        whole_call = acts[0].hooks()
    cuda = args.device == "cuda"
    if cuda:
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)
    rss.reset_peak()
    at_reset = rss.now()
    step(whole_call)
    peak = rss.peak()
    split = lambda name: is_split_weight(args.model, name)  # noqa: E731
    devices = []
    for r, slot in enumerate(v.built.slots):
        rec = measure.device_memory(slot, v.opt, acts[r].bytes, split)
        if cuda:
            dev = slot[0][1].device if slot else v.device
            rec["cuda_peak"] = torch.cuda.max_memory_allocated(dev)
        devices.append(rec)
    return {"system": v.system, "world": v.world, "note": v.built.note, "devices": devices,
            "rss": {"base": base, "before_step": at_reset, "step_peak": peak}}




# --- communication -----------------------------------------------------------------------------------------


class _Counters:
    """tensorshard's own counter (our systems) and torch's CommDebugMode (every distributed system)."""

    def __init__(self, system: str):
        self.ours = system.startswith("ours")
        self.debug = system in DISTRIBUTED
        self.results: dict[str, dict] = {}

    def phase(self, name: str):
        import tensorshard as tp

        counters = self

        class Phase:
            def __enter__(self):
                self.stack = ExitStack()
                self.ours = self.stack.enter_context(tp.count_collectives()) if counters.ours else None
                self.debug = self.stack.enter_context(measure.comm_counter()) if counters.debug else None
                return self

            def __exit__(self, *exc):
                self.stack.__exit__(*exc)
                rec = {}
                if self.ours is not None:
                    counts = self.ours.backward if name == "backward" else self.ours.forward
                    nbytes = self.ours.backward_bytes if name == "backward" else self.ours.forward_bytes
                    rec["tensorshard"] = {"counts": dict(counts), "bytes": nbytes}
                if self.debug is not None:
                    rec["CommDebugMode"] = {"counts": self.debug.counts, "bytes": sum(self.debug.nbytes.values())}
                counters.results[name] = rec
                return False

        return Phase()


def task_comm(args, sizes: Sizes, world: int) -> dict:
    v = Variant(args.systems[0], args, sizes, world, train=True, layers=args.layers)
    counters = _Counters(v.system)
    batch = batch_for("llama", sizes, v.device)
    with counters.phase("forward"):
        loss = loss_of("llama", v.model, batch)
    with counters.phase("backward"):
        loss.backward()
    v.model.eval()
    prompt = llama_prompt(sizes.llama, v.device)
    with torch.no_grad():
        out = v.model(input_ids=prompt, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        with counters.phase("decode"):
            v.model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    return {"system": v.system, "world": v.world, "layers": args.layers, "note": v.built.note, "phases": counters.results}


# --- speed -------------------------------------------------------------------------------------------------


def task_train(args, sizes: Sizes, world: int) -> dict:
    variants = [Variant(s, args, sizes, world, train=True) for s in args.systems]
    batch = batch_for(args.model, sizes, variants[0].device)

    def step(v):
        def run():
            loss_of(args.model, v.model, batch).backward()
            v.opt.step()
            v.opt.zero_grad(set_to_none=True)
        return run

    times = _interleaved([step(v) for v in variants], args)
    out = {"variants": [{"system": v.system, "world": v.world, "note": v.built.note, "step": t}
                        for v, t in zip(variants, times)]}
    if args.profile:
        out["profiles"] = {v.label: _profile(step(v), args) for v in variants}
    return out


def task_infer(args, sizes: Sizes, world: int) -> dict:
    variants = [Variant(s, args, sizes, world, train=False) for s in args.systems]
    batch = batch_for("llama", sizes, variants[0].device)
    prompt = llama_prompt(sizes.llama, variants[0].device)
    new = sizes.llama.new_tokens
    tokens = {}

    def forward(v):
        def run():
            with torch.no_grad():
                v.model(input_ids=batch)
        return run

    def generate(v):
        def run():
            with torch.no_grad():
                ids = v.model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            tokens[v.label] = ids[0, prompt.shape[1]:].tolist()
        return run

    fwd = _interleaved([forward(v) for v in variants], args)
    gen = _interleaved([generate(v) for v in variants], args)
    out = {"variants": [
        {"system": v.system, "world": v.world, "note": v.built.note, "forward": f,
         "generate": g, "new_tokens": new, "tokens": tokens.get(v.label)}
        for v, f, g in zip(variants, fwd, gen)
    ]}
    if args.profile:
        out["profiles"] = {f"{v.label} forward": _profile(forward(v), args) for v in variants}
        out["profiles"].update({f"{v.label} generate": _profile(generate(v), args) for v in variants})
    return out


def _interleaved(fns, args) -> list[dict]:
    """Warm each up once, then time them in `repeats` rounds, one call of each per round: per function the
    summary of its wall times, with the CPU seconds of this process per call under "cpu"."""
    times, cpus = [[] for _ in fns], [[] for _ in fns]
    for fn in fns:
        measure.timed(fn, 0, device=args.device, warmup=1, before=_barrier)
    for _ in range(args.repeats):
        for i, fn in enumerate(fns):
            times[i] += measure.timed(fn, 1, device=args.device, warmup=0, before=_barrier, cpu=cpus[i])
    return [{**measure.summary(t), "cpu": measure.summary(c)} for t, c in zip(times, cpus)]


def _profile(fn, args, top: int = 12) -> dict:
    """torch.profiler over one call: the ops with the most self CPU time (this process, all its threads)."""
    from torch.profiler import ProfilerActivity, profile

    _barrier()
    kwargs = {}
    try:
        from torch._C._profiler import _ExperimentalConfig

        kwargs["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        pass
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], **kwargs) as prof:
        fn()
    wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    threads: dict[int, dict] = {}
    for e in prof.events():  # self time per thread: matrix products, collectives, everything else
        t = threads.setdefault(e.thread, {"busy_s": 0.0, "matmul_s": 0.0, "comm_s": 0.0})
        self_s = e.self_cpu_time_total / 1e6
        t["busy_s"] += self_s
        if any(k in e.name for k in MATMUL_OPS):
            t["matmul_s"] += self_s
        elif any(k in e.name for k in COMM_OPS):
            t["comm_s"] += self_s
    return {
        "wall_s": wall, "total_self_cpu_s": total / 1e6,
        "threads": sorted(threads.values(), key=lambda t: -t["busy_s"]),
        "top": [{"op": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6,
                 "share": e.self_cpu_time_total / total} for e in events[:top]],
    }


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product", "aten::linear_backward")
COMM_OPS = ("c10d::", "gloo", "nccl", "all_reduce", "allreduce", "all_gather", "allgather")


# --- entry point -------------------------------------------------------------------------------------------

def task_checkpoint(args, sizes: Sizes, world: int) -> dict:
    """Write the benchmark Llama (random weights, seed 0; `--layers` decoder layers) to `--checkpoint`."""
    from suite.systems import save_checkpoint

    save_checkpoint(sizes, args.checkpoint, layers=args.layers)
    return {}


TASKS = {"memory": task_memory, "comm": task_comm, "train": task_train, "infer": task_infer, "checkpoint": task_checkpoint}


def main() -> None:
    parser = job_parser(__doc__.splitlines()[0], TASKS)
    parser.add_argument("--profile", action="store_true", help="also profile one call of each variant")
    parser.add_argument("--pg-timeout", type=float, default=300, help="seconds a rank may wait in a collective")
    args = parser.parse_args()
    sizes = Sizes.from_dict(json.loads(args.sizes))
    measure.one_thread()

    distributed = "WORLD_SIZE" in os.environ and any(s.split(":")[0] in DISTRIBUTED for s in args.systems)
    world, rank = 1, 0
    if distributed:
        import torch.distributed as dist

        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=timedelta(seconds=args.pg_timeout))
        world, rank = dist.get_world_size(), dist.get_rank()
    try:
        result = {"ok": True, **TASKS[args.task](args, sizes, world)}
    except Exception as e:  # noqa: BLE001 - reported in the results with its message
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(e).__name__}: {e}".strip()}
    if distributed:
        import torch.distributed as dist

        everyone = [None] * world
        dist.all_gather_object(everyone, result)
        if rank == 0:
            result = _merge_ranks(everyone)
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        write_result(args.out, result)


def _merge_ranks(results: list[dict]) -> dict:
    """Rank 0's result, with every rank's memory records, or the first rank's error."""
    failed = next((r for r in results if not r.get("ok")), None)
    if failed is not None:
        return failed
    merged = dict(results[0])
    if "devices" in merged:
        merged["devices"] = [d for r in results for d in r["devices"]]
        merged["rss_per_rank"] = [r["rss"] for r in results]
    return merged


if __name__ == "__main__":
    main()
