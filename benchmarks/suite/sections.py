"""The three result sections of BENCHMARKS.md (memory, communication, speed) as markdown lines, and the names
and helpers the renderer and the plots share. Input: the JSON results of memory.py, communication.py and
speed.py; nothing here measures."""

from __future__ import annotations

import json
from pathlib import Path

from suite.targets import median

GIB = 2**30
MIB = 2**20

NAMES = {
    "plain": "unsplit model",
    "ours-inprocess": "**tensorshard, in-process**",
    "ours-torchrun": "**tensorshard, torchrun**",
    "dtensor": "DTensor, guide's plan",
    "hf-tp-plan": "transformers tp_plan",
    "tensor_parallel": "tensor_parallel 2.0",
    "plain (tensor_parallel env)": "unsplit model (transformers 4.31)",
    "plain (end of run)": "unsplit model, again at the end",
}
PLOT_NAMES = {k: v.replace("**", "") for k, v in NAMES.items()}
SHORT = {"ours-inprocess": "tensorshard\nin-process", "ours-torchrun": "tensorshard\ntorchrun", "dtensor": "DTensor\nguide's plan",
         "hf-tp-plan": "transformers\ntp_plan", "tensor_parallel": "tensor_parallel\n2.0"}
DISTRIBUTED_SYSTEMS = {"ours-torchrun", "dtensor", "hf-tp-plan"}
GUIDE_GB = {1: 4.04, 2: 2.03, 4: 1.02, 8: 0.60}  # Lightning guide, FeedForward(8192, 8192), GB per GPU


def load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def name(system: str) -> str:
    return NAMES.get(system, system)


def fmt_err(error: str) -> str:
    return error.replace("|", "\\|").replace("\n", " ")[:400]



# --- memory -----------------------------------------------------------------------------------------------------


def memory_section(memory: dict | None, plots: dict) -> list[str]:
    if memory is None:
        return ["## 1. Memory scaling", "", "Not measured in this run (`benchmarks/memory.py`).", ""]
    sizes = memory["sizes"]
    ff, ll = sizes["ff"], sizes["llama"]
    lines = [
        "## 1. Memory scaling",
        "",
        "Per-device memory during a training step (AdamW), at " + "/".join(str(w) for w in sizes["worlds"]) + " devices. "
        "**What is measured**, per device (a CPU slot of an in-process engine, or one process of a torchrun-based "
        "system), after one warm-up step: the bytes of the parameters, gradients and AdamW state it holds (the "
        "local shards of DTensors), plus the activations autograd saves for backward during its forward (distinct "
        "storages, parameters excluded; recorded with `saved_tensors_hooks` in the thread that runs that "
        "device's forward). Their sum is the live tensor memory at the step's peak, before the optimizer's own "
        "temporaries. The ideal is the unsplit model's sum / N. **Split weights** are the parameters our plan "
        "splits (every Linear and the embedding and output head of the Llama; not the norms) with their gradients "
        "and AdamW state; ours must be within 5% of 1/N of the unsplit model's. Resident memory (RSS, the "
        "process's peak during the measured step) is in the second table of each model.",
        "",
    ]
    for model, title in (("ff", f"FeedForward({ff['dim']}, {ff['hidden']}), batch ({ff['batch']}, {ff['dim']}), loss = output.sum()"),
                         ("llama", f"Llama-style, {_llama_desc(ll)}, batch ({ll['batch']}, {ll['seq']}) tokens")):
        lines += _memory_model(memory, model, title, sizes["worlds"], plots.get(f"memory_{model}"))
        if model == "llama":
            lines += [
                "What keeps the Llama's totals above 1/N for every system: activations of what no plan splits. "
                "Each device holds the whole residual stream, the norms' inputs and outputs, and, with the output "
                "head gathered (ours, transformers, tensor_parallel), the full logits and the loss's log-softmax "
                "((batch x seq) x vocabulary floats each). A vocabulary-parallel loss (`tp.VocabParallelHead()` + "
                "`tp.vocab_parallel_cross_entropy`, torchrun engine) and sequence parallelism split those too. "
                "DTensor with the guide's plan keeps the embedding and the output head whole (a third of this "
                "model's weights) on every device; transformers' plan keeps the output head's gradient whole.", ""]
    failed = [r for r in memory["runs"] if not r.get("ok")]
    if failed:
        lines += ["Runs that could not run, with their error:", ""]
        for r in failed:
            lines.append(f"- {PLOT_NAMES.get(r['system'], r['system'])}, {r['model']}, {r['world']} devices: `{fmt_err(r.get('error', '?'))}`")
        lines.append("")
    return lines


