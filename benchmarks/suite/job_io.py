"""The command line and the result file of a measurement job, shared by job.py (main environment) and
peer_job.py (tensor_parallel's environment): launch.py starts both with the same options."""

from __future__ import annotations

import argparse
import json
import os


def job_parser(description: str, tasks) -> argparse.ArgumentParser:
    """The options every job takes; a job adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--task", choices=sorted(tasks), required=True)
    parser.add_argument("--model", choices=["ff", "llama"], default="llama")
    parser.add_argument("--systems", nargs="+", required=True, help="system or system:devices (in-process)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sizes", required=True, help="JSON of config.Sizes")
    parser.add_argument("--checkpoint", default=None, help="the benchmark Llama's save_pretrained folder")
    parser.add_argument("--layers", type=int, default=None, help="comm: number of decoder layers")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    return parser


def write_result(path: str, result: dict) -> None:
    """The job's JSON result, renamed into place (launch.py never reads a half-written file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)
