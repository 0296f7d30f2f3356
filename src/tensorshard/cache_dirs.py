"""Where the library keeps what it builds for later processes: ``$TENSORSHARD_CACHE_DIR``, else
``$XDG_CACHE_HOME/tensorshard``, else ``~/.cache/tensorshard``. Under it: ``native/`` (the native collectives' library,
comm/native/library.py) and ``captures/`` (decode graphs, engines/capture_store.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The library's cache folder, read from the environment at every call."""
    root = os.environ.get("TENSORSHARD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tensorshard")
    return Path(root)
