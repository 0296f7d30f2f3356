"""Coverage of automatic plans over every causal-LM architecture in transformers.

    PYTHONPATH=src python benchmarks/coverage.py              # resume the sweep, then write docs/coverage.md
    PYTHONPATH=src python benchmarks/coverage.py --only llama gpt2 --redo
    PYTHONPATH=src python benchmarks/coverage.py --table      # rewrite the table from the stored results

For each model type in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: build it from a tiny random config (its
defaults with hidden sizes, layers, heads, experts and vocabulary shrunk), fp32, eval mode. A type that does
not build, or whose forward does not run on ``input_ids`` alone, is counted as *not buildable*, with the
reason. Every other type is split with ``tp.tensor_parallel(model, ["cpu"] * n)`` and no plan (a preset if
one exists, else an inferred, self-checked plan) for n = 2 and 3, and passes when:

- logits on a random batch are within 1e-4 (max absolute difference) of the unsplit model's,
- greedy decoding of 6 tokens is identical (``generate()`` when the split model has it, else a loop of
  full forwards without a cache),
- the largest device holds fewer parameter bytes than the whole model.

Results are appended to benchmarks/results/coverage.jsonl one architecture at a time, so an interrupted
sweep resumes where it stopped (it takes tens of minutes on two CPU cores; run it with nohup).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "coverage.jsonl"
TABLE = ROOT / "docs" / "coverage.md"
WORLDS = (2, 3)
TOL = 1e-4
NEW_TOKENS = 6
TIMEOUT = 600  # seconds per architecture

# Tiny sizes, by config attribute name. Heads 4 with 2 KV heads keeps grouped-query attention in play.
HIDDEN = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim", "embedding_size", "word_embed_proj_dim",
          "attention_hidden_size", "embedding_dim")
FFN = ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim", "encoder_ffn_dim",
       "inner_hidden_size", "mlp_dim", "ff_dim", "dense_intermediate_size", "hidden_dim")
MOE_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
           "moe_ffn_hidden_size", "moe_hidden_size", "shared_intermediate_size", "expert_hidden_size",
           "expert_ffn_hidden_size", "shared_experts_intermediate_size")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
          "num_decoder_layers", "num_encoder_layers", "num_blocks")
HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads", "encoder_attention_heads")
KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "num_kv")
HEAD_DIM = ("head_dim", "attention_head_dim", "kv_channels", "head_size", "attention_head_size")
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k")
SMALL = {"kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
         "n_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 1, "sliding_window": 64,
         "vocab_size": 512, "n_group": 1, "n_groups": 1, "topk_group": 1, "num_expert_group": 1, "num_codebooks": 2, "rotary_dim": 8,
         "state_size": 16, "time_step_rank": 8, "num_kv_shared_layers": 0, "zero_expert_num": 2,
         "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8, "num_layers_per_stack": 1,
         # state-space and linear-attention mixers of hybrid models
         "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_dt_rank": 8, "n_mamba_heads": 2,
         "mamba_d_ssm": 128, "vocab_size_per_layer_input": 512, "hidden_size_per_layer_input": 16, "lru_width": 64,
         "shape_vocab_size": 512, "pronunciation_vocab_size": 512, "shape_embed_dim": 64, "pronunciation_embed_dim": 64,
         "linear_head_dim": 16, "linear_num_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
         "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1}


def tiny_config(model_type: str, keep_layers: bool = False):
    """The default config of `model_type`, shrunk; `keep_layers` keeps the layer count and per-layer lists
    (some hybrids need layers of every kind in a fixed pattern)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    _shrink(cfg, keep_layers=keep_layers)
    return cfg


