"""Reading and running the ```python blocks of a markdown file the way a reader copies them.

Each block stands alone: it runs in a fresh namespace, so it must hold its imports and its model. A block whose
first line is the comment ``# continues the block above`` is the exception a reader can see: it runs in the
namespace the block above it left (which may itself continue the one above it). A block marked skip, on the line
right before its fence, with ``<!-- docs-test: skip (the reason) -->`` is only compiled and its top-level imports
run (it needs GPUs, torchrun, a downloaded model, or it is a sketch).

tests/test_docs_snippets.py runs every file of the docs this way in one fresh process; the per-doc tests check
what those runs printed.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

from support import ROOT

FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.+?)\)\s*-->")
CONTINUES = "# continues the block above"


@dataclass(frozen=True, kw_only=True)
class Block:
    code: str
    line: int  # the block's first line of code in its file (1-based)
    skip: str | None  # the reason it is marked skip, or None
    continues: bool  # its first line is CONTINUES: it runs after the block above, in that block's namespace


def blocks(path: Path) -> list[Block]:
    text = Path(path).read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        code = m.group(1)
        out.append(Block(code=code, line=text.count("\n", 0, m.start()) + 2, skip=skip.group(1) if skip else None,
                         continues=code.lstrip().startswith(CONTINUES)))
    return out


def python_blocks(path: Path) -> list[str]:
    return [b.code for b in blocks(path)]


def run_blocks(name: str, found: list[Block]) -> tuple[list[str], dict]:
    """Run `found` (the blocks of the file `name`) as a reader would: each in a fresh namespace unless it continues
    the block above. Returns the errors (one per failing block, with its line and traceback; a block that continues
    a failed one is not run) and the namespace the last block ran in."""
    errors: list[str] = []
    namespace: dict = {}
    failed = False
    for i, b in enumerate(found):
        where = f"{name}, the block at line {b.line}"
        if b.continues and i == 0:
            errors.append(f"{where} says it continues the block above, but it is the file's first block")
            failed = True
            continue
        if b.continues and failed:
            continue  # the block above failed (reported there)
        if not b.continues:
            namespace = {"__name__": "__main__"}
        failed = False
        try:
            tree = compile(b.code, where, "exec", ast.PyCF_ONLY_AST)
            if b.skip is not None:
                tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            exec(compile(tree, where, "exec"), namespace)
        except BaseException:
            skipped = f" (skipped: {b.skip}; its imports)" if b.skip else ""
            alone = "" if b.continues else " on its own (it does not continue the block above)"
            errors.append(f"{where}{skipped} raised{alone}:\n{traceback.format_exc()}")
            failed = True
    return errors, namespace


def run_python_blocks(path: Path, codes: list[str] | None = None) -> dict:
    """Run `codes` (default: all of `path`'s blocks) in this process as `run_blocks` does; raise AssertionError
    with the errors if one fails, else return the namespace the last block ran in."""
    found = blocks(path) if codes is None else [
        Block(code=c, line=0, skip=None, continues=c.lstrip().startswith(CONTINUES)) for c in codes]
    errors, namespace = run_blocks(str(path), found)
    assert not errors, "\n".join(errors)
    return namespace


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True, kw_only=True)
class DocRun:
    errors: list[str]
    printed: str  # what the file's blocks printed
    folder: Path  # the working folder they ran in (blocks may write files)


# The driver, run once in a fresh process for all files (one start-up, not one per file). Each file gets its own
# working folder; it prints one JSON line per file.
DRIVER = r"""
import json, os, sys
import torch
from support import deprecations
from support.docs import run_captured
torch.set_num_threads(1)
deprecations.install()  # a deprecated call of torch, transformers or peft from a block fails its file
for name, folder in json.load(sys.stdin):
    os.chdir(folder)
    errors, printed = run_captured(name)
    print("DOCS-RESULT " + json.dumps({"file": name, "errors": errors, "printed": printed}), flush=True)
"""


def run_captured(name: str) -> tuple[list[str], str]:
    """Run the blocks of `name` (relative to the repository); return the errors and what the blocks printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        errors, _ = run_blocks(name, blocks(ROOT / name))
    return errors, out.getvalue()


# Where the runs keep their working folders: pytest's temporary folder of the session, set by tests/conftest.py; in a
# `pytest -n N` run, the folder all its workers share (one of them runs the docs, the others read its results).
FOLDER: Path | None = None


@functools.cache
def docs_runs() -> dict[str, DocRun]:
    """Every file of the docs with Python blocks, run once per test session in one fresh process (keyed by the
    path relative to the repository), with TENSORSHARD_TIMEOUT=60. Under pytest-xdist, once per session for all
    its workers: the first to ask runs them under a file lock and saves the results; the others wait and read."""
    from filelock import FileLock  # torch's own dependency

    if FOLDER is None:  # outside a test session
        root = Path(tempfile.mkdtemp(prefix="tensorshard-docs-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    else:
        root = FOLDER
    saved = root / "docs-runs.json"
    with FileLock(str(root / "docs-runs.lock")):
        if not saved.exists():
            found = _run_docs(root / "docs")
            saved.write_text(json.dumps({name: {"errors": r.errors, "printed": r.printed, "folder": str(r.folder)}
                                         for name, r in found.items()}))
    return {name: DocRun(errors=r["errors"], printed=r["printed"], folder=Path(r["folder"]))
            for name, r in json.loads(saved.read_text()).items()}


def _run_docs(base: Path) -> dict[str, DocRun]:
    """The driver's run of every file, each in a working folder of its own under `base`."""
    names = [str(p.relative_to(ROOT)) for p in DOCS if blocks(p)]
    folders = {name: base / name.replace("/", "_") for name in names}
    for folder in folders.values():
        folder.mkdir(parents=True)
    env = dict(os.environ, TENSORSHARD_TIMEOUT="60",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    try:
        done = subprocess.run(
            [sys.executable, "-c", DRIVER], input=json.dumps([(n, str(f)) for n, f in folders.items()]), text=True,
            capture_output=True, cwd=base, env=env, timeout=400,
        )
        stdout, stderr, ended = done.stdout, done.stderr, f"exit {done.returncode}"
    except subprocess.TimeoutExpired as e:  # the files done so far keep their results; the rest fail once
        stdout, stderr, ended = _text(e.stdout), _text(e.stderr), "killed after 400 s"
    found = {}
    for line in stdout.splitlines():
        if line.startswith("DOCS-RESULT "):
            r = json.loads(line.split(" ", 1)[1])
            found[r["file"]] = DocRun(errors=r["errors"], printed=r["printed"], folder=folders[r["file"]])
    for name in names:
        found.setdefault(name, DocRun(errors=[f"the driver stopped before this file ({ended}):\n{stderr[-4000:]}"],
                                      printed="", folder=folders[name]))
    return found


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""
