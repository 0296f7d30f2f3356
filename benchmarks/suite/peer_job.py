"""The same jobs as job.py, for the `tensor_parallel` package (2.0.0) in its own environment.

tensor_parallel 2.0 needs transformers<=4.35 (it breaks on 5.x), so it runs with the interpreter of
.venv-bench-peers (torch 2.13, transformers 4.31, accelerate 0.20.3); the unsplit model of that
environment is timed beside it, so its ratios compare like with like. The models are built from the same
sizes (config.py) and the Llama loads the same weights (the benchmark checkpoint's model.safetensors).

    .venv-bench-peers/bin/python benchmarks/suite/peer_job.py --task train --model llama \
        --systems plain tensor_parallel:1 tensor_parallel:2 --sizes '...' --checkpoint DIR --out r.json

Systems: ``plain`` and ``tensor_parallel:N`` (`tp.tensor_parallel(model, devices)`, the one-line call:
its preset for Llama, its automatic config for other models; sharded=None, i.e. off).

Collectives: tensor_parallel has no counter, so this file counts the calls of its collective objects
(communications.AllReduce, AllGather, and CollectiveOperation, which gathers the KV cache in generation),
once per collective (on rank 0). It has no explicit backward collectives: autograd carries gradients back
through the cross-device copies, and at each forward collective the gradients of every device's copy are
summed (an all-reduce for an all-reduce, a reduce-scatter for an all-gather). A marker on rank 0's output
counts those when backward reaches them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

import torch  # noqa: E402

from suite import measure  # noqa: E402
from suite.job_io import job_parser, write_result  # noqa: E402
from suite.config import FeedForward, Sizes, ff_batch, is_split_weight, llama_batch, llama_prompt  # noqa: E402


def build(system: str, model_name: str, sizes: Sizes, *, device: str, checkpoint: str | None, train: bool,
          layers: int | None = None):
    """(model, per-device [(name, param)], per-device modules run in that device's thread)."""
    name, _, n = system.partition(":")
    world = int(n) if n else 1
    torch.manual_seed(0)
    if model_name == "ff":
        model = FeedForward(sizes.ff.dim, sizes.ff.hidden)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**sizes.llama.config_kwargs(layers)))
        if checkpoint:
            from safetensors.torch import load_file

            missing, unexpected = model.load_state_dict(load_file(os.path.join(checkpoint, "model.safetensors")), strict=False)
            stray = [k for k in missing if not k.endswith("rotary_emb.inv_freq")] + list(unexpected)
            if stray:
                raise RuntimeError(f"checkpoint does not match the model: {stray[:5]}")
    model.train(train)
    devices = ["cpu"] * world if device == "cpu" else [f"cuda:{i}" for i in range(world)]
    if name == "plain":
        model = model.to(devices[0])
        return model, [list(model.named_parameters())], None
    if name != "tensor_parallel":
        raise ValueError(f"unknown system {system!r}: plain or tensor_parallel:N")
    import tensor_parallel as tp

    wrapped = tp.tensor_parallel(model, devices)
    inner = getattr(wrapped, "wrapped_model", wrapped)  # TensorParallelPreTrainedModel wraps a TensorParallel
    shards = list(inner.module_shards)
    return wrapped, [list(s.named_parameters()) for s in shards], shards


def loss_of(model_name, model, batch):
    if model_name == "ff":
        return model(batch).sum()
    return model(input_ids=batch, labels=batch).loss


# --- counting tensor_parallel's collectives ---------------------------------------------------------------

_counts: dict | None = None
_lock = threading.Lock()


def _record(phase: str, kind: str, nbytes: int) -> None:
    if _counts is None:
        return
    with _lock:
        entry = _counts.setdefault(phase, {"counts": {}, "bytes": 0})
        entry["counts"][kind] = entry["counts"].get(kind, 0) + 1
        entry["bytes"] += nbytes


class _BackwardMark(torch.autograd.Function):
    """Identity; counts, when backward reaches it, the reduction autograd does across the copies."""

    @staticmethod
    def forward(ctx, x, kind):
        ctx.kind = kind
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _record("backward", ctx.kind, grad.numel() * grad.element_size())
        return grad, None


