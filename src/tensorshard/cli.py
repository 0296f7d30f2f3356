"""The `tensorshard` command line: a thin table of plain typed functions.

    tensorshard plan llama --devices 4                 # a transformers model type, built on the meta device
    tensorshard plan path/to/config.json --devices 2 --json plan.json
    tensorshard plan path/to/checkpoint/ --devices 8
    tensorshard plan path/to/model.gguf --devices 2
    tensorshard plan mypackage.models:build --devices 2
    python -m tensorshard.cli plan llama --devices 4   # the same, without the console script

Each command is a function below; its signature and docstring are its options and help (`COMMANDS`).
Models are built on the meta device, so a 70B config costs no memory: shapes are all a plan needs.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import json as jsonlib
import logging
import os
import sys
import typing
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import quant
from .checkpoint.gguf import gguf_config
from .plan_inference.infer import infer
from .plan_inference.trace import trace_model
from .plans import Plan
from .plans.explain import explain, human_bytes
from .plans.presets import preset_for

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")  # a checkpoint's weights: its folder's config.json says the model


def plan(
    model: str,
    devices: int = 2,
    json: Path | None = None,
    plan: Path | None = None,
    dtype: str | None = None,
    expand: bool = False,
    quantize: str | None = None,
    balance: bool = False,
) -> int:
    """Explain the plan for a model over N devices: style, local shapes, memory and communication per module.

    Args:
        model: a transformers model type (llama), a config.json, a .gguf file, a checkpoint folder, or
            module:function returning an nn.Module (called on the meta device; modules of the current folder
            resolve).
        devices: how many devices to split over.
        json: write the plan to this file (edit it and pass it back: plan=tp.Plan.load(path)).
        plan: explain this plan file instead of the automatic one.
        dtype: activation dtype for the bytes per token (float32, bfloat16, ...); default: the weights'.
        expand: one row per module instead of one per repeated layer (layers.*.mlp).
        quantize: count memory as bitsandbytes stores it once loaded with tp.from_pretrained(...,
            quantization_config=...): nf4, fp4 (4-bit; add -double for double quantization: nf4-double) or int8.
        balance: the sizes of a balanced split (tensor_parallel(..., balance=True)): each block's MLP sized per
            device to even out the weights where the attention heads split unevenly.
    """

    if devices < 1:
        raise SystemExit(f"--devices must be at least 1; got {devices}")
    act_dtype = _dtype(dtype) if dtype else None
    module = load_model(model)
    trace = None
    if quantize is not None:
        # Which column layers read one tensor (q, k, v share one backward all-reduce) is the same quantized
        # or not, and only the unquantized model runs on the meta device: trace it first.
        trace = _trace(module)
        quant.prepare_empty(module, _quantization_config(quantize, model))
    source = f"plan file {plan}"
    if plan is not None:
        chosen = Plan.load(plan)
    elif (preset := preset_for(module)) is not None:
        chosen, source = preset, "preset"
    else:
        report = infer(module, devices)
        chosen, source = report.plan, "inferred"
        trace = trace or report.trace
        for f in report.fallbacks:
            print(f"note: {f.line()}", file=sys.stderr)
    trace = trace or _trace(module)
    explanation = explain(module, chosen, devices, trace=trace, dtype=act_dtype, balance=balance)
    _print(module, model, devices, chosen, source, explanation, expand)
    if json is not None:
        chosen.save(json)
        print(f"wrote the plan to {json} (load it with tp.Plan.load({str(json)!r}))")
    return 0


COMMANDS: dict[str, Callable[..., int]] = {"plan": plan}


def _trace(module: nn.Module):
    """A trace of the model for which column layers share an input, or None (each column then counts its own
    backward all-reduce)."""
    try:
        return trace_model(module, capture=False)
    except Exception as e:  # noqa: BLE001 - the explanation still holds, without the sharing
        print(f"note: could not trace {type(module).__name__} ({type(e).__name__}); each column layer's backward "
              "all-reduce is counted on its own", file=sys.stderr)
        return None


# --- building the model ---------------------------------------------------------------------------------


def load_model(spec: str) -> nn.Module:
    """Build the model `spec` names on the meta device (no memory, no weights)."""
    path = Path(spec)
    if ":" in spec and not path.exists():
        module_name, _, func_name = spec.partition(":")
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` does: modules of the current folder resolve
        try:
            factory = getattr(importlib.import_module(module_name), func_name)
        except (ImportError, AttributeError) as e:
            raise SystemExit(f"{spec}: cannot import {func_name!r} from {module_name!r} ({e}); use module.path:function") from e
        with torch.device("meta"):
            built = factory()
        if not isinstance(built, nn.Module):
            raise SystemExit(f"{spec} returned {type(built).__name__}, not an nn.Module")
        return built
    AutoConfig = _transformers(spec).AutoConfig
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SystemExit(f"{spec}: a checkpoint folder needs a config.json; none found")
        config = AutoConfig.from_pretrained(path)
    elif path.is_file() and path.suffix == ".gguf":
        config = gguf_config(path)
    elif path.is_file() and path.suffix in WEIGHT_FILES:  # a checkpoint's weights: its folder's config.json
        if not (path.parent / "config.json").exists():
            raise SystemExit(f"{spec}: a weights file explains nothing without its folder's config.json; none found "
                             f"in {path.parent}")
        config = AutoConfig.from_pretrained(path.parent)
    elif path.is_file():
        config = _config_from_file(path, spec)
    elif path.suffix == ".json" or "/" in spec:
        raise SystemExit(f"{spec}: no such file or folder")
    else:
        try:
            config = AutoConfig.for_model(spec)
        except ValueError as e:
            known = list(_transformers(spec).CONFIG_MAPPING.keys())
            close = difflib.get_close_matches(spec.lower(), known, n=5, cutoff=0.6)
            hint = f"closest model types: {', '.join(close)}" if close else f"{len(known)} model types are known"
            raise SystemExit(
                f"{spec!r} is not a transformers model type, a config.json, a .gguf file, a checkpoint folder or "
                f"module:function ({hint})"
            ) from e
    return _from_config(config, spec)


def _transformers(spec: str):
    """transformers, imported on first use: only transformers model types need it."""
    try:
        import transformers  # deferred: optional heavy dependency (the [hf] extra)
    except ImportError as e:
        raise SystemExit(f"{spec}: building transformers models needs `pip install tensorshard[hf]` ({e})") from e
    return transformers


def _config_from_file(path: Path, spec: str):
    AutoConfig = _transformers(spec).AutoConfig
    try:
        data = jsonlib.loads(path.read_text())
    except (UnicodeDecodeError, jsonlib.JSONDecodeError) as e:
        raise SystemExit(f"{path}: not a config.json (JSON: {e}); give a config.json, a checkpoint folder, a .gguf "
                         "file, a model type or module:function") from e
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: a config.json holds a JSON object; this holds {type(data).__name__}")
    if "model_type" not in data:
        raise SystemExit(f"{path}: a config.json needs a model_type")
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _from_config(config, spec: str) -> nn.Module:
    """The model with its head: an encoder-decoder's generating class (Whisper's WhisperForConditionalGeneration,
    not its decoder-only WhisperForCausalLM), a causal LM, a vision-language model, else the bare model."""
    transformers = _transformers(spec)
    errors = []
    named = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
    if isinstance(named, type) and hasattr(named, "_from_config"):  # the class the checkpoint names, as from_pretrained
        with torch.device("meta"):
            return named._from_config(config)
    autos = [transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText, transformers.AutoModel]
    if getattr(config, "is_encoder_decoder", False):
        autos = [transformers.AutoModelForSpeechSeq2Seq, transformers.AutoModelForSeq2SeqLM] + autos
    for auto in autos:
        try:
            with torch.device("meta"):
                return auto.from_config(config)
        except (ValueError, KeyError) as e:
            errors.append(str(e).splitlines()[0])
    raise SystemExit(f"{spec}: transformers has no model class for this config ({'; '.join(errors)})")


def _quantization_config(name: str, spec: str):
    transformers = sys.modules.get("transformers")  # loaded by load_model for transformers models
    if transformers is None:
        raise SystemExit(f"--quantize applies to transformers models (a model type, config.json or checkpoint folder), not {spec}")
    BitsAndBytesConfig = transformers.BitsAndBytesConfig
    kind, _, extra = name.partition("-")
    if kind == "int8" and not extra:
        return BitsAndBytesConfig(load_in_8bit=True)
    if kind in ("nf4", "fp4") and extra in ("", "double"):
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=bool(extra))
    raise SystemExit(f"--quantize {name}: use nf4, fp4, nf4-double, fp4-double or int8")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise SystemExit(f"--dtype {name}: not a torch dtype; use float32, bfloat16, float16, ...")
    return value


# --- output ---------------------------------------------------------------------------------------------


def _print(module, spec, devices, chosen, source, ex, expand: bool) -> None:
    rows = [(1, r) for r in ex.rows] if expand else _collapse(ex.rows)
    title = f"{type(module).__name__} ({spec}) over {devices} device(s): {source} plan, {len(chosen)} entries"
    header = ["module", "type", "style", "local shapes", "params / device", "fwd / token", "bwd / token"]
    body = []
    for count, r in rows:
        mem = sorted(set(r.bytes_per_device))
        body.append([
            r.name + (f"  x{count}" if count > 1 else ""),
            r.type,
            r.style,
            "\n".join(r.shapes),
            " | ".join(human_bytes(b) for b in mem) if len(mem) > 1 else human_bytes(mem[0]),
            _costs(r.forward),
            _costs(r.backward) + (f"\nper step: {_costs(r.per_step)}" if r.per_step else ""),
        ])
    per_device = ex.bytes_per_device
    fwd, bwd = ex.totals("forward"), ex.totals("backward")
    summary = [
        f"parameters per device: {' | '.join(human_bytes(b) for b in per_device)} (whole model: {human_bytes(ex.whole_bytes)}, "
        f"{100 * max(per_device) / max(ex.whole_bytes, 1):.0f}% on the largest device)",
        f"per token, forward: {_totals(fwd)}; backward: {_totals(bwd)}",
        "costs are computed from the plan and the shapes; see docs/automatic-plans.md",
    ]
    try:
        from rich.console import Console  # deferred: optional dependency (the [cli] extra)
        from rich.table import Table  # deferred: optional dependency (the [cli] extra)
    except ImportError:
        _plain(title, header, body, summary)
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 180))  # piped into a file: do not wrap at 80 columns
    table = Table(title=title, show_lines=False)
    for h in header:
        table.add_column(h, overflow="fold")
    for row in body:
        table.add_row(*row)
    console.print(table)
    for line in summary:
        console.print(line)


def _collapse(rows):
    """Merge rows of repeated layers (names equal up to their numbers) that are identical."""
    out: list[list] = []
    index: dict[tuple, int] = {}
    for r in rows:
        generic = ".".join("*" if s.isdigit() else s for s in r.name.split("."))
        key = (generic, r.type, r.style, tuple(r.shapes), tuple(r.bytes_per_device), tuple(r.forward), tuple(r.backward))
        if key in index:
            out[index[key]][0] += 1
            continue
        index[key] = len(out)
        out.append([1, r])
    for entry in out:
        if entry[0] > 1:
            entry[1].name = ".".join("*" if s.isdigit() else s for s in entry[1].name.split("."))
    return [(c, r) for c, r in out]


def _costs(costs) -> str:
    return "\n".join(f"{kind} {human_bytes(b)}" for kind, b in costs) or "-"


def _totals(c) -> str:
    parts = [f"{c[k]} x {k} ({human_bytes(c[k + ' bytes'])})" for k in ("all_reduce", "all_gather") if c.get(k)]
    return ", ".join(parts) or "none"


def _plain(title, header, body, summary) -> None:
    print(title)
    widths = [max(len(str(x).split("\n")[0]) for x in col) for col in zip(header, *body)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in body:
        print("  ".join(str(x).replace("\n", "; ").ljust(w) for x, w in zip(row, widths)))
    for line in summary:
        print(line)


# --- the table of commands ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorshard", description="Tensor parallelism for any PyTorch model.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func in COMMANDS.items():
        doc = inspect.getdoc(func) or ""
        helps = _arg_help(doc)
        p = sub.add_parser(name, help=doc.splitlines()[0] if doc else None, description=doc.split("\n\nArgs:")[0])
        hints = typing.get_type_hints(func)
        for param in inspect.signature(func).parameters.values():
            kind = hints.get(param.name, str)
            base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
            flag = "--" + param.name.replace("_", "-")
            if param.default is inspect.Parameter.empty:
                p.add_argument(param.name, type=base, help=helps.get(param.name))
            elif base is bool:
                p.add_argument(flag, dest=param.name, action="store_true", help=helps.get(param.name))
            else:
                p.add_argument(flag, dest=param.name, type=base, default=param.default, help=helps.get(param.name))
    return parser


def _arg_help(doc: str) -> dict[str, str]:
    out, current = {}, None
    for line in doc.split("Args:", 1)[-1].splitlines() if "Args:" in doc else []:
        stripped = line.strip()
        if ":" in stripped and not line.startswith(" " * 8):
            current, _, text = stripped.partition(":")
            out[current] = text.strip()
        elif current and stripped:
            out[current] += " " + stripped
    return out


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = COMMANDS[args.pop("command")]
    return command(**args)


if __name__ == "__main__":
    sys.exit(main())
