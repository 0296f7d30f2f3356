"""Starting jobs: job.py in the main environment (alone, or under torchrun with one process per device)
and peer_job.py with the tensor_parallel environment's interpreter. Every job runs in a fresh process, so
memory and thread settings never leak from one measurement into the next.

A job that fails, or that does not finish within its timeout, comes back as ``{"ok": False, "error": ...}``
with the exception's last line (the whole output goes to the log folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from suite.config import Sizes
from suite.systems import DISTRIBUTED

BENCH = Path(__file__).resolve().parent.parent  # benchmarks/
REPO = BENCH.parent
JOB = BENCH / "suite" / "job.py"
PEER_JOB = BENCH / "suite" / "peer_job.py"
DEFAULT_PEER_PYTHON = REPO / ".venv-bench-peers" / "bin" / "python"


@dataclass(kw_only=True)
class Runner:
    """How to start jobs: sizes, device type, interpreters, where logs go."""

    sizes: Sizes
    device: str = "cpu"
    python: str = sys.executable
    peer_python: str = str(DEFAULT_PEER_PYTHON)
    log_dir: Path = BENCH / "results" / "logs"
    timeout: float = 900.0
    verbose: bool = True
    log: list[dict] = field(default_factory=list)  # every job: command, seconds, ok

    def probe_peer_on_main(self) -> dict:
        """tensor_parallel 2.0 imported with this environment's transformers (5.x): does it still run?"""
        probe = ("import sysconfig, sys; print(sysconfig.get_paths()['purelib'])")
        found = subprocess.run([self.peer_python, "-c", probe], capture_output=True, text=True) if Path(self.peer_python).exists() else None
        if found is None or found.returncode != 0:
            return {"ok": False, "error": "the tensor_parallel environment is missing"}
        return self.job("probe", ["tensor_parallel:2"], peer=True, on_main=found.stdout.strip())

    def job(self, task: str, systems: list[str], *, model: str = "llama", world: int = 1, peer: bool = False,
            checkpoint: str | None = None, layers: int | None = None, profile: bool = False, repeats: int | None = None,
            tag: str = "", on_main: str | None = None) -> dict:
        """Run one job and return its JSON result. `world` > 1 with a distributed system: under torchrun."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        distributed = not peer and any(s.split(":")[0] in DISTRIBUTED for s in systems)
        if peer and not on_main and not Path(self.peer_python).exists():
            return {"ok": False, "error": f"the tensor_parallel environment is missing ({self.peer_python}); "
                                          "`make bench` creates it (.venv-bench-peers)"}
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            args = ["--task", task, "--model", model, "--systems", *systems, "--device", self.device,
                    "--sizes", json.dumps(self.sizes.to_dict()), "--repeats", str(repeats or self.sizes.repeats), "--out", out]
            if checkpoint:
                args += ["--checkpoint", checkpoint]
            if layers:
                args += ["--layers", str(layers)]
            if profile:
                args += ["--profile"]
            if on_main:  # the peer's package, this environment's interpreter and transformers
                cmd = [self.python, str(PEER_JOB), *args, "--append-path", on_main]
            elif peer:
                cmd = [self.peer_python, str(PEER_JOB), *args]
            elif distributed:
                cmd = [self.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", str(JOB), *args]
            else:
                cmd = [self.python, str(JOB), *args]
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{task}-{model}-{'-'.join(systems)}-{world}{tag}")
            label = f"{task:<7} {model:<6} {' '.join(systems)}" + (f" ({world} process{'es' if world > 1 else ''})" if distributed else "")
            if self.verbose:
                print(f"  {label} ...", end="", flush=True)
            start = time.perf_counter()
            env = _environment(peer and not on_main)
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout, env=env, cwd=REPO)
                output, rc = proc.stdout + proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as e:
                output = _text(e.stdout) + _text(e.stderr)
                rc = None
            seconds = time.perf_counter() - start
            (self.log_dir / f"{name}.log").write_text(" ".join(cmd) + "\n\n" + output)
            if os.path.exists(out):
                with open(out) as f:
                    result = json.load(f)
            elif rc is None:
                result = {"ok": False, "error": f"did not finish within {self.timeout:.0f} s: {last_error(output) or 'no error printed'}"}
            else:
                result = {"ok": False, "error": last_error(output) or f"exit status {rc}, no error printed"}
        result["seconds"] = seconds
        self.log.append({"job": label, "seconds": round(seconds, 1), "ok": result.get("ok", False)})
        if self.verbose:
            print(f" {seconds:.0f} s" + ("" if result.get("ok") else f"  FAILED: {result.get('error', '')[:200]}"), flush=True)
        return result


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def _environment(peer: bool) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # one intra-op thread per process (torchrun sets it too)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONWARNINGS"] = "ignore"
    env.setdefault("HF_HUB_OFFLINE", "1")
    if not peer:  # our code from this checkout, whether or not it is installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
    else:
        env.pop("PYTHONPATH", None)
    return env


def last_error(output: str) -> str:
    """The last exception line of a Python traceback in `output` (e.g. 'RuntimeError: ...')."""
    lines = [line.strip() for line in output.splitlines()]
    errors = [i for i, line in enumerate(lines) if re.match(r"^([A-Za-z_][\w.]*)?(Error|Exception|Interrupt|Failure)\b.*", line)
              or re.match(r"^[A-Za-z_][\w.]*(Error|Exception): ", line)]
    errors = [i for i in errors if not lines[i].startswith(("torch.distributed.elastic.multiprocessing.errors.ChildFailedError",))]
    if not errors:
        return ""
    i = errors[-1]
    message = lines[i]
    for extra in lines[i + 1:i + 4]:  # multi-line messages (state dict mismatches, ...)
        if not extra or extra.startswith(("[", "Traceback", "File ", "Root Cause", "===", "---")):
            break
        message += " " + extra
    return message[:600]


# --- shared by the comparison scripts -------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="small models and 1/2/4 devices: a check that all runs (minutes)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: CPU slots / gloo processes, one thread each; cuda: one GPU per device (NCCL)")
    parser.add_argument("--peer-python", default=str(DEFAULT_PEER_PYTHON),
                        help="interpreter of the tensor_parallel environment (made by `make bench`)")
    parser.add_argument("--results", default=str(BENCH / "results"), help="folder for the JSON results")
    parser.add_argument("--timeout", type=float, default=900, help="seconds any one job may take")


def runner_from(args) -> Runner:
    from suite.config import FULL, QUICK

    sizes = QUICK if args.quick else FULL
    return Runner(sizes=sizes, device=args.device, peer_python=args.peer_python,
                  log_dir=Path(args.results) / "logs", timeout=args.timeout)


class Checkpoints:
    """The benchmark Llama's weights, written once per layer count into a temporary folder that every
    system loads (so all of them run the same model), removed on exit."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.folder = tempfile.mkdtemp(prefix="tensorshard-bench-")
        self.made: dict[int | None, str] = {}

    def get(self, layers: int | None = None) -> str:
        if layers not in self.made:
            path = os.path.join(self.folder, f"llama-{layers or 'full'}")
            result = self.runner.job("checkpoint", ["plain"], checkpoint=path, layers=layers)
            if not result.get("ok"):
                raise RuntimeError(f"could not write the benchmark checkpoint: {result.get('error')}")
            self.made[layers] = path
        return self.made[layers]

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def environment_info(runner: Runner) -> dict:
    """Date, machine, and the versions in both environments."""
    import datetime
    import platform

    import torch

    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "device": runner.device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else [],
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"), "tensorshard": _version("tensorshard")},
        "load_average_start": os.getloadavg(),
    }
    if Path(runner.peer_python).exists():
        probe = ("import json, torch, transformers, accelerate, importlib.metadata as m; print(json.dumps({'torch': torch.__version__, "
                 "'transformers': transformers.__version__, 'accelerate': accelerate.__version__, "
                 "'tensor_parallel': m.version('tensor_parallel')}))")
        proc = subprocess.run([runner.peer_python, "-W", "ignore", "-c", probe], capture_output=True, text=True, env=_environment(True))
        info["peer_versions"] = json.loads(proc.stdout) if proc.returncode == 0 else {"error": last_error(proc.stderr)}
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        return m.group(1).strip() if m else platform_processor()
    except OSError:
        return platform_processor()


