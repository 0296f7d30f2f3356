"""torch's, transformers' and peft's deprecation warnings, raised by a call from tensorshard's own code, fail.

    install()    # in each test (tests/conftest.py) and in the docs' child process (tests/test_docs_snippets.py)

A deprecation is a DeprecationWarning, PendingDeprecationWarning or FutureWarning, or any warning or
transformers log record whose text says "deprecated", issued from inside one of those libraries. Who made the
call: walking out of the stack from where it was issued, the first frame outside that library (and outside
nn.Module's call machinery, which runs a model's forward). Ours when that frame is in src/tensorshard, in a
doc's example (README.md, docs/*.md) or in examples/; then the warning is raised as an error in that call.
The tests' own calls, and one library's deprecated call into another (peft reading a transformers property),
only warn (pytest lists them).

A tensorshard frame that only passes its caller's keyword arguments on (it holds them in a dict, its
**kwargs, with the deprecated keyword the warning names) is looked past, and so is the in-process engine
(engines/inprocess/), which runs a split model's call in worker threads: then the call is the first frame
outside tensorshard and the libraries, in that thread or, from a worker, in the thread that called the split
model (the main thread). A warning issued while a library imports one of its own modules (torch's modules
decorating with `torch.jit.script_method` when inductor first loads them) is the library's, whoever caused
the import.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src" / "tensorshard")
FORWARDER = str(ROOT / "src" / "tensorshard" / "engines" / "inprocess")
LIBRARIES = ("torch", "transformers", "peft")
_CATEGORIES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def _library(filename: str) -> str | None:
    """Which of LIBRARIES `filename` belongs to (None: none of them)."""
    if "site-packages" not in filename:
        return None
    return next((name for name in LIBRARIES if f"/{name}/" in filename.replace("\\", "/")), None)


def _passed(filename: str, library: str) -> bool:
    """A frame the call goes through on its way into `library`: the library's own, nn.Module's call, frozen."""
    return (
        _library(filename) == library or filename.replace("\\", "/").endswith("torch/nn/modules/module.py")
        or filename.startswith("<frozen")
    )


def _ours(filename: str) -> bool:
    name = filename.replace("\\", "/")
    doc = name.split(",")[0]  # the docs' driver names a block "docs/x.md, the block at line N"
    return (
        (name.startswith(SRC) and not name.startswith(FORWARDER))
        or doc.endswith("README.md") or (doc.endswith(".md") and "docs/" in doc)
        or name.startswith(str(ROOT / "examples"))
    )


def _forwards(frame, names: set[str]) -> bool:
    """`frame` holds a dict (its **kwargs) with a keyword the warning names: it passes on its caller's argument."""
    return bool(names) and any(isinstance(v, dict) and not names.isdisjoint(v) for v in frame.f_locals.values())


def _caller(frame, library: str, names: set[str], *, past_tensorshard: bool = False):
    """The first frame from `frame` outward that `library` did not run and that did not only pass on its caller's
    arguments (past every tensorshard frame if asked)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if frame.f_code.co_name == "<module>" and _library(name) == library:
            return None  # the library's own module body, run by an import: its deprecation, whoever imported it
        if name.startswith(FORWARDER) or (name.startswith(SRC) and _forwards(frame, names)):
            past_tensorshard = True  # forwarded: the call is whoever called this code
        elif not _passed(name, library) and not (past_tensorshard and name.startswith(SRC)):
            return frame
        frame = frame.f_back
    return None


def origin(frame, text: str = "") -> str | None:
    """The file of the frame that made the call issuing a warning at `frame` (see the module docstring); `text`,
    the warning's, names the deprecated keywords in backquotes."""
    library = _library(frame.f_code.co_filename) if frame is not None else None
    if library is None:
        return None  # issued outside the libraries: not theirs to deprecate
    names = set(re.findall(r"`(\w+)`", text))
    found = _caller(frame, library, names)
    if found is None and threading.current_thread() is not threading.main_thread():
        main = sys._current_frames().get(threading.main_thread().ident)
        found = _caller(main, library, names, past_tensorshard=True)
    return found.f_code.co_filename if found is not None else None


def _check(text: str, frame) -> None:
    where = origin(frame, text)
    if where is not None and _ours(where):
        raise DeprecationError(f"a deprecated call from {where}: {text}")


class DeprecationError(AssertionError):
    """tensorshard's code, a doc's example or an example used a deprecated API of torch, transformers or peft."""


def _issuer():
    """The frame that called warnings.warn (or the C code's Python caller)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(("warnings.py", "deprecations.py")):
        frame = frame.f_back
    return frame


class _DeprecatedLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING and "deprecated" in record.getMessage().lower():
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename != record.pathname:
                frame = frame.f_back
            _check(record.getMessage(), frame)


_LOG_HANDLER = _DeprecatedLog()


def install() -> None:
    """Raise our deprecated calls from now on (inside pytest's per-test warning capture: once per test)."""
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, _CATEGORIES) or "deprecated" in str(message).lower():
            _check(f"{category.__name__}: {message}", _issuer())
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    for category in _CATEGORIES:  # every time, not once per place: a later call from our code must show too
        warnings.simplefilter("always", category)
    logger = logging.getLogger("transformers")
    if _LOG_HANDLER not in logger.handlers:
        logger.addHandler(_LOG_HANDLER)
    once = getattr(logging.Logger, "warning_once", None)  # transformers' once-per-process logging
    if hasattr(once, "cache_clear"):
        once.cache_clear()
