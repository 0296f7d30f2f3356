"""Scaling past two devices: forward, training step and greedy decoding at 1, 2, 4 and 8 devices, both engines,
each speed-up with the accounting that explains it.

    python benchmarks/scaling.py [--devices 1 2 4 8] [--engines inprocess torchrun] [--kinds forward train decode]
                                 [--rounds 5] [--quick] [--device cpu|cuda]    # writes benchmarks/results/scaling.json
    python benchmarks/render.py                                                 # its section of BENCHMARKS.md

What runs (one intra-op thread per device, as everywhere in benchmarks/; `--quick`: small models, to check it runs):
- forward, train: BENCHMARKS.md's 104M Llama on a (4, 128) token batch (suite/scaling_torchrun.py's SPECS, for both
  engines); train = forward with the
  language-model loss, backward, a plain `torch.optim.AdamW(model.parameters())` step, zero_grad: what users write.
- decode: the dispatch-bound regime GPU decoding lives in, on CPU: a small Llama (hidden 256, 8 layers), batch 1,
  greedy `generate` with the KV cache; ms per generated token.
The unsplit model and every device count of one engine and kind run in one process, timed in interleaved rounds
(the same conditions for all); the torchrun engine runs one process per rank (suite/scaling_torchrun.py).

What is reported per device count, medians over the rounds:
- speed-up: the unsplit model's wall time / this one's;
- work inflation: CPU seconds per step summed over every thread (or rank) / the unsplit model's: 1.00 means
  splitting adds no work; above 1, each device repeats work (norms, the embedding, the loss) or the engine adds its own;
- cores busy: CPU seconds / (wall seconds x the cores the step could use, min(cores, devices)): below 1, work runs alone;
- waiting: the shards' mean time blocked at collectives for the others, as a share of the wall time;
- one running: the share of the wall time in which only one shard (or the caller alone) runs;
- CPU per shard: each shard's thread (or rank) CPU seconds, from the scheduler's counters. In the decoding regime
  the kernels take microseconds, so this is the model's Python and PyTorch's dispatch, which every shard runs in
  full and which one GIL serialises in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # suite/

BENCH = Path(__file__).resolve().parent
KINDS = ("forward", "train", "decode")


def spec_for(kind: str, quick: bool):
    """The model and inputs of a kind, the same for both engines (suite/scaling_torchrun.py's table): the 104M
    Llama for forward and train, the small one for decoding, the tiny one for both with --quick."""
    from suite.scaling_torchrun import SPECS

    return SPECS["tiny" if quick else "small" if kind == "decode" else "llama"]


def llama(spec, seed: int = 0):
    """A LlamaForCausalLM of `spec` with random weights from `seed` (the same weights for every variant)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**spec.config))


# --- per-thread CPU time ----------------------------------------------------------------------------------------


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every thread of this process so far, by name (shard 0 runs in the main thread, shard r > 0 in
    the worker "tensorshard-r"), from the scheduler's nanosecond counters (/proc/self/task/*/schedstat)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            on_cpu = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[names.get(int(tid), "other")] += int(on_cpu) / 1e9
    return out


def shard_of(thread: str) -> int | None:
    if thread == "MainThread":
        return 0
    if thread.startswith("tensorshard-"):
        return int(thread.rsplit("-", 1)[1])
    return None


# --- the in-process engine: every device count in one process -----------------------------------------------------


def inprocess_job(kind: str, worlds: list[int], rounds: int, quick: bool, device: str) -> dict:
    import torch

    import tensorshard as tp

    torch.set_num_threads(1)
    spec = spec_for(kind, quick)
    vocab = spec.config["vocab_size"]
    g = torch.Generator().manual_seed(0)
    if kind == "decode":
        inputs = torch.randint(3, vocab, (1, spec.prompt), generator=g)
    else:
        inputs = torch.randint(0, vocab, (spec.batch, spec.seq), generator=g)
    devices = (lambda n: ["cpu"] * n) if device == "cpu" else (lambda n: [f"cuda:{i}" for i in range(n)])

    variants = []  # (label, devices, step function)
    for n in [0, *worlds]:  # 0: the unsplit model
        model = llama(spec).train(kind == "train")
        if n:
            model = tp.tensor_parallel(model, devices(n))
        elif device != "cpu":
            model = model.to("cuda:0")
        variants.append((n, _step(kind, model, inputs, spec), model))

    def sync():
        if device != "cpu":
            for i in range(torch.cuda.device_count()):
                torch.cuda.synchronize(i)

    records = defaultdict(list)
    for _, step, _ in variants:  # warm-up; calls without gradients: as many as the engine's schedule times each way
        for _ in range(1 if kind == "train" else 4):
            step()
    for _ in range(rounds):
        for n, step, _ in variants:
            sync()
            before, cpu0, t0 = thread_cpu(), time.process_time(), time.perf_counter()
            with tp.shard_timeline() as timeline:
                step()
                sync()
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            after = thread_cpu()
            per_shard = [0.0] * max(n, 1)
            for name, seconds in after.items():
                rank = shard_of(name)
                if rank is not None and rank < len(per_shard):
                    per_shard[rank] += seconds - before.get(name, 0.0)
            records[n].append({"wall": wall, "cpu": cpu, "shard_cpu": per_shard, **timeline.summary()})
    per_unit = spec.new_tokens if kind == "decode" else 1
    return {"kind": kind, "size": spec.config, "per": "token" if kind == "decode" else "step",
            "variants": [{**_summarise(n, records[n], per_unit), "schedule": _schedule_of(model)} for n, _, model in variants]}


