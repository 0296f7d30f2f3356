"""The in-process engine's overhead on a GPU: a Llama-style model in bf16, unsplit against the same model split
over one device (one shard: the engine's own cost, no communication), and over every visible GPU when there are
several; per-device peak memory from torch.cuda.max_memory_allocated.

- forward: a (batch, seq) token batch, no gradients (model.eval()).
- train: forward with labels= + backward + AdamW step + zero_grad (model.train()).
- decode: greedy `generate` of `new_tokens` tokens after a `prompt`-token prompt, KV cache on (ms per token).

Each time is the median of `repeats` timed calls after one warm-up call, with torch.cuda.synchronize() around
each; the unsplit and split models are timed in interleaved rounds (both stay on the GPU), so drift hits both
alike. Memory per device: the weights the model holds there, and each task's peak above them (activations,
gradients, AdamW state, the KV cache). Writes benchmarks/results/gpu.json, benchmarks/results/gpu.md and the
"GPU" section of BENCHMARKS.md (render.py keeps it when it rewrites the file).

    python benchmarks/gpu.py                    # TinyLlama-1.1B's shape, random weights (~30 GB peak at batch 4 x 512)
    python benchmarks/gpu.py --size small       # ~110M parameters, for a small GPU or a quick check
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import tensorshard as tp

BENCH = Path(__file__).resolve().parent
TITLE = "## GPU: the engine's overhead at one shard"

SIZES = {  # LlamaConfig fields; "1b" is TinyLlama-1.1B's shape
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=32000),
}


def require_cuda() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise SystemExit(
            f"benchmarks/gpu.py measures on a GPU, and none is visible here (torch {torch.__version__}, {build}; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Run it on a CUDA machine; on "
            "CPU, benchmarks/speed.py measures the same tasks."
        )


def build(size: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM  # deferred: the benchmark's only transformers use

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=2048, attn_implementation="sdpa", **SIZES[size])
    with torch.device("cuda:0"):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def _bytes_by_device(model) -> dict[str, int]:
    if isinstance(model, tp.TensorParallel):
        return dict(model.memory_per_device())
    return {"cuda:0": sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))}


class Task:
    """One timed call of a model, with what it needs set up once (optimizer, inputs)."""

    def __init__(self, name: str, model, args) -> None:
        self.name, self.model = name, model
        gen = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size
        self.ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(model.device)
        self.prompt = torch.randint(0, vocab, (1, args.prompt), generator=gen).to(model.device)
        self.new_tokens = args.new_tokens
        self.optimizer = None
        if name == "train":
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # as users write it

    def __call__(self) -> None:
        if self.name == "forward":
            self.model.eval()
            with torch.no_grad():
                self.model(input_ids=self.ids)
        elif self.name == "train":
            self.model.train()
            self.model(input_ids=self.ids, labels=self.ids).loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.eval()
            with torch.no_grad():
                self.model.generate(self.prompt, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                    do_sample=False, pad_token_id=0)


def _synchronize() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def timed(call) -> float:
    _synchronize()
    start = time.perf_counter()
    call()
    _synchronize()
    return time.perf_counter() - start


def peak_above_weights(call, devices: list[str]) -> dict[str, int]:
    """Per GPU: the most memory allocated during one call, above what was allocated before it."""
    gpus = [torch.device(d) for d in devices if d.startswith("cuda")]
    before = {}
    for d in gpus:
        torch.cuda.reset_peak_memory_stats(d)
        before[str(d)] = torch.cuda.memory_allocated(d)
    call()
    _synchronize()
    return {str(d): torch.cuda.max_memory_allocated(d) - before[str(d)] for d in gpus}


def measure(args) -> dict:
    dtype = getattr(torch, args.dtype)
    gpus = torch.cuda.device_count()
    unsplit = build(args.size, dtype)
    models = {"unsplit": (unsplit, ["cuda:0"]), "1 shard": (tp.tensor_parallel(copy.deepcopy(unsplit), ["cuda:0"]), ["cuda:0"])}
    if gpus > 1 and not args.one_gpu:
        every = [f"cuda:{i}" for i in range(gpus)]
        models[f"{gpus} GPUs"] = (tp.tensor_parallel(copy.deepcopy(unsplit), every), every)
    result = {"weights": {k: _bytes_by_device(m) for k, (m, _) in models.items()}, "tasks": {}}
    for task in ("forward", "train", "decode"):
        calls = {k: Task(task, m, args) for k, (m, _) in models.items()}
        peaks = {k: peak_above_weights(call, models[k][1]) for k, call in calls.items()}  # also the warm-up
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(args.repeats):
            for k, call in calls.items():  # interleaved rounds
                times[k].append(timed(call))
        for call in calls.values():
            call.optimizer = None  # AdamW state freed before the next task
        per = (args.new_tokens if task == "decode" else 1)
        result["tasks"][task] = {
            k: {"median_s": statistics.median(t) / per, "min_s": min(t) / per, "peak_above_weights": peaks[k]}
            for k, t in times.items()
        }
        torch.cuda.empty_cache()
        print(f"{task}: " + ", ".join(f"{k} {v['median_s'] * 1e3:.2f} ms" for k, v in result["tasks"][task].items()), flush=True)
    return result


# --- reporting ---------------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def section(run: dict) -> str:
    """The GPU section of BENCHMARKS.md, from a run's results."""
    meta, res = run["meta"], run["result"]
    size = SIZES[meta["size"]]
    lines = [
        TITLE, "",
        f"Measured {meta['date']} on {meta['gpus']} ({meta['gpu_count']} visible), torch {meta['torch']} (CUDA "
        f"{meta['cuda']}), transformers {meta['transformers']}, Python {meta['python']}, by `python benchmarks/gpu.py"
        f"{' --size ' + meta['size'] if meta['size'] != '1b' else ''}`. A Llama-style model with random weights in "
        f"{meta['dtype']} (hidden {size['hidden_size']}, MLP {size['intermediate_size']}, {size['num_hidden_layers']} "
        f"layers, {size['num_attention_heads']} heads over {size['num_key_value_heads']} KV heads, vocabulary "
        f"{size['vocab_size']}: {meta['parameters'] / 1e9:.2f}B parameters); forward and training step on a "
        f"({meta['batch']}, {meta['seq']}) batch, greedy decoding of {meta['new_tokens']} tokens after a "
        f"{meta['prompt']}-token prompt. Medians of {meta['repeats']} calls after a warm-up, unsplit and split timed in "
        "interleaved rounds. `1 shard` is `tp.tensor_parallel(model, [\"cuda:0\"])`: the engine's cost alone.", "",
    ]
    names = list(res["weights"])
    header = ["", *names, *(f"{n} / unsplit" for n in names[1:])]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for task, label in (("forward", "forward (ms)"), ("train", "training step (ms)"), ("decode", "decoding (ms per token)")):
        row = res["tasks"][task]
        base = row["unsplit"]["median_s"]
        cells = [f"{row[n]['median_s'] * 1e3:.2f}" for n in names] + [f"{row[n]['median_s'] / base:.2f}x" for n in names[1:]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Memory per GPU (GiB, `torch.cuda.max_memory_allocated`): the weights each device holds, and each "
              "task's peak above them (activations, gradients and AdamW state, the KV cache).", ""]
    devices = sorted({d for n in names for d in res["weights"][n]})
    header = ["", *(f"{n}: {d}" for n in names for d in devices if d in res["weights"][n])]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = [("weights", lambda n, d: res["weights"][n][d])]
    rows += [(f"{t} peak above weights", lambda n, d, t=t: res["tasks"][t][n]["peak_above_weights"][d]) for t in ("forward", "train", "decode")]
    for label, value in rows:
        lines.append(f"| {label} | " + " | ".join(_gib(value(n, d)) for n in names for d in devices if d in res["weights"][n]) + " |")
    return "\n".join(lines) + "\n"