def _llama_desc(ll: dict) -> str:
    h, i, l, v = ll["hidden_size"], ll["intermediate_size"], ll["num_hidden_layers"], ll["vocab_size"]
    params = v * h * 2 + l * (2 * h * h + 2 * h * (h * ll["num_key_value_heads"] // ll["num_attention_heads"]) + 3 * h * i + 2 * h) + h
    return (f"{params / 1e6:.0f}M parameters (hidden {h}, MLP {i}, {l} layers, {ll['num_attention_heads']} heads, "
            f"{ll['num_key_value_heads']} KV heads, vocabulary {v})")


def _runs(memory, model):
    return {(r["system"], r["world"]): r for r in memory["runs"] if r["model"] == model}


def _max(devices: list[dict], key: str) -> int:
    return max(d.get(key, 0) for d in devices)


def _memory_model(memory, model, title, worlds, plot) -> list[str]:
    runs = _runs(memory, model)
    plain = runs.get(("plain", 1))
    cuda = memory["meta"].get("device") == "cuda"
    lines = [f"### {title}", ""]
    if plain is None or not plain.get("ok"):
        return lines + ["The unsplit model's run failed; no ratios.", ""]
    base_total, base_split = plain["devices"][0]["total"], plain["devices"][0]["split_state"]
    head = "| system | " + " | ".join(f"{w} device{'s' if w > 1 else ''}" for w in worlds) + " |"
    lines += ["Per-device memory, GiB (largest device), and its ratio to the ideal 1/N of the unsplit model:", "",
              head, "|---|" + "---:|" * len(worlds)]
    lines.append("| ideal (unsplit / N) | " + " | ".join(f"{base_total / w / GIB:.3f}" for w in worlds) + " |")
    if model == "ff":
        lines.append("| Lightning guide, GPU, `max_memory_allocated` (GB) | " + " | ".join(
            f"{GUIDE_GB[w]:.2f} GB" if w in GUIDE_GB else "–" for w in worlds) + " |")
    for system in ("plain", "ours-inprocess", "ours-torchrun", "dtensor", "hf-tp-plan", "tensor_parallel"):
        cells = []
        for w in worlds:
            r = runs.get((system, w))
            if system == "plain" and w > 1:
                cells.append("")
            elif r is None:
                cells.append("–")
            elif not r.get("ok"):
                cells.append("n/a" if r.get("skipped") else "failed")
            else:
                total = _max(r["devices"], "total")
                cells.append(f"{total / GIB:.3f} ({total * w / base_total:.2f}x)")
        if any(cells):
            lines.append(f"| {name(system)} | " + " | ".join(cells) + " |")
    lines.append("")
    # split weights: ours must be within 5% of 1/N
    lines += ["Split weights (parameters + gradients + AdamW state of the layers our plan splits) per device, "
              "as a ratio to 1/N of the unsplit model's (1.00 = ideal; ours must be ≤ 1.05):", "",
              head, "|---|" + "---:|" * len(worlds)]
    for system in ("ours-inprocess", "ours-torchrun", "dtensor", "hf-tp-plan", "tensor_parallel"):
        cells = []
        for w in worlds:
            r = runs.get((system, w))
            if r is None or not r.get("ok"):
                cells.append("–")
                continue
            ratio = _max(r["devices"], "split_state") * w / base_split
            mark = "" if not system.startswith("ours") else (" ✓" if ratio <= 1.05 else " ✗")
            cells.append(f"{ratio:.3f}{mark}")
        lines.append(f"| {name(system)} | " + " | ".join(cells) + " |")
    lines.append("")
    # parts and RSS
    lines += ["Parts at the largest device count, per device (MiB), and resident memory (peak during the step, "
              "per process; an in-process engine is one process for all its devices):", "",
              "| system | devices | parameters | gradients | AdamW state | activations | peak RSS | RSS before the model |"
              + (" GPU peak |" if cuda else ""),
              "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if cuda else "")]
    top = max(worlds)
    for system in ("plain", "ours-inprocess", "ours-torchrun", "dtensor", "hf-tp-plan", "tensor_parallel"):
        w = 1 if system == "plain" else top
        r = runs.get((system, w))
        if r is None or not r.get("ok"):
            continue
        d = max(r["devices"], key=lambda x: x["total"])
        rss = r.get("rss_per_rank") or [r.get("rss", {})]
        peak = max(x.get("step_peak", 0) for x in rss)
        base = max(x.get("base", 0) for x in rss)
        lines.append(f"| {name(system)} | {w} | {d['params'] / MIB:.1f} | {d['grads'] / MIB:.1f} | {d['optim'] / MIB:.1f} | "
                     f"{d['activations'] / MIB:.1f} | {peak / GIB:.2f} GiB | {base / GIB:.2f} GiB |"
                     + (f" {d.get('cuda_peak', 0) / GIB:.2f} GiB |" if cuda else ""))
    lines.append("")
    if plot:
        lines += [f"![per-device memory, {model}]({plot})", ""]
    return lines


# --- communication ----------------------------------------------------------------------------------------------


def comm_section(comm: dict | None, plots: dict) -> list[str]:
    if comm is None:
        return ["## 2. Communication", "", "Not measured in this run (`benchmarks/communication.py`).", ""]
    ll = comm["sizes"]["llama"]
    lines = [
        "## 2. Communication",
        "",
        f"Collectives per transformer block of the Llama-style model at 2 devices, batch ({ll['batch']}, {ll['seq']}) "
        "tokens: the count (and MiB per device of the collectives' results) of a model with 2 layers minus one "
        "with 1 layer. The rest of the model (\"ends\": embedding, output head, loss, ZeRO-3 gather) is the "
        "1-layer count minus one block. Decode = one greedy decode step with the KV cache (batch 1). Counted by "
        "`tp.count_collectives()` (ours), torch's `CommDebugMode` (torchrun-based systems; for ours it agrees "
        "with our counter, shown when both ran), and by wrapping tensor_parallel 2.0's collective objects "
        "(it has no backward collectives of its own: autograd sums the gradients of the copies where the "
        "forward collective joined them; counted as the collective that amounts to). Our in-process engine's "
        "default in training, ZeRO-3 for the parameters the plan leaves whole, adds one all-gather per call "
        "(an end), whose bytes grow by the block's two norm weights (8 KiB here) per block. tensor_parallel "
        "2.0 also all-gathers every layer's KV cache whenever the model returns one (transformers 4.31 does "
        "so in training too).",
        "",
        "| system | forward / block | backward / block | decode / block | ends: forward | ends: backward |",
        "|---|---|---|---|---|---|",
    ]
    for system in ("ours-inprocess", "ours-torchrun", "dtensor", "hf-tp-plan", "tensor_parallel"):
        one = next((r for r in comm["runs"] if r["system"] == system and r["layers"] == 1), None)
        two = next((r for r in comm["runs"] if r["system"] == system and r["layers"] == 2), None)
        if one is None or two is None or not one.get("ok") or not two.get("ok"):
            err = next((r.get("error") for r in (one, two) if r is not None and not r.get("ok")), "not run")
            lines.append(f"| {name(system)} | failed: `{fmt_err(err)}` | | | | |")
            continue
        cells = []
        agree = True
        for phase in ("forward", "backward", "decode"):
            c1, b1, c2, b2, ok = _phase(one, two, phase)
            agree &= ok
            cells.append(_counts(_diff(c2, c1), b2 - b1))
        for phase in ("forward", "backward"):
            c1, b1, c2, b2, _ = _phase(one, two, phase)
            per, per_b = _diff(c2, c1), b2 - b1
            cells.append(_counts(_diff(c1, per), b1 - per_b))
        label = name(system) + ("" if agree else " (counters disagree!)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    if plots.get("comm"):
        lines += [f"![collectives per block]({plots['comm']})", ""]
    return lines


def _phase(one, two, phase):
    def pick(run):
        rec = run["phases"].get(phase, {})
        counters = list(rec.values())
        if not counters:
            return {}, 0, True
        first = counters[0]
        agree = all(c["counts"] == first["counts"] for c in counters)
        return first["counts"], first["bytes"], agree

    c1, b1, a1 = pick(one)
    c2, b2, a2 = pick(two)
    return c1, b1, c2, b2, a1 and a2


def _diff(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b) if a.get(k, 0) - b.get(k, 0)}


def _counts(counts: dict, nbytes: int) -> str:
    if not counts:
        return "none"
    text = ", ".join(f"{n} {k.replace('_', '-')}" for k, n in sorted(counts.items()))
    return f"{text} ({nbytes / MIB:.2f} MiB)" if nbytes >= 0.01 * MIB else f"{text} ({nbytes / 1024:.1f} KiB)"


def comm_per_block(comm: dict) -> dict:
    out = {}
    for system in ("ours-inprocess", "ours-torchrun", "dtensor", "hf-tp-plan", "tensor_parallel"):
        one = next((r for r in comm["runs"] if r["system"] == system and r["layers"] == 1 and r.get("ok")), None)
        two = next((r for r in comm["runs"] if r["system"] == system and r["layers"] == 2 and r.get("ok")), None)
        if one and two:
            out[system] = {p: sum(_diff(_phase(one, two, p)[2], _phase(one, two, p)[0]).values()) for p in ("forward", "backward", "decode")}
    return out


# --- speed ------------------------------------------------------------------------------------------------------


SPEED_ROWS = ("plain", "ours-inprocess", "ours-torchrun", "dtensor", "hf-tp-plan", "plain (tensor_parallel env)",
              "tensor_parallel", "plain (end of run)")


def speed_section(speed: dict | None, plots: dict) -> list[str]:
    if speed is None:
        return ["## 3. Speed on CPU", "", "Not measured in this run (`benchmarks/speed.py`).", ""]
    ll = speed["sizes"]["llama"]
    reps = speed["sizes"]["repeats"]
    lines = [
        "## 3. Speed" + (" on CPU" if speed["meta"].get("device") != "cuda" else " on GPU"),
        "",
        f"The Llama-style model ({_llama_desc(ll)}). Training step = forward + backward + AdamW step on "
        f"({ll['batch']}, {ll['seq']}) tokens; forward = the same batch without gradients; generation = greedy, "
        f"{ll['new_tokens']} new tokens after a {ll['prompt']}-token prompt, KV cache on, reported per token. Each "
        f"cell: median of {reps} timed calls after a warm-up [min – max]. In-process systems of one environment "
        "were timed in interleaved rounds; every other system in its own processes right after. Ratios: "
        "\"vs 1 device\" = the system's 1-device time / its 2-device time (speed-up); \"vs unsplit\" = time / the "
        "unsplit model's time (below 1 is faster). \"CPU work\" = CPU seconds spent by all devices together (every "
        "thread of the process; for torchrun-based systems rank 0's times the number of ranks) / the unsplit "
        "model's: the extra work tensor parallelism costs, which the load of a shared machine does not blur "
        "(1.00 = none). tensor_parallel 2.0 is compared with the unsplit model of its own environment "
        "(transformers 4.31). Every system trains with `torch.optim.AdamW(model.parameters())` as users write it (the "
        "in-process engine steps each device's parameters in its shard's thread by itself).",
        "",
    ]
    for task, metric, title in (("train", "step", "Training step"), ("infer", "forward", "Forward (no gradients)"),
                                ("infer", "generate", "Greedy generation")):
        lines += _speed_table(speed, task, metric, title)
    lines += [
        "Our in-process engine runs every shard's backward pass in that shard's thread (each shard owns its "
        "autograd graph; docs/inprocess.md), so its training step scales like its forward. tensor_parallel 2.0's "
        "call is one autograd graph, whose CPU backward PyTorch runs in one thread: its shards' backward passes "
        "run one after the other.", ""]
    tokens = _token_check(speed)
    if tokens:
        lines += [tokens, ""]
    if speed.get("failed"):
        lines += ["Runs that failed, with their error:", ""]
        for f in speed["failed"]:
            lines.append(f"- {PLOT_NAMES.get(f['system'], f['system'])} ({f['task']}, {f['world']} devices): `{fmt_err(f['error'])}`")
        lines.append("")
    if plots.get("speed"):
        lines += [f"![speed ratios]({plots['speed']})", ""]
    return lines


def _speed_table(speed, task, metric, title) -> list[str]:
    per_token = metric == "generate"
    unit = "ms per token" if per_token else ("s" if task == "train" else "ms")
    scale = 1e3 if unit.startswith("ms") else 1.0
    worlds = speed["sizes"]["speed_worlds"]
    lines = [f"### {title} ({unit})", "",
             "| system | " + " | ".join(f"{w} device{'s' if w > 1 else ''}" for w in worlds)
             + " | speed-up, 2 vs 1 | vs unsplit, 1 device | vs unsplit, 2 devices | CPU work, 2 devices |",
             "|---|" + "---:|" * (len(worlds) + 4)]
    for system in SPEED_ROWS:
        cells, meds, work = [], {}, {}
        for w in worlds:
            v = next((x for x in speed.get(task, []) if x["system"] == system and x["world"] == w and metric in x), None)
            if v is None:
                cells.append("–" if not system.startswith("plain") or w == 1 else "")
                continue
            s = v[metric]
            if "cpu" in s:  # CPU seconds of the process (all threads); a torchrun job reports rank 0's
                work[w] = s["cpu"]["median"] * (w if system in DISTRIBUTED_SYSTEMS else 1)
            div = v.get("new_tokens", 1) if per_token else 1
            meds[w] = s["median"] / div
            cells.append(f"{s['median'] / div * scale:.{_digits(s['median'] / div * scale)}f} "
                         f"[{s['min'] / div * scale:.{_digits(s['min'] / div * scale)}f} – {s['max'] / div * scale:.{_digits(s['max'] / div * scale)}f}]")
        if not meds:
            continue
        ref = "plain (tensor_parallel env)" if system == "tensor_parallel" else "plain"
        base = median(speed, task, ref, 1, metric)
        base = base / (_new_tokens(speed) if per_token else 1) if base else None
        one, two = meds.get(1), meds.get(2)
        speedup = f"{one / two:.2f}x" if one and two else ""
        vs1 = f"{one / base:.2f}x" if one and base and not system.startswith("plain") else ""
        vs2 = f"{two / base:.2f}x" if two and base else ""
        if system == "plain (end of run)" and one and base:
            vs1 = f"{one / base:.2f}x (drift)"
        base_v = next((x for x in speed.get(task, []) if x["system"] == ref and x["world"] == 1 and metric in x), None)
        base_work = base_v[metric].get("cpu", {}).get("median") if base_v else None
        cpu = f"{work[2] / base_work:.2f}x" if work.get(2) and base_work else ""
        lines.append(f"| {name(system)} | " + " | ".join(cells) + f" | {speedup} | {vs1} | {vs2} | {cpu} |")
    return lines + [""]


def _digits(x: float) -> int:
    return 0 if x >= 100 else 1 if x >= 10 else 2 if x >= 1 else 3


def _new_tokens(speed) -> int:
    return speed["sizes"]["llama"]["new_tokens"]


def _token_check(speed) -> str:
    seqs = {(v["system"], v["world"]): v.get("tokens") for v in speed.get("infer", []) if v.get("tokens")}
    if not seqs:
        return ""
    ref = seqs.get(("plain", 1))
    differ = [f"{PLOT_NAMES.get(s, s)} at {w}" for (s, w), t in seqs.items() if t != ref]
    if not differ:
        return f"All {len(seqs)} generation runs produced the same {len(ref or [])} greedy tokens (same weights everywhere)."
    return ("Greedy tokens identical to the unsplit model's, except: " + ", ".join(differ)
            + " (float rounding differs between plans; a near-tie can flip a token).")


