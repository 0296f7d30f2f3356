"""Render benchmarks/results/{memory,comm,speed,scaling}.json (and generation.md) into BENCHMARKS.md and benchmarks/plots/*.png.

Needs only the standard library and matplotlib (installed in the bench environment, .venv-bench-peers);
without matplotlib the markdown is written and the plots are skipped with a note.

    python benchmarks/render.py [--results benchmarks/results] [--out BENCHMARKS.md] [--plots benchmarks/plots]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suite.analysis import ANALYSIS  # noqa: E402
from suite.plots import make_plots  # noqa: E402
from suite.scaling_section import scaling_plot, scaling_section  # noqa: E402
from suite.sections import comm_section, load, memory_section, speed_section  # noqa: E402
from suite.targets import TARGETS  # noqa: E402

BENCH = Path(__file__).resolve().parent


# --- header ---------------------------------------------------------------------------------------------------


def header(meta: dict, sources: dict) -> list[str]:
    v, peer = meta.get("versions", {}), meta.get("peer_versions", {})
    lines = [
        "# Benchmarks",
        "",
        "tensorshard against the tools users would pick instead, all measured side by side in one run. Regenerate "
        "everything (this file, `benchmarks/results/*.json`, `benchmarks/plots/*.png`) with `make bench` "
        "(`make bench ARGS=--quick` for a short check).",
        "",
        f"- **Run**: {meta.get('date', '?')}; {meta.get('cpu', '?')} ({meta.get('cores', '?')} cores, "
        f"{meta.get('memory_gib', '?')} GiB), {meta.get('os', '?')}; load average at start "
        f"{_load(meta.get('load_average_start'))}, at end {_load(meta.get('load_average_end'))} (others may share the machine).",
        f"- **Main environment**: Python {meta.get('python', '?')}, torch {v.get('torch', '?')}, transformers "
        f"{v.get('transformers', '?')}, tensorshard {v.get('tensorshard', '?')} (this checkout).",
        "- **tensor_parallel environment** (`.venv-bench-peers`; tensor_parallel 2.0 breaks on transformers 5.x): "
        + (", ".join(f"{k} {x}" for k, x in peer.items()) if peer else "missing") + ".",
    ]
    probe = sources.get("probe")
    if probe is not None:
        outcome = "runs" if probe.get("ok") else f"fails: `{probe.get('error', '?')[:300]}`"
        lines.append(f"- **tensor_parallel 2.0 with transformers {v.get('transformers', '?')}** (its package imported into the "
                     f"main environment; split a tiny Llama over 2 devices, train a step, generate): {outcome}")
    if meta.get("device") == "cuda":
        lines.append(f"- **Devices**: GPUs {', '.join(meta.get('gpus', [])) or '?'}.")
    else:
        lines.append(
            "- **Devices**: CPU. A simulated device is one CPU thread: `torch.set_num_threads(1)` in every process, "
            "and the in-process engines run each shard in its own thread with one intra-op thread. On this "
            f"{meta.get('cores', '?')}-core machine 2 devices can at best halve a step. GPU columns were **not measured "
            "here** (no GPU in this run); the same scripts take `--device cuda` and record "
            "`torch.cuda.max_memory_allocated` per device and synchronised timings there."
        )
    if sources.get("quick"):
        lines.append("- **--quick run**: small models and few devices, to check that everything runs; "
                     "the numbers say nothing about performance.")
    return lines + [""]


def _load(x) -> str:
    return "/".join(f"{v:.1f}" for v in x) if x else "?"


# --- targets ----------------------------------------------------------------------------------------------------


def targets_section(speed: dict | None) -> list[str]:
    lines = ["## Targets", "", "Set in issue 7, measured in this run (ratios of medians; speed-up = 1-device time / 2-device time of the "
             "same system; otherwise time / the unsplit model's time for the same work).", "",
             "| target | goal | measured | |", "|---|---:|---:|---|"]
    if speed is None:
        return lines + ["| (speed not measured) | | | |", ""]
    for t in TARGETS:
        r = t.check(speed)
        goal = f"≥ {t.goal:.2f}x" if t.kind == "speedup" else f"≤ {t.goal:.2f}x"
        if r.get("value") is None:
            lines.append(f"| {t.what} | {goal} | – | {r.get('why')} |")
            continue
        verdict = "met" if r["met"] else f"**missed**: {_by(t, r)} ([why](#missed-{t.key}))"
        lines.append(f"| {t.what} | {goal} | {r['value']:.2f}x | {verdict} |")
    return lines + [""]


def _by(t, r) -> str:
    if t.kind == "speedup":
        return f"{r['value']:.2f}x is {r['by'] * 100:.0f}% short of {t.goal:.2f}x"
    return f"{r['value']:.2f}x is {r['by'] * 100:.0f}% over {t.goal:.2f}x"



# --- missed targets -------------------------------------------------------------------------------------------------


def missed_section(speed: dict | None) -> list[str]:
    if speed is None:
        return []
    missed = [(t, t.check(speed)) for t in TARGETS]
    missed = [(t, r) for t, r in missed if r.get("met") is False]
    lines = ["## Missed targets: where the time goes, and what would close the gap", ""]
    if not missed:
        return lines + ["Every target was met in this run.", ""]
    profiles = speed.get("profiles", {})
    for t, r in missed:
        goal = f"≥ {t.goal:.2f}x" if t.kind == "speedup" else f"≤ {t.goal:.2f}x"
        lines += [f"<a id=\"missed-{t.key}\"></a>", f"### {t.what}: {r['value']:.2f}x, goal {goal}", "",
                  f"Missed: {_by(t, r)}.", ""]
        shown = [(k, p) for k, p in profiles.items() if k.split(" ")[0] == t.task and k.split(" ")[1] in t.profile
                 and (len(k.split(" ")) < 3 or k.split(" ")[2] == t.metric)]
        if shown:
            lines += ["Profile of one call (torch.profiler, all threads; self CPU time per thread: busy, of which matrix "
                      "products and collectives; idle = wall time − busy):", "",
                      "| run | wall | per thread: busy (matmul, collectives) | top ops by self CPU time |", "|---|---:|---|---|"]
            for k, p in shown:
                threads = "; ".join(f"{th['busy_s'] * 1e3:.0f} ms ({th['matmul_s'] * 1e3:.0f}, {th['comm_s'] * 1e3:.0f})"
                                    for th in p["threads"][:4])
                top = ", ".join(f"{e['op']} {e['share'] * 100:.0f}%" for e in p["top"][:5])
                lines.append(f"| {k} | {p['wall_s'] * 1e3:.0f} ms | {threads} | {top} |")
            lines.append("")
        lines += [ANALYSIS.get(t.key, ANALYSIS.get(t.key.split("-")[0], "(no analysis written for this target yet)")), ""]
    return lines



# --- main -------------------------------------------------------------------------------------------------------


def gpu_section(results: Path) -> list[str]:
    """benchmarks/gpu.py's section (results/gpu.md), measured on a CUDA machine; a note where none was yet."""
    measured = results / "gpu.md"
    if measured.exists():
        return measured.read_text().rstrip().splitlines() + [""]
    return ["## GPU: the engine's overhead at one shard", "", "Not measured yet: `python benchmarks/gpu.py` on a CUDA "
            "machine writes this section (forward, training step and decoding of a 1.1B-parameter bf16 Llama, unsplit "
            "against one shard and all visible GPUs, and the memory per GPU).", ""]