def _schedule_of(model) -> list[str]:
    """How the engine runs this model's calls without gradients (engines/inprocess/schedule.py): the ways chosen."""
    schedule = getattr(model, "_schedule", None)
    return sorted({schedule.chosen(k) or "undecided" for k in schedule._kinds}) if schedule is not None else []


def _step(kind: str, model, inputs, spec):
    import torch

    if kind == "forward":
        model.eval()

        def step():
            with torch.no_grad():
                model(input_ids=inputs)
    elif kind == "train":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)  # plain, over every parameter: what users write

        def step():
            model(input_ids=inputs, labels=inputs).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        model.eval()

        def step():
            with torch.no_grad():
                model.generate(inputs, max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens, do_sample=False)
    return step


def _summarise(n: int, rows: list[dict], per_unit: int) -> dict:
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    wall = med("wall")
    shard_cpu = [statistics.median(r["shard_cpu"][i] for r in rows) for i in range(max(n, 1))]
    return {
        "devices": n,  # 0: the unsplit model
        "wall": wall / per_unit, "wall_all": [r["wall"] / per_unit for r in rows],
        "cpu": med("cpu") / per_unit,
        "shard_cpu": [c / per_unit for c in shard_cpu],
        "waiting": statistics.median(statistics.fmean(r["waiting"]) if r["waiting"] else 0.0 for r in rows) / per_unit,
        "one_running": (med("one_running") if n else wall) / per_unit,
    }


# --- the torchrun engine: one process per rank -----------------------------------------------------------------------


def torchrun_runs(kind: str, worlds: list[int], rounds: int, quick: bool, device: str) -> dict:
    """The same model and kind under torchrun, one process per rank (suite/scaling_torchrun.py), in this file's
    form. Time at collectives is the guard's (waiting for the other ranks included); "one running" is not
    measured across processes."""
    from suite.scaling_torchrun import sweep

    if device != "cpu":
        raise SystemExit("--engines torchrun measures CPU ranks only here; on GPUs run suite/scaling_torchrun.py")
    spec = spec_for(kind, quick)
    results = sweep(spec, worlds, kinds=[kind], rounds=rounds, unsplit=True)
    variants = []
    for r in results:
        k = r["kinds"][kind]
        variants.append({"devices": 0 if r["unsplit"] else r["world"], "wall": k["wall_s"], "wall_all": k["wall_all"],
                         "cpu": k["cpu_s"], "shard_cpu": k["cpu_per_rank_s"],
                         "waiting": statistics.fmean(k["collective_s"]) if not r["unsplit"] else 0.0,
                         "one_running": None, "collectives": k["collectives"], "bytes": k["bytes"]})
    return {"kind": kind, "size": spec.config, "per": "token" if kind == "decode" else "step", "variants": variants}


# --- main -------------------------------------------------------------------------------------------------------------


def derived(result: dict, cores: int) -> dict:
    """Speed-up, work inflation, cores busy and shares of the wall time, against the unsplit model of the same run."""
    base = next(v for v in result["variants"] if v["devices"] == 0)
    for v in result["variants"]:
        n = max(v["devices"], 1)
        v["speedup"] = base["wall"] / v["wall"]
        v["work_inflation"] = v["cpu"] / base["cpu"]
        v["cores_busy"] = v["cpu"] / (v["wall"] * min(cores, n))
        v["waiting_share"] = v["waiting"] / v["wall"]
        v["one_running_share"] = v["one_running"] / v["wall"] if v["one_running"] is not None else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--engines", nargs="+", choices=("inprocess", "torchrun"), default=["inprocess", "torchrun"])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up call each)")
    parser.add_argument("--quick", action="store_true", help="small models: checks that everything runs")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default=str(BENCH / "results" / "scaling.json"))
    parser.add_argument("--job", choices=KINDS, help=argparse.SUPPRESS)  # internal: one in-process job, JSON on stdout
    args = parser.parse_args()

    if args.job:
        print(json.dumps(inprocess_job(args.job, args.devices, args.rounds, args.quick, args.device)))
        return

    cores = len(os.sched_getaffinity(0))
    out = {"meta": _meta(args, cores), "inprocess": {}, "torchrun": {}}
    for engine in args.engines:
        for kind in args.kinds:
            print(f"{engine} {kind}: devices {args.devices}", flush=True)
            if engine == "inprocess":
                cmd = [sys.executable, __file__, "--job", kind, "--devices", *map(str, args.devices),
                       "--rounds", str(args.rounds), "--device", args.device, *(["--quick"] if args.quick else [])]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    out[engine][kind] = {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
                    print(done.stderr[-3000:], file=sys.stderr)
                    continue
                result = json.loads(done.stdout.strip().splitlines()[-1])
            else:
                result = torchrun_runs(kind, args.devices, args.rounds, args.quick, args.device)
            out[engine][kind] = derived(result, cores) if "variants" in result else result
            for v in out[engine][kind].get("variants", []):
                print(f"  {v['devices'] or 'unsplit':>7}: {v['wall'] * 1e3:9.2f} ms  speed-up {v['speedup']:.2f}x  "
                      f"work {v['work_inflation']:.2f}x  cores busy {v['cores_busy']:.2f}", flush=True)
    out["meta"]["load_average_end"] = list(os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{args.out}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


def _meta(args, cores: int) -> dict:
    import platform

    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "cores": cores, "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "torch": torch.__version__, "transformers": transformers.__version__, "quick": args.quick,
            "rounds": args.rounds, "load_average_start": list(os.getloadavg())}


if __name__ == "__main__":
    main()
