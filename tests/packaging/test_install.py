"""tensorshard as a new user installs it: a wheel built from this tree, installed into a fresh venv with only
the dependencies pyproject.toml declares, run from outside the tree.

- the bare install (`pip install tensorshard`: torch and tqdm) runs the README's one-line example and
  `tensorshard --help`, with no undeclared package (numpy) imported on the way: part of `make test`, about a
  minute, most of it pip unpacking torch;
- each extra (`[hf]`, `[peft]`, `[lightning]`, `[quant]`) runs its own example, extras/EXTRA_example.py: minutes each, so
  only under `make test-extras` (TENSORSHARD_TEST_EXTRAS=1).

torch is pinned to the version this suite runs with, so pip reuses the wheel it came from (here a local CPU
wheel found through PIP_FIND_LINKS) instead of fetching the newest CUDA build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from support.docs import python_blocks
from support.versions import ROOT

EXTRAS = Path(__file__).parent / "extras"
TORCH = torch.__version__.split("+")[0]  # 2.13.0+cpu -> 2.13.0: the same release, whatever its local build


def _run(args, *, cwd: Path, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # nothing of this tree
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of this tree, built from a copy of what the wheel needs (the build writes nothing here)."""
    tree = tmp_path_factory.mktemp("tree")
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    out = tree / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, tree], cwd=tree, timeout=300)
    (found,) = out.glob("tensorshard-*.whl")
    return found


def test_the_wheel_carries_the_native_collectives_source(wheel):
    """comm/native/collectives.cpp is compiled on the user's machine on first use: the wheel must ship it."""
    with zipfile.ZipFile(wheel) as z:
        assert "tensorshard/comm/native/collectives.cpp" in z.namelist()


def _fresh_venv(where: Path, wheel: Path, extra: str = "") -> Path:
    """A venv holding the wheel (with `extra`) and what pip resolves for it, nothing else; returns its python.
    --no-compile: the .pyc files are left to the first import (most of torch's and sympy's modules are never
    imported here); byte-compiling them all was most of pip's time."""
    subprocess.run([sys.executable, "-m", "venv", where], check=True, timeout=120)
    python = where / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", "--no-compile", f"tensorshard{extra} @ {wheel.as_uri()}",
          f"torch=={TORCH}"], cwd=where, timeout=900)
    return python


@pytest.mark.timeout(600)
def test_bare_install_runs_the_readme_example_and_the_cli(wheel, tmp_path):
    python = _fresh_venv(tmp_path / "venv", wheel)
    installed = _run([python, "-m", "pip", "list", "--format=freeze"], cwd=tmp_path, timeout=120)
    assert "numpy" not in installed.lower()  # the point: a venv with only the declared dependencies

    example = next(b for b in python_blocks(ROOT / "README.md") if 'tp.tensor_parallel(model, ["cpu", "cpu"])' in b)
    (tmp_path / "example.py").write_text(example + "\nprint(tp.__file__)\n")
    out = _run([python, "example.py"], cwd=tmp_path, timeout=300)
    assert "ColwiseParallel()" in out and "RowwiseParallel()" in out, out  # print(model.plan)
    assert "'cpu[0]'" in out and "'cpu[1]'" in out, out                      # print(model.memory_per_device())
    assert str(tmp_path / "venv") in out.splitlines()[-1], out                # the wheel's copy, not this tree

    usage = _run([tmp_path / "venv" / "bin" / "tensorshard", "--help"], cwd=tmp_path, timeout=300)
    assert usage.startswith("usage: tensorshard"), usage


@pytest.mark.skipif(not os.environ.get("TENSORSHARD_TEST_EXTRAS"), reason="minutes per extra: `make test-extras`")
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("extra", ["hf", "peft", "lightning", "quant"])
def test_extra_runs_its_example(wheel, tmp_path, extra):
    python = _fresh_venv(tmp_path / "venv", wheel, f"[{extra}]")
    # named extra_example.py, not peft.py: the script's folder comes first on sys.path and would shadow peft
    out = _run([python, EXTRAS / f"{extra}_example.py"], cwd=tmp_path, timeout=600)
    assert f"{extra} ok" in out, out