def generation_section(results: Path) -> list[str]:
    """Section 5, generation on both paths (benchmarks/generation.py, generation_torchrun.py): results/generation.md,
    its tables and analysis, written from their output; nothing where it is absent."""
    measured = results / "generation.md"
    return measured.read_text().rstrip().splitlines() + [""] if measured.exists() else []


def render(results: Path, out: Path, plots_dir: Path) -> str:
    memory, comm, speed = load(results, "memory"), load(results, "comm"), load(results, "speed")
    scaling = load(results, "scaling")
    metas = [x["meta"] for x in (memory, comm, speed) if x]
    if not metas:
        raise SystemExit(f"no results in {results}: run benchmarks/run_all.py first")
    meta = dict(metas[0])
    meta["load_average_end"] = metas[-1].get("load_average_end")
    dates = {name: x["meta"].get("date", "?") for name, x in (("memory", memory), ("communication", comm), ("speed", speed)) if x}
    if len(set(dates.values())) > 1:  # comparisons rerun alone (run_all.py --only): each with its own date
        meta["date"] = "; ".join(f"{name} {date}" for name, date in dates.items())
    quick = any(x["sizes"]["llama"]["hidden_size"] < 1024 for x in (memory, comm, speed) if x)
    rel = os.path.relpath(plots_dir, out.parent)
    plots, note = make_plots(memory, comm, speed, plots_dir, rel)
    if not note:
        import matplotlib.pyplot as plt  # deferred: present, as make_plots found

        plots.update(scaling_plot(scaling, plots_dir, rel, plt))
    lines = header(meta, {"quick": quick, "probe": (speed or {}).get("tensor_parallel_on_main")})
    if note:
        lines += [note, ""]
    lines += targets_section(speed) + memory_section(memory, plots) + comm_section(comm, plots)
    lines += speed_section(speed, plots) + scaling_section(scaling, plots) + generation_section(results)
    lines += missed_section(speed) + gpu_section(results)
    jobs = [j for x in (memory, comm, speed) if x for j in x.get("jobs", [])]
    if jobs:
        lines += ["## The run", "", f"{len(jobs)} jobs, {sum(j['seconds'] for j in jobs) / 60:.1f} minutes in all "
                  f"({sum(1 for j in jobs if not j['ok'])} failed); each job's output is in `benchmarks/results/logs/`. "
                  "Scripts: `benchmarks/run_all.py` (all three), `memory.py`, `communication.py`, `speed.py`, each "
                  "runnable alone (`--quick`, `--device cuda`), `render.py` (this file).", ""]
    text = "\n".join(lines).rstrip() + "\n"
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, out)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(BENCH / "results"))
    parser.add_argument("--out", default=str(BENCH.parent / "BENCHMARKS.md"))
    parser.add_argument("--plots", default=str(BENCH / "plots"))
    args = parser.parse_args()
    render(Path(args.results), Path(args.out), Path(args.plots))
    print(f"wrote {args.out} and plots in {args.plots}")


if __name__ == "__main__":
    main()