def replace_section(text: str, body: str) -> str:
    """`text` (BENCHMARKS.md) with its GPU section replaced by `body` (added before "## The run" if absent)."""
    start = text.find(TITLE)
    if start < 0:
        anchor = text.find("\n## The run")
        start = end = anchor + 1 if anchor >= 0 else len(text)
        body += "\n"
    else:
        following = text.find("\n## ", start + len(TITLE))
        end = following + 1 if following >= 0 else len(text)
        body += "\n" if following >= 0 else ""
    return text[:start] + body + text[end:]


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--one-gpu", action="store_true", help="only cuda:0, even where more GPUs are visible")
    parser.add_argument("--results", default=str(BENCH / "results"))
    parser.add_argument("--out", default=str(BENCH.parent / "BENCHMARKS.md"))
    args = parser.parse_args(argv)
    require_cuda()
    import transformers

    result = measure(args)
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    meta = {
        "date": datetime.date.today().isoformat(), "gpus": ", ".join(names), "gpu_count": torch.cuda.device_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "python": platform.python_version(), "size": args.size, "dtype": args.dtype, "batch": args.batch,
        "seq": args.seq, "prompt": args.prompt, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "parameters": sum(p.numel() for p in build_count(args.size)),
    }
    run = {"meta": meta, "result": result}
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    _write(results / "gpu.json", json.dumps(run, indent=1) + "\n")
    body = section(run)
    _write(results / "gpu.md", body)
    out = Path(args.out)
    _write(out, replace_section(out.read_text() if out.exists() else "", body))
    print(body)
    print(f"wrote {results / 'gpu.json'}, {results / 'gpu.md'} and the GPU section of {out}")


def build_count(size: str):
    """The model's parameters on the meta device (counted, never allocated)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # deferred: as in build()

    with torch.device("meta"):
        return list(LlamaForCausalLM(LlamaConfig(**SIZES[size])).parameters())


if __name__ == "__main__":
    sys.exit(main())