def platform_processor() -> str:
    import platform

    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    try:
        import importlib.metadata as metadata

        return metadata.version(package)
    except Exception:  # noqa: BLE001
        if package == "tensorshard":
            sys.path.insert(0, str(REPO / "src"))
            try:
                import tensorshard

                return getattr(tensorshard, "__version__", "checkout")
            except ImportError:
                return "?"
        return "?"


def write_json(path: Path | str, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def comparison_main(doc: str, results_name: str, run: Callable, describe: Callable[[Runner], str]) -> None:
    """Command line of one comparison script: parse the shared options, run every job, write its JSON."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    runner = runner_from(args)
    print(f"{describe(runner)}, {'quick' if args.quick else 'full'} sizes")
    with Checkpoints(runner) as checkpoints:
        run_and_write(runner, checkpoints, run, Path(args.results) / results_name)


def run_and_write(runner: Runner, checkpoints: Checkpoints, run: Callable, path: Path) -> None:
    """Run one comparison's jobs and write its JSON: results, sizes, jobs, environment and load averages."""
    meta = environment_info(runner)
    result = run(runner, checkpoints)
    meta["load_average_end"] = os.getloadavg()
    write_json(path, {"meta": meta, "sizes": runner.sizes.to_dict(), **result, "jobs": runner.log})
