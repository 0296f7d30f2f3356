"""Checkpoints as sources of global tensors that can be read box by box.

A `Source` names the tensors of an unsplit model (shape, dtype) and copies any box of any of them into a
tensor the caller provides, on any device. Loading a split model is then the same for every format: each
rank asks for the boxes its placement names (see layout.py).

`SafetensorsSource` covers every safetensors layout: a single file, a Hugging Face folder
(``model.safetensors.index.json``), a tensorshard sharded checkpoint (``tensorshard.json``), or a folder of
chunk files written by `torch.distributed.checkpoint`'s Hugging Face storage (offsets in each file's
``DCP_SHARDING_INFO``). It reads with `safe_open(...).get_slice`, which maps the file and copies only the
requested slice; each tensor's files are opened for that tensor alone, so the mapped pages a read touches
are released before the next tensor (host memory beyond the destination: at most one tensor's pages).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ..logs import get_logger
from .files import DCP_SHARDING_INFO, DTYPES_BY_CODE, DTYPES_BY_NAME, DTYPE_CODES, check_file
from .layout import Box

logger = get_logger(__name__)

INDEX_NAME = "tensorshard.json"  # a tensorshard sharded checkpoint
HF_INDEX_NAME = "model.safetensors.index.json"
HF_SINGLE_NAME = "model.safetensors"

Target = tuple[Box, torch.Tensor]  # a box of the global tensor, and where to copy it (same shape as the box)


@dataclass(frozen=True)
class Chunk:
    """A box of a global tensor stored under `key` in `file`."""

    file: Path
    key: str
    box: Box


@dataclass
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[Chunk] = field(default_factory=list)


class Source(ABC):
    """Global tensors by name; `read` copies boxes of one into caller-provided tensors."""

    description: str = "checkpoint"

    @abstractmethod
    def names(self) -> list[str]: ...

    @abstractmethod
    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]: ...

    @abstractmethod
    def read(self, name: str, targets: Sequence[Target]) -> None:
        """Copy each box of tensor `name` into its target tensor (casting to the target's dtype)."""

    def read_all(self, requests: Iterable[tuple[str, Sequence[Target]]], done: Callable[[str], None]) -> None:
        """Serve many reads; `done(name)` after each. Sources that batch (DCP) override this."""
        for name, targets in requests:
            self.read(name, targets)
            done(name)

    def problems(self, name: str) -> list[str]:
        """What makes tensor `name` unreadable (a missing file, chunks that leave a hole)."""
        return []

    def damage(self) -> list[str]:
        """What is wrong with the checkpoint's files as a whole (truncated files, broken headers, files an
        index names that do not exist), found without reading tensor data."""
        return []

    def close(self) -> None:
        pass


class SafetensorsSource(Source):
    """Global tensors stored whole or in chunks in safetensors files."""

    def __init__(self, tensors: dict[str, TensorInfo], description: str, damaged: list[str] | None = None,
                 listed: Sequence[Path] = (), headers_read: bool = False) -> None:
        self.tensors = tensors
        self.description = description
        self.damaged = list(damaged or [])  # found while reading the headers
        self.listed = list(listed)  # files an index names (checked to exist)
        self.headers_read = headers_read  # from_files read (and checked) every header already
        self._checked: list[str] | None = None

    # -- constructors for each layout ----------------------------------------------------------------------

    @classmethod
    def from_index(cls, folder: Path, section: dict, description: str, files: Sequence[str] = ()) -> "SafetensorsSource":
        """Tensors as listed by a tensorshard index section: name -> {shape, dtype, chunks}; `files`: every
        file the index names (relative to `folder`). Headers are read later, by `damage`."""
        tensors = {}
        for name, spec in section.items():
            dtype = DTYPES_BY_NAME.get(spec["dtype"])
            if dtype is None:
                raise ValueError(f"{folder / INDEX_NAME}: {name} has unknown dtype {spec['dtype']!r}")
            chunks = [
                Chunk(folder / c["file"], c.get("key", name), Box(tuple(c["offsets"]), tuple(c["sizes"]))) for c in spec["chunks"]
            ]
            tensors[name] = TensorInfo(tuple(spec["shape"]), dtype, chunks)
        return cls(tensors, description, listed=[folder / f for f in files])

    @classmethod
    def from_files(cls, files: Sequence[Path], description: str) -> "SafetensorsSource":
        """Tensors found in the headers of `files` (whole, or chunks placed by DCP_SHARDING_INFO)."""
        tensors: dict[str, TensorInfo] = {}
        damaged: list[str] = []
        for path in files:
            try:
                header, problems = check_file(path)
            except ValueError as e:  # a header that cannot be read: nothing else to go on
                raise ValueError(f"{e}. Nothing was loaded.") from None
            damaged += problems
            meta = header.pop("__metadata__", None) or {}
            offsets = json.loads(meta[DCP_SHARDING_INFO]) if DCP_SHARDING_INFO in meta else {}
            for key, spec in header.items():
                shape = tuple(spec["shape"])
                start = tuple(offsets.get(key, {}).get("saved_offsets", (0,) * len(shape)))
                dtype = DTYPES_BY_CODE.get(spec["dtype"])
                if dtype is None:
                    raise NotImplementedError(f"{path}: {key} has dtype {spec['dtype']}, which tensorshard cannot load")
                info = tensors.setdefault(key, TensorInfo(shape, dtype))
                info.chunks.append(Chunk(path, key, Box(start, shape)))
                info.shape = tuple(max(a, o + n) for a, o, n in zip(info.shape, start, shape))
        return cls(tensors, description, damaged, headers_read=True)

    @classmethod
    def from_hf_folder(cls, folder: Path) -> "SafetensorsSource":
        index = folder / HF_INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted({folder / f for f in weight_map.values()})
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(
                    f"{index} is damaged ({type(e).__name__}: {e}); restore it or save the checkpoint again"
                ) from None
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise FileNotFoundError(
                    f"{index} names {len(missing)} file(s) that do not exist: {describe_names(missing)}. Copy the "
                    "missing file(s) into the folder, or save the checkpoint again. Nothing was loaded."
                )
            return cls.from_files(files, f"safetensors checkpoint {folder}")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder} holds no .safetensors files (nor {HF_INDEX_NAME}, {INDEX_NAME})")
        return cls.from_files(files, f"safetensors checkpoint {folder}")

    # -- reading ---------------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = self.tensors[name]
        return t.shape, t.dtype

    def problems(self, name: str) -> list[str]:
        t = self.tensors[name]
        out = [f"file {c.file.name} is missing" for c in t.chunks if not c.file.exists()]
        whole = Box.whole(t.shape)
        volume = 0
        for i, c in enumerate(t.chunks):
            if c.box.intersect(whole) != c.box:
                out.append(f"chunk at {list(c.box.offsets)} of size {list(c.box.sizes)} lies outside {list(t.shape)}")
            volume += c.box.numel
            if any(c.box.intersect(d.box) is not None for d in t.chunks[:i]):
                out.append(f"chunks overlap at {list(c.box.offsets)}")
        if volume < whole.numel:
            out.append(f"its chunks hold {volume} of {whole.numel} elements (a rank's file is missing from the index)")
        return out

    def damage(self) -> list[str]:
        """Reads each file's header once: truncated files, broken headers, and chunks an index places in a
        file that does not hold them as announced."""
        if self._checked is not None:
            return self._checked
        out = list(self.damaged)
        missing = [str(p.name) for p in self.listed if not p.exists()]
        if missing:
            out.append(f"the index names {len(missing)} file(s) that do not exist: {describe_names(missing)}")
        by_file: dict[Path, list[tuple[str, Chunk]]] = {}
        for name, info in self.tensors.items():
            for c in info.chunks:
                by_file.setdefault(c.file, []).append((name, c))
        for path, chunks in by_file.items():
            if not path.exists() or self.headers_read:  # missing: named per tensor (problems)
                continue
            try:
                header, problems = check_file(path)
            except ValueError as e:
                out.append(str(e))
                continue
            out += problems
            for name, c in chunks:
                spec = header.get(c.key)
                code = DTYPE_CODES.get(self.tensors[name].dtype)
                if spec is None:
                    out.append(f"{path.name} does not hold {c.key}, which the index places there")
                elif list(spec.get("shape", ())) != list(c.box.sizes) or spec.get("dtype") != code:
                    out.append(
                        f"{path.name}: {c.key} is {spec.get('shape')} {spec.get('dtype')}, the index says "
                        f"{list(c.box.sizes)} {code}"
                    )
        self._checked = out
        return out

    def read(self, name: str, targets: Sequence[Target]) -> None:
        from safetensors import safe_open  # deferred: optional heavy dependency (the [hf] extra)

        info = self.tensors[name]
        handles: dict[Path, object] = {}
        try:
            for box, out in targets:
                filled = 0
                for chunk in info.chunks:
                    part = box.intersect(chunk.box) if box.sizes else box
                    if part is None:
                        continue
                    f = handles.get(chunk.file)
                    if f is None:
                        f = handles[chunk.file] = safe_open(str(chunk.file), framework="pt")
                    if part.sizes:  # a view of the mapped file; copy_ reads just these bytes
                        out[part.within(box)].copy_(f.get_slice(chunk.key)[part.within(chunk.box)])
                    else:  # a 0-dim tensor
                        out.copy_(f.get_tensor(chunk.key))
                    filled += part.numel
                if filled != box.numel:
                    raise RuntimeError(f"{name}: the checkpoint holds only {filled} of the {box.numel} elements asked for")
        finally:
            handles.clear()  # unmaps the files: their pages no longer count against this process


def describe_names(names: Sequence[str], limit: int = 8) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
