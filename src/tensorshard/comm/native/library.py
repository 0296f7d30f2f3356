"""Building and loading the native collectives (collectives.cpp beside this file) on first use.

    from tensorshard.comm.native import library
    if library.load():            # True once torch.ops.tensorshard.native_* exist in this process
        ...
    library.why_not()             # else: why not (also logged once, at warning level)

The library is compiled once per machine and cached: `~/.cache/tensorshard/native/<key>/` (or under
TENSORSHARD_CACHE_DIR, else XDG_CACHE_HOME), the key hashing the source, torch's version and C++ ABI, the
compiler's path and version. The compiler is the one torch's inductor uses on CPU (CXX, else g++, c++, clang++:
whichever is found first); the command is a single compile-and-link against torch's headers and libc10 /
libtorch_cpu, with no ninja and no Python headers (the source reaches the GIL through the running process's
symbols). Processes that build at once (torchrun ranks) take a file lock: one compiles, the others load its result.
Where there is no compiler or the build fails, `load()` returns False and says why once; callers keep the Python
collectives. TENSORSHARD_NATIVE=0 turns the native collectives off.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from ...cache_dirs import cache_root
from ...logs import get_logger
from ...switches import switched_on

logger = get_logger(__name__)

ENV = "TENSORSHARD_NATIVE"  # "0": never build or load; the Python collectives carry everything
SOURCE = Path(__file__).with_name("collectives.cpp")
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-w")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "why": str, "seconds": build time (0.0 when cached)


def enabled() -> bool:
    return switched_on(ENV)


def load() -> bool:
    """Build (first time on this machine) and load the library into this process. False, with the reason logged
    once, when native collectives are turned off, unsupported here, or the build failed."""
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            ok, why = _load()
            _state.update(ok=ok, why=why)
            if not ok:
                logger.warning("native collectives unavailable, the Python collectives carry them instead: %s", why)
    return bool(_state["ok"])


def why_not() -> str:
    """Why `load()` returned False ('' when it did not, or was not called)."""
    return str(_state.get("why", ""))


def build_seconds() -> float | None:
    """How long this process spent compiling the library (0.0 when it came from the cache; None before load)."""
    value = _state.get("seconds")
    return None if value is None else float(value)


def _load() -> tuple[bool, str]:
    if not enabled():
        return False, f"{ENV}=0"
    if not sys.platform.startswith("linux"):
        return False, f"built for Linux only (this is {sys.platform})"
    compiler = find_compiler()
    if compiler is None:
        return False, "no C++ compiler found (set CXX, or install g++: torch.compile on CPU needs one as well)"
    try:
        library = _built(compiler)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"building {SOURCE.name} with {compiler} failed: {_short(e)}"
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as e:
        return False, f"loading {library} failed: {_short(e)}"
    return True, ""


def find_compiler() -> str | None:
    """The C++ compiler: CXX, else the first of g++, c++, clang++ on PATH."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name:
            found = shutil.which(name)
            if found:
                return found
    return None


def cache_dir() -> Path:
    return cache_root() / "native"


def _key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(),
                 compiler.encode(), version.encode(), " ".join(FLAGS).encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _built(compiler: str) -> Path:
    """The cached library for this source, torch and compiler; compiled now when missing."""
    folder = cache_dir() / _key(compiler)
    library = folder / "tensorshard_native.so"
    if library.exists():
        _state["seconds"] = 0.0
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait, then use its result
        if library.exists():
            _state["seconds"] = 0.0
            return library
        began = time.perf_counter()
        partial = folder / f"tensorshard_native.{os.getpid()}.so"
        subprocess.run(_command(compiler, partial), check=True, capture_output=True, text=True, timeout=600)
        os.replace(partial, library)
        _state["seconds"] = time.perf_counter() - began
        logger.info("built the native collectives in %.1f s (%s, cached in %s)", _state["seconds"],
                    os.path.basename(compiler), folder)
    return library


def _command(compiler: str, out: Path) -> list[str]:
    root = Path(torch.__file__).parent  # torch's headers and libraries, as torch.utils.cpp_extension finds them
    includes = [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    libraries = [f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}"]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [compiler, *FLAGS, abi, *includes, str(SOURCE), "-o", str(out), *libraries, "-lc10", "-ltorch_cpu"]


def _short(error: BaseException) -> str:
    text = getattr(error, "stderr", None) or str(error)
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return " / ".join(lines[-3:])[:600] if lines else type(error).__name__
