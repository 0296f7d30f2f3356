"""The index of a tensorshard sharded checkpoint: ``tensorshard.json``, written last, read first.

    {
      "format": "tensorshard.sharded/1",
      "generation": 3,                      # bumped by every save into the same folder
      "engine": "inprocess", "world_size": 2, "devices": ["cpu[0]", "cpu[1]"],   # or "torchrun", "plain"
      "plan": {...},                        # Plan.to_dict() of the saving model (null for a plain module)
      "zero": ["norm.weight", ...],         # parameters ZeRO-3 partitioned when saving
      "aliases": {"output.weight": "tok_embeddings.weight"},    # tied weights, stored once
      "tensors": {"layers.0.attn.wq.weight": {"shape": [64, 64], "dtype": "float32",
                  "chunks": [{"file": "model-g000003-rank00000-of-00002.safetensors",
                              "offsets": [0, 0], "sizes": [32, 64]}, ...]}, ...},
      "optimizer": null | {"class": ..., "param_groups": [...], "tensors": {...}, "values": {...}},
      "files": [every data file, relative to the folder]
    }

Chunks are boxes of the global tensor (as in torch.distributed.checkpoint); the files carry the same
offsets in their own headers, so the folder also loads without this index (DCP's HuggingFaceStorageReader).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .atomic import atomic_write
from .sources import INDEX_NAME

FORMAT = "tensorshard.sharded/1"
DATA_FILE = re.compile(r"^(model|optim)-g(\d{6})-rank\d{5}-of-\d{5}(-part\d+)?\.safetensors$")


def read_index(folder: Path) -> dict:
    path = Path(folder) / INDEX_NAME
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder} is not a tensorshard sharded checkpoint: {INDEX_NAME} is missing") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}); the checkpoint index is damaged: restore it from a copy, or save the "
            "checkpoint again. Nothing was loaded."
        ) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise ValueError(f"{path}: expected format {FORMAT!r}, found {found!r} (written by another tensorshard version?)")
    for key in ("world_size", "tensors", "files"):
        if key not in index:
            raise ValueError(f"{path}: the index has no {key!r} entry; the checkpoint is damaged")
    return index


def previous_generation(folder: Path) -> int:
    """The generation of the checkpoint already in `folder` (0 when there is none or it is unreadable)."""
    try:
        return int(read_index(folder).get("generation", 0))
    except (OSError, ValueError):
        found = [int(m.group(2)) for p in Path(folder).rglob("*.safetensors") if (m := DATA_FILE.match(p.name))]
        return max(found, default=0)


def data_file_name(kind: str, generation: int, rank: int, world_size: int, part: int) -> str:
    """model-g000003-rank00001-of-00002.safetensors (part 0), ...-part1.safetensors (part 1)."""
    suffix = f"-part{part}" if part else ""
    return f"{kind}-g{generation:06d}-rank{rank:05d}-of-{world_size:05d}{suffix}.safetensors"


def write_index(folder: Path, index: dict) -> None:
    """The commit point of a save: the new index replaces the old one in one rename."""
    with atomic_write(Path(folder) / INDEX_NAME, "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
