"""The PNG plots of BENCHMARKS.md (matplotlib, Agg backend): per-device memory against the number of devices,
collectives per transformer block, and speed at 2 devices relative to the unsplit model."""

from __future__ import annotations

from pathlib import Path

from suite.sections import GIB, GUIDE_GB, PLOT_NAMES, SHORT, _max, _runs, comm_per_block
from suite.targets import median

# --- plots ------------------------------------------------------------------------------------------------------


def make_plots(memory, comm, speed, folder: Path, rel: str) -> tuple[dict, str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        return {}, "matplotlib is not installed here: plots skipped (`make bench` installs it in .venv-bench-peers)."
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    colors = {"ours-inprocess": "tab:blue", "ours-torchrun": "tab:cyan", "dtensor": "tab:orange", "hf-tp-plan": "tab:green",
              "tensor_parallel": "tab:red", "plain": "black"}
    if memory:
        worlds = memory["sizes"]["worlds"]
        for model in ("ff", "llama"):
            runs = _runs(memory, model)
            plain = runs.get(("plain", 1))
            if not plain or not plain.get("ok"):
                continue
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            base = plain["devices"][0]["total"] / GIB
            ax.plot(worlds, [base / w for w in worlds], "k--", label="ideal: unsplit / N")
            for system in ("ours-inprocess", "ours-torchrun", "dtensor", "hf-tp-plan", "tensor_parallel"):
                pts = [(w, _max(runs[(system, w)]["devices"], "total") / GIB) for w in worlds
                       if (system, w) in runs and runs[(system, w)].get("ok")]
                if pts:
                    ax.plot(*zip(*pts), "o-", color=colors[system], label=PLOT_NAMES[system], alpha=0.85)
            if model == "ff":
                g = [(w, GUIDE_GB[w] * 1e9 / GIB) for w in worlds if w in GUIDE_GB]
                ax.plot(*zip(*g), "x:", color="gray", label="Lightning guide (GPU peak)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax.set_xticks(worlds, [str(w) for w in worlds])
            ax.set_xlabel("devices")
            ax.set_ylabel("GiB per device (params + grads + AdamW + activations)")
            ax.set_title("FeedForward(8192, 8192)" if model == "ff" else "Llama-style model")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = folder / f"memory_{model}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            out[f"memory_{model}"] = f"{rel}/{path.name}"
    if comm:
        per = comm_per_block(comm)
        if per:
            fig, ax = plt.subplots(figsize=(6.4, 3.8))
            systems = list(per)
            width = 0.27
            for i, phase in enumerate(("forward", "backward", "decode")):
                ax.bar([x + (i - 1) * width for x in range(len(systems))], [per[s][phase] for s in systems], width, label=phase)
            ax.set_xticks(range(len(systems)), [SHORT[s] for s in systems], fontsize=8)
            ax.set_ylabel("collectives per transformer block")
            ax.legend()
            ax.grid(True, axis="y", alpha=0.3)
            fig.tight_layout()
            path = folder / "comm.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            out["comm"] = f"{rel}/{path.name}"
    if speed:
        metrics = (("train", "step", "training step"), ("infer", "forward", "forward"), ("infer", "generate", "generation"))
        systems = [s for s in ("ours-inprocess", "ours-torchrun", "dtensor", "hf-tp-plan", "tensor_parallel")
                   if any(v["system"] == s and v["world"] == 2 for v in speed.get("train", []) + speed.get("infer", []))]
        if systems:
            fig, ax = plt.subplots(figsize=(7.2, 4.0))
            width = 0.8 / len(systems)
            for i, s in enumerate(systems):
                ref = "plain (tensor_parallel env)" if s == "tensor_parallel" else "plain"
                vals = []
                for task, metric, _ in metrics:
                    base, two = median(speed, task, ref, 1, metric), median(speed, task, s, 2, metric)
                    vals.append(base / two if base and two else 0)
                ax.bar([x + (i - (len(systems) - 1) / 2) * width for x in range(len(metrics))], vals, width,
                       color=colors[s], label=PLOT_NAMES[s])
            ax.axhline(1.0, color="black", lw=0.8)
            ax.axhline(2.0, color="gray", lw=0.8, ls="--")
            ax.set_xticks(range(len(metrics)), [m[2] for m in metrics])
            ax.set_ylabel("speed at 2 devices / unsplit model\n(higher is better; 2 = ideal)")
            ax.legend(fontsize=8)
            ax.grid(True, axis="y", alpha=0.3)
            fig.tight_layout()
            path = folder / "speed.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            out["speed"] = f"{rel}/{path.name}"
    return out, ""


