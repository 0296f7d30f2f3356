"""Safetensors files written one tensor at a time, in the layout torch.distributed.checkpoint reads.

The safetensors format is an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape,
byte range; plus free-form string metadata under ``__metadata__``), then the raw bytes. Because the header
only needs shapes and dtypes, `write_safetensors` writes it first and then streams each tensor from its
device to disk, so saving never holds more than one tensor in host memory (`safetensors.torch.save_file`
needs them all at once).

A file that holds a *chunk* of a larger tensor records where the chunk sits the way
`torch.distributed.checkpoint`'s Hugging Face storage does (``DCP_SHARDING_INFO``: key ->
``{"saved_offsets": [...]}``), so `HuggingFaceStorageReader` loads our sharded checkpoints and we load its.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Callable, Sequence

import torch

from .atomic import staged_file

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}
DTYPES_BY_NAME = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPE_CODES}

# The keys torch.distributed.checkpoint's safetensors storage uses (torch/distributed/checkpoint/_hf_utils.py).
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
DCP_VERSION = "DCP_VERSION"


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32" (the spelling of checkpoint indexes)."""
    if dtype not in DTYPE_CODES:
        raise NotImplementedError(f"tensors of dtype {dtype} cannot be stored in safetensors files")
    return str(dtype).removeprefix("torch.")


@dataclass
class FileEntry:
    """One tensor to write: its key, shape and dtype now, its data (any device) when its turn comes."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    data: Callable[[], torch.Tensor]
    offsets: tuple[int, ...] | None = None  # where this chunk sits in the global tensor (None: whole)


def write_safetensors(path: Path, entries: Sequence[FileEntry], metadata: dict[str, str] | None = None) -> Path:
    """Write `entries` to a staged (temporary) file beside `path`; return the temporary path.

    The caller renames it into place with `atomic.publish` once every file of the checkpoint is written.
    """
    header: dict[str, object] = {}
    meta = dict(metadata or {})
    if any(e.offsets is not None for e in entries):
        meta[DCP_SHARDING_INFO] = json.dumps(
            {e.key: {"saved_offsets": list(e.offsets if e.offsets is not None else (0,) * len(e.shape))} for e in entries}
        )
        meta.setdefault(DCP_VERSION, "1.0")
    meta.setdefault("format", "pt")
    header["__metadata__"] = meta
    offset = 0
    for e in entries:
        code = DTYPE_CODES.get(e.dtype)
        if code is None:
            raise NotImplementedError(f"{e.key}: tensors of dtype {e.dtype} cannot be stored in safetensors files")
        nbytes = prod(e.shape) * torch.empty((), dtype=e.dtype).element_size()
        header[e.key] = {"dtype": code, "shape": list(e.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned

    with staged_file(path) as (f, tmp):
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            tensor = e.data()
            if tuple(tensor.shape) != tuple(e.shape) or tensor.dtype != e.dtype:
                raise RuntimeError(
                    f"{e.key}: announced {tuple(e.shape)} {e.dtype}, got {tuple(tensor.shape)} {tensor.dtype} "
                    "(the model changed while it was being saved?)"
                )
            _write_tensor(f, tensor)
            del tensor
    return tmp


def _write_tensor(f, tensor: torch.Tensor) -> None:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        f.write(memoryview(flat.view(torch.uint8).numpy()))


def _read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(header, offset of the data section)."""
    fix = "the file is damaged or not a safetensors file: restore it, or save the checkpoint again"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: shorter than 8 bytes, so it has no safetensors header; {fix}")
        (size,) = struct.unpack("<Q", head)
        if size > 100_000_000:
            raise ValueError(f"{path}: the header length field says {size} bytes; {fix}")
        raw = f.read(size)
    if len(raw) < size:
        raise ValueError(f"{path}: the header is cut off ({len(raw)} of {size} bytes; the file is truncated); {fix}")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: the header is not valid JSON ({e}); {fix}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is a JSON {type(header).__name__}, not an object; {fix}")
    return header, 8 + size


def check_file(path: str | os.PathLike) -> tuple[dict, list[str]]:
    """The header of a safetensors file and what is wrong with the file: a data section shorter than the
    header announces (a truncated file), entries without a valid dtype, shape or byte range. Reads the
    header only. A header that cannot be read raises ValueError."""
    header, start = _read_header(path)
    size = os.path.getsize(path)
    problems = []
    end = 0
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        try:
            a, b = (int(x) for x in spec["data_offsets"])
            shape = [int(n) for n in spec["shape"]]
            itemsize = torch.empty((), dtype=DTYPES_BY_CODE[spec["dtype"]]).element_size()
        except (KeyError, TypeError, ValueError):
            problems.append(f"{Path(path).name}: the entry of {key} is malformed ({spec!r:.80})")
            continue
        if b - a != prod(shape) * itemsize:
            problems.append(f"{Path(path).name}: {key} has {b - a} bytes for shape {shape} {spec['dtype']}")
        end = max(end, b)
    if start + end > size:
        problems.append(
            f"{Path(path).name} is truncated: its header announces {start + end} bytes, the file has {size}"
        )
    return header, problems