def _mark(y, kind: str, rank: int):
    if rank == 0 and isinstance(y, torch.Tensor) and y.requires_grad:
        return _BackwardMark.apply(y, kind)
    return y


def instrument() -> None:
    from tensor_parallel import communications as c

    all_reduce, all_gather, collective = c.AllReduce.__call__, c.AllGather.__call__, c.CollectiveOperation.__call__

    def counted_all_reduce(self, x, rank):
        y = all_reduce(self, x, rank)
        if rank == 0:
            _record(_phase(), "all_reduce", x.numel() * x.element_size())
        return _mark(y, "all_reduce", rank)

    def counted_all_gather(self, x, rank):
        y = all_gather(self, x, rank)
        if self.barrier is None:  # the second half of an AllReduce, counted there
            return y
        if rank == 0:
            _record(_phase(), "all_gather", y.numel() * y.element_size())
        return _mark(y, "reduce_scatter", rank)

    def counted_collective(self, x, rank):
        y = collective(self, x, rank)
        if rank == 0:
            kind = {"NCCLAllReduce": "all_reduce", "NCCLAllGather": "all_gather"}.get(type(self).__name__, "all_gather (KV cache)")
            leaves = [t for t in _leaves(y) if isinstance(t, torch.Tensor)]
            _record(_phase(), kind, sum(t.numel() * t.element_size() for t in leaves))
        return y

    c.AllReduce.__call__, c.AllGather.__call__, c.CollectiveOperation.__call__ = (
        counted_all_reduce, counted_all_gather, counted_collective)


