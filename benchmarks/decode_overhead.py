"""What the in-process engine's default decoding path (dynamic KV cache, no compile) costs per token, and how
much of it is the engine's own work rather than the model's Python that every shard runs.

    python benchmarks/decode_overhead.py [--devices 1 2 4 8] [--rounds 5] [--tokens 32] [--quick]
                                                        # writes benchmarks/results/decode_overhead.json

Model: benchmarks/scaling.py's decoding model (a small Llama: hidden 256, 8 layers; --quick: the tiny one), batch
1, greedy, one intra-op thread. Everything runs in one process, in interleaved rounds, so every variant sees the
same machine; medians over the rounds. Per token:

- generate: `model.generate(prompt, max_new_tokens=tokens)` of the unsplit model and of the model split over
  1, 2, 4, 8 CPU slots, wall and CPU time (CPU: every thread of the process), and the ratio to the unsplit wall;
- step: one decoding forward call through the cache (no `generate` around it), CPU time;
- shards: the CPU time of every shard's module called directly, in this thread, with its own device's cache
  and its collectives replaced by the identity: the model's Python as each shard runs it, with nothing of the
  engine around it (no boundary, no threads, no rendezvous);
- engine share: (step - the shards' sum) / step: the engine's own work per token (copying inputs, joining
  outputs, the schedule, handing the turn between threads, the collectives themselves), as a share of the step.

CPU times and the engine share are the numbers to compare on a shared machine (wall times need idle cores: run
it alone, `uptime` near 0, and compare runs by their `load_average` fields).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # suite/

import torch

BENCH = Path(__file__).resolve().parent


@contextmanager
def collectives_off():
    """Every collective of the in-process engine returns its input: a shard module then runs on its own, in the
    calling thread (its numbers are wrong; only its cost is looked at)."""
    from tensorshard.comm.threads import ThreadComm

    names = ("all_reduce", "copy_to_parallel", "all_gather", "assemble", "split", "tie")
    kept = {name: ThreadComm.__dict__[name] for name in names}
    for name in names:
        setattr(ThreadComm, name, lambda self, x, *args, **kwargs: x)
    try:
        yield
    finally:
        for name, method in kept.items():
            setattr(ThreadComm, name, method)


class Variant:
    """One model (unsplit: devices 0) and what is timed of it."""

    def __init__(self, devices: int, model, prompt: torch.Tensor, tokens: int) -> None:
        self.devices, self.model, self.prompt, self.tokens = devices, model, prompt, tokens
        self.rows: list[dict] = []
        with torch.no_grad():  # the prompt's cache, kept: every step below decodes one token after it
            out = model(input_ids=prompt, use_cache=True)
        self.cache, self.token = out.past_key_values, out.logits[:, -1:].argmax(-1)

    def generate(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            self.model.generate(self.prompt, max_new_tokens=self.tokens, min_new_tokens=self.tokens, do_sample=False)
        return (time.perf_counter() - wall) / self.tokens, (time.process_time() - cpu) / self.tokens

    def steps(self, n: int) -> float:
        """CPU seconds per decoding forward call, `n` calls through the prompt's cache (cropped back after)."""
        cpu = time.process_time()
        with torch.no_grad():
            for _ in range(n):
                self.model(input_ids=self.token, cache=self.cache, use_cache=True)
        spent = (time.process_time() - cpu) / n
        self.cache.crop(-n)  # transformers 5.24: a negative count removes that many tokens
        return spent

    def shards(self, n: int) -> list[float]:
        """CPU seconds per call of each shard's module alone (see `collectives_off`)."""
        from tensorshard.engines.inprocess.engine import _as_rank
        from tensorshard.integrations.transformers.cache import rank_caches

        if self.devices < 2:
            return []
        per_rank = rank_caches(self.cache)
        spent = []
        with torch.no_grad(), collectives_off():
            for rank, shard in enumerate(self.model.module_shards):
                cpu = time.process_time()
                with _as_rank(rank):
                    for _ in range(n):
                        shard(input_ids=self.token, cache=per_rank[rank], use_cache=True)
                spent.append((time.process_time() - cpu) / n)
                per_rank[rank].crop(-n)
        return spent


def run(worlds: list[int], rounds: int, tokens: int, quick: bool) -> dict:
    import tensorshard as tp
    from scaling import llama, spec_for

    torch.set_num_threads(1)
    spec = spec_for("decode", quick)
    prompt = torch.randint(3, spec.config["vocab_size"], (1, spec.prompt), generator=torch.Generator().manual_seed(0))
    variants = []
    for n in [0, *worlds]:
        model = llama(spec).eval()
        variants.append(Variant(n, tp.tensor_parallel(model, ["cpu"] * n) if n else model, prompt, tokens))
    for v in variants:  # warm-up: allocations, and the engine's schedule timing both ways (schedule.py)
        v.generate()
        v.steps(8)
    for _ in range(rounds):
        for v in variants:
            wall, cpu = v.generate()
            v.rows.append({"wall": wall, "cpu": cpu, "step": v.steps(tokens), "shards": v.shards(tokens)})
    base = statistics.median(r["wall"] for r in variants[0].rows)
    out = []
    for v in variants:
        med = lambda key: statistics.median(r[key] for r in v.rows)  # noqa: E731
        shards = [statistics.median(r["shards"][i] for r in v.rows) for i in range(len(v.rows[0]["shards"]))]
        step = med("step")
        schedule = getattr(v.model, "_schedule", None)
        out.append({
            "devices": v.devices, "wall_ms": med("wall") * 1e3, "cpu_ms": med("cpu") * 1e3, "ratio": med("wall") / base,
            "step_cpu_ms": step * 1e3, "shard_cpu_ms": [s * 1e3 for s in shards],
            "engine_share": (step - sum(shards)) / step if shards else None,
            "ways": sorted({schedule.chosen(k) or "undecided" for k in schedule._kinds}) if schedule else [],
        })
    return {"model": spec.config, "tokens": tokens, "rounds": rounds, "variants": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per generate call (and steps per timing)")
    parser.add_argument("--quick", action="store_true", help="the tiny model: checks that it runs")
    parser.add_argument("--out", default=str(BENCH / "results" / "decode_overhead.json"))
    args = parser.parse_args()
    load = list(os.getloadavg())
    result = run(args.devices, args.rounds, args.tokens, args.quick)
    result.update(date=time.strftime("%Y-%m-%d %H:%M"), cores=len(os.sched_getaffinity(0)), torch=torch.__version__,
                  load_average_start=load, load_average_end=list(os.getloadavg()))
    print(f"per token, {args.rounds} rounds; load average {load[0]:.1f} -> {result['load_average_end'][0]:.1f}")
    print(f"{'devices':>8} {'wall ms':>8} {'x unsplit':>9} {'cpu ms':>7} {'step cpu':>8} {'shards cpu':>10} {'engine':>7}  ways")
    for v in result["variants"]:
        share = f"{v['engine_share']:7.1%}" if v["engine_share"] is not None else f"{'':>7}"
        print(f"{v['devices'] or 'unsplit':>8} {v['wall_ms']:8.2f} {v['ratio']:9.2f} {v['cpu_ms']:7.2f} "
              f"{v['step_cpu_ms']:8.2f} {sum(v['shard_cpu_ms']):10.2f} {share}  {','.join(v['ways'])}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
