"""All three comparisons in one run, then BENCHMARKS.md and the plots: what `make bench` runs.

    python benchmarks/run_all.py [--quick] [--device cuda] [--only memory comm speed] [--render-python PY]

1. memory.py   -> benchmarks/results/memory.json   (per-device memory at 1/2/4/8 devices)
2. communication.py -> benchmarks/results/comm.json (collectives per transformer block)
3. speed.py    -> benchmarks/results/speed.json    (training step, forward, generation at 1 and 2 devices)
4. render.py   -> BENCHMARKS.md, benchmarks/plots/*.png (run with --render-python, which has matplotlib)

The tensor_parallel peer runs with --peer-python (default .venv-bench-peers/bin/python); everything else
with this interpreter. A full run takes about half an hour on a quiet 2-core machine; --quick a few minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import communication  # noqa: E402
import memory  # noqa: E402
import speed  # noqa: E402
from suite.launch import BENCH, REPO, Checkpoints, add_arguments, run_and_write, runner_from  # noqa: E402

COMPARISONS = {"memory": (memory, "memory.json"), "comm": (communication, "comm.json"), "speed": (speed, "speed.json")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--only", nargs="+", choices=sorted(COMPARISONS), default=list(COMPARISONS),
                        help="run only these comparisons (the others' earlier results are rendered as they are)")
    parser.add_argument("--render-python", default=None,
                        help="interpreter with matplotlib for render.py (default: --peer-python, else this one)")
    parser.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    args = parser.parse_args()

    start = time.perf_counter()
    print(f"tensorshard benchmarks ({'quick' if args.quick else 'full'}, device {args.device}); load average "
          f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())} (above ~1 per core, others are busy: timings will be noisy)")
    with Checkpoints(runner_from(args)) as checkpoints:  # the benchmark Llama's weights, written once
        for key in args.only:
            module, filename = COMPARISONS[key]
            print(f"\n{key}:")
            run_and_write(runner_from(args), checkpoints, module.run, Path(args.results) / filename)

    render_python = args.render_python or (args.peer_python if Path(args.peer_python).exists() else sys.executable)
    plots = Path(args.out).parent / "benchmarks" / "plots"  # next to BENCHMARKS.md, as its links expect
    cmd = [render_python, str(BENCH / "render.py"), "--results", args.results, "--out", args.out, "--plots", str(plots)]
    print("\nrender:", " ".join(cmd))
    subprocess.run(cmd, check=True)
    print(f"done in {(time.perf_counter() - start) / 60:.1f} minutes")


if __name__ == "__main__":
    main()
