"""Running a markdown file's ```python blocks as written: in order, in one namespace (a later block may use
what an earlier one defined). The per-doc tests use this to check what the examples print; the whole-docs
test (tests/test_docs_snippets.py) runs every file in a fresh process instead."""

from __future__ import annotations

import re
from pathlib import Path

FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return FENCE.findall(Path(path).read_text())


def run_python_blocks(path: Path, blocks: list[str] | None = None) -> dict:
    """Run `blocks` (default: all of `path`'s) and return the namespace they shared."""
    namespace: dict = {}
    for block in python_blocks(path) if blocks is None else blocks:
        exec(compile(block, str(path), "exec"), namespace)
    return namespace