def _shrink(cfg, depth: int = 0, keep_layers: bool = False) -> None:
    from transformers import PretrainedConfig

    values = cfg.to_dict()
    layers0 = next((values[k] for k in LAYERS if isinstance(values.get(k), int)), None)
    heads0 = next((values[k] for k in HEADS if isinstance(values.get(k), int)), None)

    def put(key, value):
        try:
            setattr(cfg, key, value)
        except Exception:
            pass

    # Layers to keep: two, or the first layer of each kind when a per-layer list names kinds (hybrids).
    pick = None
    if layers0 and layers0 > 2 and not keep_layers:
        kinds = next((v for v in values.values() if isinstance(v, list) and len(v) == layers0
                      and all(isinstance(x, str) for x in v)), None)
        pick = sorted({kinds.index(k) for k in kinds}) if kinds else []
        for i in range(layers0):
            if len(pick) >= 2:
                break
            if i not in pick:
                pick.append(i)
        pick = sorted(pick)
    for key, value in values.items():
        if isinstance(getattr(cfg, key, None), PretrainedConfig) and depth < 2:
            _shrink(getattr(cfg, key), depth + 1, keep_layers)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, list)):
            continue
        if key in HIDDEN and isinstance(value, int):
            put(key, 64)
        elif key in FFN and isinstance(value, int):
            put(key, 128)
        elif key in MOE_FFN and isinstance(value, int):
            put(key, 64)
        elif key in LAYERS and isinstance(value, int):
            if pick is not None:
                put(key, len(pick))
        elif key in HEADS and isinstance(value, int):
            put(key, 4)
        elif key in KV_HEADS and isinstance(value, int):
            put(key, 1 if value == 1 else 4 if heads0 is not None and value >= heads0 else 2)
        elif key in HEAD_DIM and isinstance(value, int):
            put(key, 16)
        elif key in POSITIONS and isinstance(value, int):
            put(key, 256)
        elif key in EXPERTS and isinstance(value, int) and value > 4:
            put(key, 4)
        elif key in TOP_K and isinstance(value, int):
            put(key, min(value, 2))
        elif key in SMALL and isinstance(value, int):
            put(key, SMALL[key])
        elif isinstance(value, list) and pick is not None and len(value) == layers0:
            put(key, [value[i] for i in pick])  # per-layer lists (layer_types, ...)
    # Sizes that must agree with others.
    if "qk_rope_head_dim" in values and "head_dim" in values:
        put("head_dim", SMALL["qk_rope_head_dim"])  # multi-head latent attention: rotary part of the head
    if "qk_head_dim" in values:
        put("qk_head_dim", SMALL["qk_rope_head_dim"] + SMALL["qk_nope_head_dim"])
    if "expand" in values and "num_heads" in values and "head_dim" in values:  # Mamba-2: heads x head_dim = expand x hidden
        put("num_heads", values["expand"] * 64 // 16)
    if any(values.get(k) for k in EXPERTS) and any(k in values and values[k] is None for k in TOP_K):
        put(next(k for k in TOP_K if k in values), 2)  # DeepSeek-V2's default leaves the top-k unset
    kinds = getattr(cfg, "layer_types", None)
    if isinstance(kinds, list) and len(kinds) > 1 and set(kinds) == {"linear_attention"}:
        put("layer_types", kinds[:-1] + ["full_attention"])  # a default without attention layers cannot cache
    if "attn_layer_indices" in values and values["attn_layer_indices"] is None and "mamba_n_heads" in values:
        put("attn_layer_indices", [1])  # Bamba's default has no attention layer, which its cache cannot handle
    if "is_decoder" in values and not getattr(cfg, "is_encoder_decoder", False):
        put("is_decoder", True)  # BERT-like models as causal LMs
    vocab = getattr(cfg, "vocab_size", None)
    if isinstance(vocab, int):
        for key, value in cfg.to_dict().items():
            if (key.endswith("_token_id") or key.endswith("_token_index")) and isinstance(value, int) and value >= vocab:
                put(key, 1)


def build(model_type: str):
    """A tiny random model of this type: fully shrunk, else with its layer pattern kept (hybrids)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    errors = []
    for keep_layers in (False, True):
        try:
            cfg = tiny_config(model_type, keep_layers)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg).float().eval()
            if hasattr(model, "set_default_language"):  # X-MOD: adapters per language
                model.set_default_language(next(iter(getattr(cfg, "languages", ["en_XX"]))))
            _smoke(model, cfg)
            return model, cfg
        except Exception as e:
            errors.append(f"{type(e).__name__}: {_first(e)}")
    try:  # is it our shrinking, or does the default config not build either?
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    except Exception as e:
        raise RuntimeError(f"its default config does not build either ({type(e).__name__}: {_first(e)})") from e
    raise RuntimeError(errors[0])


def _smoke(model, cfg) -> None:
    vocab = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", 512)
    with torch.no_grad():
        model(input_ids=torch.randint(4, max(5, min(int(vocab), 512)), (1, 4)))


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids)
    return (out.logits if hasattr(out, "logits") else out[0]).float()


def greedy(model, ids: torch.Tensor, use_generate: bool) -> list[int]:
    """Greedy continuation: `generate()` (KV cache) when asked, else full forwards without a cache."""
    if use_generate:
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        return out[0, ids.shape[1]:].tolist()
    seq = ids
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            nxt = logits_of(model, seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    return seq[0, ids.shape[1]:].tolist()


def run_one(model_type: str) -> dict:
    import tensorshard as tp
    from tensorshard.inference.infer import infer
    from tensorshard.plans.presets import PRESETS, preset_for

    rec: dict = {"arch": model_type}
    t0 = time.time()
    try:
        model, cfg = build(model_type)
    except Exception as e:
        return rec | {"buildable": False, "reason": _first(e)}
    rec["class"] = type(model).__name__
    vocab = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", 512)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, max(5, min(int(vocab), 512)), (2, 8), generator=gen)
    try:
        with torch.no_grad():
            ref = logits_of(model, ids)
            ref_tokens = {False: greedy(model, ids[:1], False)}
    except Exception as e:
        return rec | {"buildable": False, "reason": f"forward on input_ids: {type(e).__name__}: {_first(e)}"}
    whole = _param_bytes(model)  # parameters only (buffers such as rotary tables stay whole everywhere)
    rec.update(buildable=True, params=sum(p.numel() for p in model.parameters()), whole_bytes=whole)
    for n in WORLDS:
        r: dict = {}
        try:
            work = copy.deepcopy(model)
            preset = preset_for(work)
            if preset is not None:
                split = tp.tensor_parallel(work, ["cpu"] * n)
                if model_type in PRESETS:
                    r["plan"] = "preset"
                else:  # translated from base_model_tp_plan: used if it passes the self-check, else inferred
                    r["plan"] = "translated" if split.plan == preset else "inferred (translated plan did not fit)"
            else:
                report = infer(work, n, check=True)
                r["fallbacks"] = _distinct_fallbacks(report.fallbacks)
                r["groups"] = {k: sum(1 for g in report.groups if g.outcome != "whole" and g.describe() == k)
                               for k in {g.describe() for g in report.groups if g.outcome != "whole"}}
                r["embeddings"] = len(report.embeddings)
                split = tp.tensor_parallel(work, ["cpu"] * n, plan=report.plan)
                r["plan"] = "inferred"
            with torch.no_grad():
                out = logits_of(split, ids)
                r["max_diff"] = (out - ref).abs().max().item()
                r["logits_ok"] = bool(r["max_diff"] <= TOL)
                use_generate = hasattr(split, "generate")  # the transformers integration, once merged
                if use_generate and use_generate not in ref_tokens:
                    ref_tokens[True] = greedy(model, ids[:1], True)
                r["greedy_ok"] = greedy(split, ids[:1], use_generate) == ref_tokens[use_generate]
                r["generate"] = use_generate
            per_device = max(_param_bytes(shard) for shard in split.module_shards)
            r["mem_ratio"] = per_device / whole
            r["mem_ok"] = per_device < whole
            r["ok"] = r["logits_ok"] and r["greedy_ok"] and r["mem_ok"]
        except Exception as e:
            r.update(ok=False, error=f"{type(e).__name__}: {_first(e)}", trace=traceback.format_exc(limit=-3))
        rec[str(n)] = r
    rec["seconds"] = round(time.time() - t0, 1)
    return rec


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _distinct_fallbacks(fallbacks) -> list[str]:
    """One line per kind of fallback: layer numbers generalised (layers.*.mlp), with a count."""
    import re

    seen: dict[str, int] = {}
    for f in fallbacks:
        line = re.sub(r"\.\d+\.", ".*.", f.line())
        seen[line] = seen.get(line, 0) + 1
    return [f"{line} (x{n})" if n > 1 else line for line, n in seen.items()]


def _first(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


MEMORY_LIMIT = 6 << 30  # bytes of address space per architecture: a runaway model fails alone


def sweep(types: list[str], redo: bool) -> None:
    """Each architecture in its own process, under a time and memory limit; results appended as it goes."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    if redo:
        _rewrite([r for r in load() if r["arch"] not in types])
    done = {r["arch"] for r in load()}
    for i, t in enumerate(types):
        if t in done:
            continue
        rec = _isolated(t)
        with RESULTS.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        status = "not buildable" if not rec.get("buildable") else " ".join(
            f"{n}:{'ok' if rec.get(str(n), {}).get('ok') else 'FAIL'}" for n in WORLDS)
        print(f"[{i + 1}/{len(types)}] {t}: {status} ({rec.get('seconds', '?')} s)", flush=True)


def _isolated(model_type: str) -> dict:
    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    failed = {"ok": False}
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", model_type], capture_output=True, text=True,
            timeout=TIMEOUT, preexec_fn=limit, cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        why = f"timed out after {TIMEOUT} s"
        return {"arch": model_type, "buildable": True, "2": failed | {"error": why}, "3": failed | {"error": why}}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        why = f"crashed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"[:300]
        return {"arch": model_type, "buildable": True, "2": failed | {"error": why}, "3": failed | {"error": why}}
    return json.loads(lines[-1])


def load() -> list[dict]:
    if not RESULTS.exists():
        return []
    latest = {}
    for line in RESULTS.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            latest[rec["arch"]] = rec
    return list(latest.values())


def _rewrite(records: list[dict]) -> None:
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(RESULTS)


def write_table() -> None:
    import transformers

    import tensorshard

    records = sorted(load(), key=lambda r: r["arch"])
    built = [r for r in records if r.get("buildable")]
    broken = [r for r in records if not r.get("buildable")]
    ok = {n: [r for r in built if r.get(str(n), {}).get("ok")] for n in WORLDS}
    both = [r for r in built if all(r.get(str(n), {}).get("ok") for n in WORLDS)]
    commit = _git("rev-parse", "--short", "HEAD")
    pct = 100 * len(both) / max(len(built), 1)
    names = {"preset": "hand-written presets", "translated": "translated base_model_tp_plan",
             "inferred (translated plan did not fit)": "inferred after the translated plan did not fit",
             "inferred": "inferred"}
    sources: dict[str, int] = {}
    for r in built:
        source = names.get(r.get("2", {}).get("plan", "inferred"), "inferred")
        sources[source] = sources.get(source, 0) + 1
    lines = [
        "# Coverage of automatic plans",
        "",
        f"Measured {datetime.date.today().isoformat()} by `benchmarks/coverage.py` on {platform.machine()} CPU "
        f"({platform.system()}), torch {torch.__version__}, transformers {transformers.__version__}, "
        f"tensorshard {tensorshard.__version__} (commit {commit}).",
        "",
        "Every causal-LM architecture of transformers' auto mapping, built from a tiny random config (2 layers, "
        "hidden 64, 4 heads with 2 KV heads where the architecture has them, vocabulary 512, fp32) and split "
        "with `tp.tensor_parallel(model, [\"cpu\"] * n)` without a plan. A pass at n devices: logits within "
        f"{TOL:g} of the unsplit model, greedy decoding of {NEW_TOKENS} tokens identical, and less parameter "
        "memory on the largest device than the whole model.",
        "",
        f"- architectures in the mapping: **{len(records)}**",
        f"- buildable from a tiny random config: **{len(built)}** (not buildable: {len(broken)}, listed below)",
        f"- pass on 2 devices: **{len(ok[2])}**; on 3 devices: **{len(ok[3])}**",
        f"- pass on both: **{len(both)} of {len(built)} buildable ({pct:.1f}%)**",
        "- plans used (2 devices): " + ", ".join(f"{v} {k}" for k, v in sorted(sources.items(), key=lambda kv: -kv[1])),
        "",
        "Memory is the largest device's parameter bytes over the unsplit model's. Split: the "
        "groups the plan splits (attention with its head counts, column -> row pairs such as MLPs, the output "
        "head, embeddings by vocabulary). Kept whole: layers that fell back, with the first reason.",
        "",
        "| architecture | 2 devices | 3 devices | max abs diff | memory (2 / 3) | split | kept whole |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in built:
        cells = []
        for n in WORLDS:
            x = r.get(str(n), {})
            cells.append("pass" if x.get("ok") else "**fail**")
        diffs = [r.get(str(n), {}).get("max_diff") for n in WORLDS]
        diff = max((d for d in diffs if d is not None), default=None)
        mem = " / ".join(f"{100 * r.get(str(n), {}).get('mem_ratio', float('nan')):.0f}%" for n in WORLDS)
        info = r.get("2", {})
        groups = info.get("groups") or {}
        split = ", ".join(f"{v} x {k}" for k, v in sorted(groups.items()))
        if info.get("embeddings"):
            split += (", " if split else "") + f"{info['embeddings']} embedding"
        if info.get("plan", "inferred") != "inferred":
            split = {"preset": "hand-written preset", "translated": "translated base_model_tp_plan"}.get(info["plan"], info["plan"])
        notes = []
        for n in WORLDS:
            x = r.get(str(n), {})
            if x.get("error"):
                notes.append(f"{n}: {x['error']}")
            elif not x.get("ok") and x:
                why = [w for w, flag in (("logits", "logits_ok"), ("greedy", "greedy_ok"), ("memory", "mem_ok")) if not x.get(flag)]
                notes.append(f"{n}: {', '.join(why)} off")
        fb = info.get("fallbacks") or []
        if fb:
            notes.append(f"{len(fb)} fallback(s), e.g. {fb[0]}")
        lines.append(
            f"| {r['arch']} | {cells[0]} | {cells[1]} | {'-' if diff is None else f'{diff:.1e}'} | {mem} | "
            f"{_cell(split or '-')} | {_cell('; '.join(notes) or '-')} |"
        )
    lines += ["", "## Not buildable from a tiny random config", "", "| architecture | reason |", "|---|---|"]
    for r in broken:
        lines.append(f"| {r['arch']} | {_cell(r.get('reason', '?'))} |")
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    tmp = TABLE.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(TABLE)
    print(f"wrote {TABLE}: {len(both)}/{len(built)} buildable architectures pass on 2 and 3 devices ({pct:.1f}%)")


def _cell(text: str, limit: int = 220) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "?"


def main(argv: list[str] | None = None) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="model types to run (default: all)")
    parser.add_argument("--redo", action="store_true", help="run again even if results exist")
    parser.add_argument("--table", action="store_true", help="only rewrite docs/coverage.md from stored results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # run one architecture, print its record
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    if args.worker:
        print(json.dumps(run_one(args.worker)), flush=True)
        return
    if not args.table:
        types = args.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        sweep(types, args.redo)
    write_table()


if __name__ == "__main__":
    sys.exit(main())