def _leaves(x):
    if isinstance(x, (list, tuple)):
        for item in x:
            yield from _leaves(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _leaves(item)
    else:
        yield x


_current_phase = "forward"


def _phase() -> str:
    return _current_phase


# --- tasks ----------------------------------------------------------------------------------------------------


def task_memory(args, sizes):
    rss = measure.Rss()
    base = rss.now()
    model, slots, slot_modules = build(args.systems[0], args.model, sizes, device=args.device,
                                       checkpoint=args.checkpoint, train=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    dev = "cpu" if args.device == "cpu" else "cuda:0"
    batch = ff_batch(sizes.ff, dev) if args.model == "ff" else llama_batch(sizes.llama, dev)

    def step(hooks=None):
        with hooks or nullcontext():
            loss = loss_of(args.model, model, batch)
        loss.backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    acts = [measure.SavedActivations(exclude=[p for _, p in slot]) for slot in slots]
    whole = None
    if slot_modules is not None and len(slot_modules) > 1:
        measure.hook_slots(slot_modules, acts)
    else:
        whole = acts[0].hooks()
    if args.device == "cuda":
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)
    rss.reset_peak()
    at_reset = rss.now()
    step(whole)
    peak = rss.peak()
    split = lambda name: is_split_weight(args.model, name)  # noqa: E731
    devices = []
    for r, slot in enumerate(slots):
        rec = measure.device_memory(slot, opt, acts[r].bytes, split)
        if args.device == "cuda" and slot:
            rec["cuda_peak"] = torch.cuda.max_memory_allocated(slot[0][1].device)
        devices.append(rec)
    name, _, n = args.systems[0].partition(":")
    return {"system": name, "world": int(n or 1), "note": "", "devices": devices,
            "rss": {"base": base, "before_step": at_reset, "step_peak": peak}}




def task_comm(args, sizes):
    global _counts, _current_phase
    instrument()
    model, _, _ = build(args.systems[0], "llama", sizes, device=args.device, checkpoint=None, train=True, layers=args.layers)
    dev = "cpu" if args.device == "cpu" else "cuda:0"
    batch = llama_batch(sizes.llama, dev)
    _counts = {}
    _current_phase = "forward"
    loss = loss_of("llama", model, batch)
    _current_phase = "backward"
    loss.backward()
    model.eval()
    prompt = llama_prompt(sizes.llama, dev)
    with torch.no_grad():
        _current_phase = "prefill"
        out = model(input_ids=prompt, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        _current_phase = "decode"
        model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    phases = {p: {"tensor_parallel (instrumented)": _counts.get(p, {"counts": {}, "bytes": 0})} for p in ("forward", "backward", "decode")}
    name, _, n = args.systems[0].partition(":")
    return {"system": name, "world": int(n or 1), "layers": args.layers, "note": "", "phases": phases}


def task_train(args, sizes):
    dev = "cpu" if args.device == "cpu" else "cuda:0"
    variants = []
    for s in args.systems:
        model, _, _ = build(s, args.model, sizes, device=args.device, checkpoint=args.checkpoint, train=True)
        variants.append((s, model, torch.optim.AdamW(model.parameters(), lr=1e-5)))
    batch = ff_batch(sizes.ff, dev) if args.model == "ff" else llama_batch(sizes.llama, dev)

    def step(model, opt):
        def run():
            loss_of(args.model, model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    times = _interleaved([step(m, o) for _, m, o in variants], args)
    return {"variants": [_variant(s, step=t) for (s, _, _), t in zip(variants, times)]}


def task_infer(args, sizes):
    dev = "cpu" if args.device == "cpu" else "cuda:0"
    variants = [(s, build(s, "llama", sizes, device=args.device, checkpoint=args.checkpoint, train=False)[0]) for s in args.systems]
    batch, prompt, new = llama_batch(sizes.llama, dev), llama_prompt(sizes.llama, dev), sizes.llama.new_tokens
    tokens = {}

    def forward(model):
        def run():
            with torch.no_grad():
                model(input_ids=batch)
        return run

    def generate(s, model):
        def run():
            with torch.no_grad():
                ids = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            tokens[s] = ids[0, prompt.shape[1]:].tolist()
        return run

    fwd = _interleaved([forward(m) for _, m in variants], args)
    gen = _interleaved([generate(s, m) for s, m in variants], args)
    return {"variants": [
        _variant(s, forward=f, generate=g, new_tokens=new, tokens=tokens.get(s))
        for (s, _), f, g in zip(variants, fwd, gen)
    ]}


def _variant(spec: str, **fields) -> dict:
    name, _, n = spec.partition(":")
    return {"system": name, "world": int(n or 1), "note": "", **fields}


def _interleaved(fns, args):
    times, cpus = [[] for _ in fns], [[] for _ in fns]
    for fn in fns:
        measure.timed(fn, 0, device=args.device, warmup=1)
    for _ in range(args.repeats):
        for i, fn in enumerate(fns):
            times[i] += measure.timed(fn, 1, device=args.device, warmup=0, cpu=cpus[i])
    return [{**measure.summary(t), "cpu": measure.summary(c)} for t, c in zip(times, cpus)]


def task_probe(args, sizes):
    """Can tensor_parallel split, train and generate with the transformers of the interpreter running this?
    (Run with the main environment's interpreter and --append-path, it shows how it fails on transformers 5.x.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    import tensor_parallel as tp

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = tp.tensor_parallel(LlamaForCausalLM(config), ["cpu"] * 2)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    model.eval()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
    return {}


TASKS = {"memory": task_memory, "comm": task_comm, "train": task_train, "infer": task_infer, "probe": task_probe}


def main() -> None:
    parser = job_parser(__doc__.splitlines()[0], TASKS)
    parser.add_argument("--profile", action="store_true", help="accepted for symmetry with job.py; ignored")
    parser.add_argument("--append-path", default=None, help="a site-packages folder to import tensor_parallel from, "
                        "after this interpreter's own (to try it with another environment's transformers)")
    args = parser.parse_args()
    if args.append_path:
        sys.path.append(args.append_path)
    sizes = Sizes.from_dict(json.loads(args.sizes))
    measure.one_thread()
    try:
        import importlib.metadata

        import transformers

        try:
            tp_version = importlib.metadata.version("tensor_parallel")
        except importlib.metadata.PackageNotFoundError:  # imported through --append-path
            tp_version = "?"
        versions = {"tensor_parallel": tp_version, "transformers": transformers.__version__, "torch": torch.__version__}
        result = {"ok": True, "versions": versions, **TASKS[args.task](args, sizes)}
    except Exception as e:  # noqa: BLE001 - reported in the results with its message
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(e).__name__}: {e}".strip()}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
