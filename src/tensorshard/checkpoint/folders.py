"""`open_folder`: the reader for a checkpoint path (a tensorshard checkpoint, a torch.distributed.checkpoint
folder, a Hugging Face safetensors folder or one .safetensors file)."""

from __future__ import annotations

from pathlib import Path

from .dcp import DCPSource
from .index import read_index
from .sources import HF_INDEX_NAME, INDEX_NAME, SafetensorsSource, Source


def open_folder(path: Path) -> tuple[Source, dict | None]:
    """The source for a checkpoint folder or file, and the tensorshard index when there is one."""
    path = Path(path)
    if path.is_dir() and (path / INDEX_NAME).exists():
        index = read_index(path)
        model_files = [f for f in index["files"] if not f.startswith("optimizer/")]
        return SafetensorsSource.from_index(path, index["tensors"], f"tensorshard checkpoint {path}", model_files), index
    if path.is_dir() and (path / ".metadata").exists():
        return DCPSource(path), None
    if path.is_dir():
        return SafetensorsSource.from_hf_folder(path), None
    if path.suffix == ".safetensors":
        return SafetensorsSource.from_files([path], f"safetensors file {path}"), None
    if path.suffix == ".gguf":
        raise ValueError(f"{path} is a GGUF file: load it with tensorshard.from_pretrained(...)")
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    raise ValueError(
        f"{path} is not a checkpoint tensorshard reads: use a folder of safetensors files (with "
        f"{HF_INDEX_NAME} or {INDEX_NAME}), a .safetensors or .gguf file, or a torch.distributed.checkpoint folder"
    )
