"""The dependency ranges pyproject.toml declares, read from it: what the packaging tests install and what
`make test-oldest` pins.

    python tests/support/versions.py floors     # "torch==2.10", "transformers==5.0", ...: pip constraints

Every `name>=X` of the dependencies and of the extras (not `dev`'s test tools) becomes `name==X` (pip's `==2.10` is 2.10.0, the
oldest release the range accepts); names without a floor stay free.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FLOOR = re.compile(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)")


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements() -> list[str]:
    """The dependencies and every extra's but `dev` (the test tools), less the extras naming tensorshard itself."""
    table = project()
    found = list(table["dependencies"])
    for name, extra in table["optional-dependencies"].items():
        if name != "dev":
            found += [r for r in extra if not r.startswith(table["name"])]
    return found


def floors() -> dict[str, str]:
    """{name: the oldest version accepted} for each requirement with a `>=` floor."""
    return {m[1].lower(): m[2] for m in map(_FLOOR.match, requirements()) if m}


if __name__ == "__main__":
    if sys.argv[1:] != ["floors"]:
        sys.exit("usage: python tests/support/versions.py floors")
    print("\n".join(f"{name}=={version}" for name, version in sorted(floors().items())))
