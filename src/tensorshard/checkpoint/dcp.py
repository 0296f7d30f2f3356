"""torch.distributed.checkpoint folders (``.metadata`` + ``*.distcp``, Lightning's format) as a `Source`.

DCP stores each rank's chunks with their offsets in the global tensor, exactly the boxes tensorshard
reasons in. Reading uses DCP itself, in one process without a process group: a small `LoadPlanner`
asks DCP's resharding helper (`create_read_items_for_chunk_list`) for the reads that cover each rank's
boxes, and hands DCP views of the destination tensors to copy into. So a model trained under torchrun
(or Lightning's ModelParallelStrategy / FSDP2) loads into any number of in-process devices.

Keys: Lightning Trainer checkpoints prefix the model's names with ``state_dict.`` (plus the attribute
that holds the model in the LightningModule, e.g. ``state_dict.model.``), Fabric's with ``model.`` (or
whatever key the model was saved under); the prefix under which most of the model's names exist is used.
Only model tensors are read here: restore optimizer state from such folders under torchrun.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from torch.distributed.checkpoint import FileSystemReader, load
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .layout import Box
from .sources import Source, Target


class DCPSource(Source):
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.description = f"torch.distributed.checkpoint folder {self.folder}"
        self.reader_class = FileSystemReader
        try:
            metadata = FileSystemReader(str(self.folder)).read_metadata()
        except Exception as e:  # noqa: BLE001 - a pickle of DCP's classes: any error means a damaged file
            raise ValueError(
                f"{self.folder / '.metadata'} cannot be read ({type(e).__name__}: {e}); the checkpoint is damaged: "
                "restore it, or save it again. Nothing was loaded."
            ) from None
        self.metadata = metadata
        self.all = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self.prefix = ""

    def choose_prefix(self, wanted: Iterable[str]) -> None:
        """Use the key prefix under which most of the model's names are found ("", "model.", ...)."""
        wanted = list(wanted)
        prefixes = {""}
        for key in self.all:  # "state_dict.", "state_dict.model.", ...: up to three leading segments
            parts = key.split(".")
            prefixes |= {".".join(parts[:i]) + "." for i in range(1, min(4, len(parts)))}
        self.prefix = max(sorted(prefixes), key=lambda p: (sum(p + n in self.all for n in wanted), p == ""))

    def names(self) -> list[str]:
        p = self.prefix
        return [k[len(p):] for k in self.all if k.startswith(p)]

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        md = self.all[self.prefix + name]
        return tuple(md.size), md.properties.dtype

    def problems(self, name: str) -> list[str]:
        md = self.all[self.prefix + name]
        covered = sum(Box(tuple(c.offsets), tuple(c.sizes)).numel for c in md.chunks)
        total = Box.whole(tuple(md.size)).numel
        return [] if covered >= total else [f"its chunks hold {covered} of {total} elements"]

    def pieces_along(self, name: str, dim: int) -> list[tuple[int, int]]:
        """The distinct (start, stop) ranges of dimension `dim` that the stored chunks of `name` cover, in
        order: one per saving rank along that dimension for a DTensor sharded there (loader.py uses them to
        recognize the torchrun engine's stacked layout of a fused split)."""
        md = self.all[self.prefix + name]
        return sorted({(c.offsets[dim], c.offsets[dim] + c.sizes[dim]) for c in md.chunks})

    def damage(self) -> list[str]:
        """Data files that are missing or shorter than the metadata says (a truncated copy)."""
        needed: dict[str, int] = {}
        for info in (self.metadata.storage_data or {}).values():
            path = getattr(info, "relative_path", None)
            if path is not None:
                needed[path] = max(needed.get(path, 0), info.offset + info.length)
        out = []
        for path, size in sorted(needed.items()):
            f = self.folder / path
            if not f.exists():
                out.append(f"{path} is missing (.metadata names it)")
            elif f.stat().st_size < size:
                out.append(f"{path} is truncated: .metadata places data up to byte {size}, the file has {f.stat().st_size}")
        return out

    def read(self, name: str, targets: Sequence[Target]) -> None:
        self.read_all([(name, targets)], lambda _: None)

    def read_all(self, requests: Iterable[tuple[str, Sequence[Target]]], done: Callable[[str], None]) -> None:
        requests = {self.prefix + name: list(targets) for name, targets in requests}
        planner = _BoxPlanner(requests, self.all)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            load({}, storage_reader=self.reader_class(str(self.folder)), planner=planner, no_dist=True)
        for key in requests:
            done(key[len(self.prefix):])


def _box_planner_base():
    return LoadPlanner


class _BoxPlanner(_box_planner_base()):
    """Plans reads for given boxes of given tensors; DCP copies each piece into a view of its target."""

    def __init__(self, requests: dict[str, list[Target]], tensors: dict) -> None:
        self.requests = requests
        self.tensors = tensors

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self):
        items = []
        for key, targets in self.requests.items():
            chunks = [ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes)) for box, _ in targets]
            items += create_read_items_for_chunk_list(key, self.tensors[key], chunks)
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise RuntimeError(f"unexpected non-tensor read of {read_item.dest_index.fqn}")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        _, out = self.requests[read_item.dest_index.fqn][read_item.dest_index.index]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            out = out.narrow(dim, offset, length)
        return out

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # DCP copied into the view resolve_tensor returned
