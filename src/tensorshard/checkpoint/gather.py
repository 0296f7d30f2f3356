"""Gathered saving: the state dict of the unsplit model, assembled from the shards one tensor at a time.

    with tp.save_tensor_parallel(model):
        torch.save(model.state_dict(), "model.pt")   # unsplit keys and shapes, loadable by a plain model

`gathered_state_dict(model)` yields ``(name, tensor)`` pairs in the original model's order, each tensor
assembled on the CPU just before it is yielded, so a caller that writes and drops each tensor never holds
more than one gathered tensor besides the shards. Keys are the original module's (no ``module_shards.N``).

`save_gathered(model, folder)` writes the same tensors straight to Hugging Face-style safetensors files,
one tensor at a time, atomically.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from .atomic import atomic_write, fsync_dir, publish
from .files import FileEntry, write_safetensors
from .sources import HF_INDEX_NAME, HF_SINGLE_NAME

from .layout import ModelLayout, TensorEntry, is_split_model, model_layout

logger = logging.getLogger(__name__)


def gather_entry(layout: ModelLayout, entry: TensorEntry, device: torch.device | str = "cpu") -> torch.Tensor:
    """One tensor of the unsplit model, assembled from every rank's part on `device` (a new tensor)."""
    pieces = [layout.local(entry, r).detach() for r in range(layout.world_size)]
    if entry.placement is None:
        return pieces[0].to(device, copy=True)
    dim, partition = entry.placement
    return partition.assemble([p.to(device) for p in pieces], dim)


def gathered_state_dict(model: nn.Module, *, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the unsplit model's state dict entries, one gathered tensor at a time (on `device`).

    Tied weights are gathered once and yielded under each of their names (the same tensor, as a plain
    model's state dict has them).
    """
    if not is_split_model(model):
        raise TypeError(f"gathered_state_dict needs a TensorParallel model; got {type(model).__name__}")
    layout = model_layout(model)  # the plan's splits, and ZeRO-3's partitions of the rest
    by_name = layout.by_alias()
    tied: dict[str, torch.Tensor] = {}
    for name in layout.shards[0].state_dict(keep_vars=True):  # persistent buffers only, as a plain model saves
        entry = by_name[name]
        tensor = tied.get(entry.name)
        if tensor is None:
            tensor = gather_entry(layout, entry, device)
            if entry.aliases:
                tied[entry.name] = tensor
        yield name, tensor


@contextmanager
def save_tensor_parallel(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``model.state_dict()`` returns the unsplit model's state dict (as the
    tensor_parallel package's context of the same name does)."""
    if getattr(model, "splits", None) is None:
        raise TypeError(f"save_tensor_parallel needs a TensorParallel model; got {type(model).__name__}")
    model._gather_state_dict = True
    try:
        yield model
    finally:
        model._gather_state_dict = False


def save_gathered(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    progress: bool = True,
) -> Path:
    """Write the unsplit model's weights to the folder `path` in the Hugging Face safetensors layout.

    ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` files of at most `max_shard_size` bytes
    plus ``model.safetensors.index.json``: what `transformers` (and `tp.from_pretrained`) load. Tied
    weights are stored once, under their first name. Tensors are gathered and written one at a time, so
    host memory holds one gathered tensor at most (a plain ``torch.save`` of the state dict holds them all).

    Safe against interruption: files are written under temporary names; new data files never take the
    name of a file the current index uses; the index (or the single file) is renamed into place last, and
    only then are the previous files removed.
    """
    if not is_split_model(model):
        raise TypeError(f"save_gathered needs a TensorParallel model; got {type(model).__name__}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    layout = model_layout(model)
    entries = [e for e in layout if e.persistent]
    limit = _parse_size(max_shard_size)
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    old = _hf_files(folder)
    names = _fresh_names(len(groups), old)
    total = sum(e.nbytes for e in entries)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"saving {folder.name}", disable=not progress, leave=False)
    renames = []
    try:
        for file_name, group in zip(names, groups):
            items = [FileEntry(e.name, e.shape, e.dtype, _counted(bar, e, partial(gather_entry, layout, e))) for e in group]
            renames.append((write_safetensors(folder / file_name, items), folder / file_name))
        publish(renames)
    except BaseException:
        for tmp, _ in renames:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    if len(groups) > 1:
        weight_map = {e.name: file_name for file_name, group in zip(names, groups) for e in group}
        total = sum(e.nbytes for e in entries)
        with atomic_write(folder / HF_INDEX_NAME, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    for stale in old - set(names) - ({HF_INDEX_NAME} if len(groups) > 1 else set()):
        (folder / stale).unlink(missing_ok=True)
    fsync_dir(folder)
    logger.info("saved the unsplit %s to %s (%d file(s))", type(model).__name__, folder, len(groups))
    return folder


def _counted(bar, entry, get):
    def run():
        t = get()
        bar.update(entry.nbytes)
        return t

    return run


def _hf_files(folder: Path) -> set[str]:
    """Files of the Hugging Face checkpoint already in `folder` (its index, single file, or shards)."""
    found = set()
    if (folder / HF_SINGLE_NAME).exists():
        found.add(HF_SINGLE_NAME)
    index = folder / HF_INDEX_NAME
    if index.exists():
        found.add(HF_INDEX_NAME)
        try:
            found |= set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError):
            pass
    return found


def _fresh_names(count: int, taken: set[str]) -> list[str]:
    if count == 1:
        return [HF_SINGLE_NAME]  # replaced in one rename: readers see the old file or the new one
    for tag in ("",) + tuple(f"-{i}" for i in range(1, 1000)):
        names = [f"model{tag}-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
        if not taken.intersection(names):
            return names
    raise RuntimeError("could not find free file names for the checkpoint")


def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    if isinstance(size, str):
        text = size.strip().upper()
        for unit, factor in units.items():
            if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
                return int(float(text[: -len(unit)]) * factor)
    raise ValueError(f"max_shard_size={size!r}: use a positive number of bytes or a string like '500MB' or '5GB'")
