"""Sharded checkpoints: every device writes only its own slices; any device count loads them back.

    tp.save_sharded(model, "ckpt", optimizer=opt)      # at 2 devices
    tp.load_sharded(model3, "ckpt", optimizer=opt3)    # at 3 devices (or 1, or 4), bit for bit

The folder holds, per rank, safetensors files of that rank's slices (each slice stored once: replicated
tensors by the first rank holding them), optimizer state the same way under ``optimizer/``, and the index
``tensorshard.json`` (plan, device count, and for every tensor the boxes each file holds). Loading computes
the boxes each rank of the *loading* model needs from its own plan and reads the overlapping parts of
the stored ones (layout.py), so device count, plan and ZeRO-3 may all differ between save and load.

Files carry their boxes in the header in torch.distributed.checkpoint's safetensors layout, so
``dcp.load(state_dict, storage_reader=HuggingFaceStorageReader("ckpt"))`` reads the model too.

Nothing is lost: data files get names of a new *generation* and are written under temporary names; the
index, renamed into place last, is the commit point; only then are the previous generation's files
deleted. A save killed at any moment leaves the previous checkpoint loadable. Loading checks names,
shapes, dtypes, and that the stored boxes cover every tensor, and names whatever does not fit before it
changes anything.

Under torchrun (a module split by `parallelize`) the same folder is written rank by rank: every process
calls `save_sharded`; tensor-parallel rank r writes rank r's files, global rank 0 picks the generation and
writes the index once every rank's files are in place; every process of `load_sharded` reads only its
rank's boxes. Each step that can fail on some ranks only ends in an agreement (torchrun.py), so an error on
one rank is raised on all of them.

Memory: saving moves one slice at a time to the host; loading reads one tensor at a time (sources.py).
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ..logs import get_logger
from ..plans.plan import Plan
from .atomic import atomic_write, fsync_dir, is_temp_name, publish
from .describe import model_layout
from .files import FileEntry, dtype_name, write_safetensors
from .folders import open_folder
from .index import DATA_FILE, FORMAT, data_file_name, previous_generation, read_index, write_index
from .layout import ModelLayout, local_view, saved_pieces
from .loader import fill, match_tensors
from .optimizer_state import check_optimizer_section, load_optimizer, optimizer_files
from .sources import INDEX_NAME, SafetensorsSource
from .torchrun import job_of

logger = get_logger(__name__)

OPTIMIZER_DIR = "optimizer"


def save_sharded(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write `model` (and `optimizer`'s state) to the folder `path`, each device its own slices.

    Works for a `TensorParallel` model at any device count, for a plain module (one rank), and under
    torchrun for a module split by `parallelize`: there every process calls it, each tensor-parallel rank
    writes its own files and global rank 0 writes the index once all are written (the folder must be on a
    file system every process sees). A checkpoint already in `path` is replaced only once the new one is
    complete. Returns the folder.

    Args:
        optimizer: an optimizer over ``model.parameters()``; its state and hyperparameters are saved too.
        metadata: strings stored in the index (e.g. ``{"step": "1200"}``), returned by `read_index`.
    """
    folder = Path(path)
    layout = model_layout(model)
    layout.refuse_quantized()
    job = job_of(layout)

    def prepare() -> int | None:
        _refuse_meta(layout)
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file; save_sharded writes a folder")
        if not job.coordinator:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        return previous_generation(folder) + 1

    generation = job.agree("preparing the checkpoint folder", prepare)[0]
    world = layout.world_size
    renames: list[tuple[Path, Path]] = []

    def write() -> dict | None:
        if not layout.writes:
            return None  # a data-parallel replica: the writing group holds the same tensors
        tensors = _write_model_files(layout, folder, generation, renames)
        section = None
        if optimizer is not None:
            section = _write_optimizer_files(layout, optimizer, folder, generation, renames)
        devices = [str(d) for d in getattr(model, "labels", layout.devices)]
        if job.distributed:
            devices = [f"{layout.devices[layout.rank]} (rank {job.rank})"]
        return {"tensors": tensors, "optimizer": section, "devices": devices,
                "files": [str(final.relative_to(folder)) for _, final in renames]}

    try:
        written = [w for w in job.agree("writing the checkpoint files", write) if w is not None]
        tensors, optimizer_section, devices, files = _merge(written)
        job.agree("renaming the files into place", lambda: publish(renames))
    except BaseException:
        for tmp, _ in renames:  # this rank's staged files; the old index still rules
            tmp.unlink(missing_ok=True)
        raise
    index = {
        "format": FORMAT,
        "generation": generation,
        "engine": layout.engine,
        "world_size": world,
        "devices": devices,
        "plan": _plan_data(layout.plan),
        "zero": layout.zero,
        "aliases": {a: e.name for e in layout if e.persistent for a in e.aliases},
        "tensors": tensors,
        "optimizer": optimizer_section,
        "files": files,
        "metadata": dict(metadata or {}),
    }

    def commit() -> None:
        if job.coordinator:
            _write_config(model, folder)  # tp.from_pretrained(folder) then needs no model=
            write_index(folder, index)  # the commit point
            _remove_stale(folder, set(files))

    job.agree("writing the index", commit)
    if job.coordinator:
        logger.info(
            "saved %s at %d device(s) to %s: %d tensors in %d files%s", type(model).__name__, world, folder,
            len(tensors), len(files), ", with optimizer state" if optimizer else "",
        )
    return folder


def _merge(written: list[dict]) -> tuple[dict, dict | None, list[str], list[str]]:
    """One index from what each writing process wrote (in rank order): chunk lists joined."""
    tensors: dict = {}
    section = None
    devices, files = [], []
    for part in written:
        for name, spec in part["tensors"].items():
            tensors.setdefault(name, {**spec, "chunks": []})["chunks"] += spec["chunks"]
        if part["optimizer"] is not None:
            if section is None:
                section = {**part["optimizer"], "tensors": {}}
            elif part["optimizer"]["kinds"] != section["kinds"]:
                raise RuntimeError(
                    "the optimizer holds state for different parameters on different ranks; step every rank "
                    "before saving"
                )
            for name, spec in part["optimizer"]["tensors"].items():
                section["tensors"].setdefault(name, {**spec, "chunks": []})["chunks"] += spec["chunks"]
        devices += part["devices"]
        files += part["files"]
    return tensors, section, devices, sorted(files)


def _write_model_files(layout: ModelLayout, folder: Path, generation: int, renames: list) -> dict:
    """The slices of every persistent tensor held here, rank by rank; returns the index's "tensors"
    section with the chunks written here."""
    entries = [e for e in layout if e.persistent]
    tensors = {e.name: {"shape": list(e.shape), "dtype": dtype_name(e.dtype), "chunks": []} for e in entries}
    for rank in layout.ranks:
        parts: list[list[FileEntry]] = []
        for e in entries:
            for k, (box, start) in enumerate(saved_pieces(e.shape, e.placement, rank)):
                while len(parts) <= k:
                    parts.append([])
                getter = partial(_local_piece, layout, e, rank, box, start)
                parts[k].append(FileEntry(e.name, box.sizes, e.dtype, getter, box.offsets))
        _write_parts("model", folder, parts, generation, rank, layout.world_size, tensors, renames)
    return tensors


def _local_piece(layout, entry, rank, box, start):
    return local_view(layout.local(entry, rank), entry.placement, box, start)


def _write_optimizer_files(layout: ModelLayout, optimizer, folder: Path, generation: int, renames: list) -> dict:
    per_rank, section = optimizer_files(layout, optimizer)
    (folder / OPTIMIZER_DIR).mkdir(exist_ok=True)
    for rank, parts in per_rank.items():
        _write_parts(
            "optim", folder / OPTIMIZER_DIR, parts, generation, rank, layout.world_size, section["tensors"], renames,
            rel=OPTIMIZER_DIR,
        )
    return section


def _write_parts(kind, directory, parts, generation, rank, world, tensors, renames, rel: str = "") -> None:
    """Part k of a rank holds the k-th piece of each tensor (a safetensors key appears once per file)."""
    for k, entries in enumerate(parts):
        if not entries:
            continue
        name = data_file_name(kind, generation, rank, world, k)
        final = directory / name
        tmp = write_safetensors(final, entries, {"tensorshard": kind, "rank": str(rank), "world_size": str(world)})
        renames.append((tmp, final))
        relname = f"{rel}/{name}" if rel else name
        for e in entries:
            tensors[e.key]["chunks"].append({"file": relname, "offsets": list(e.offsets), "sizes": list(e.shape)})


def _write_config(model: nn.Module, folder: Path) -> None:
    """The model's transformers config (and generation config) as config.json, when it has one."""
    for attr, name in (("config", "config.json"), ("generation_config", "generation_config.json")):
        config = getattr(model, attr, None)
        if callable(getattr(config, "to_json_string", None)):
            with atomic_write(folder / name, "w") as f:
                f.write(config.to_json_string())


def _remove_stale(folder: Path, keep: set[str]) -> None:
    """Delete data files of earlier generations and leftovers of interrupted saves (ours only)."""
    for directory in (folder, folder / OPTIMIZER_DIR):
        if not directory.is_dir():
            continue
        for p in directory.iterdir():
            rel = str(p.relative_to(folder))
            leftover = is_temp_name(p.name) and p.name[1:].startswith(("model-g", "optim-g", INDEX_NAME))
            ours = DATA_FILE.match(p.name) or leftover
            if ours and rel not in keep and p.is_file():
                p.unlink(missing_ok=True)
        fsync_dir(directory)


def _refuse_meta(layout: ModelLayout) -> None:
    meta = [e.name for e in layout if e.persistent and any(layout.local(e, r).is_meta for r in layout.ranks)]
    if meta:
        raise RuntimeError(f"cannot save: {len(meta)} tensor(s) are on the meta device (not loaded), e.g. {meta[0]}")


def load_sharded(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    progress: bool = True,
) -> nn.Module:
    """Load a checkpoint into `model`, whatever device count, plan or engine it was saved with.

    Reads a tensorshard sharded checkpoint, a folder written by torch.distributed.checkpoint (safetensors
    or its own ``.distcp`` format, e.g. Lightning's), or a Hugging Face safetensors folder. Tensors already
    on a device are overwritten in place (an optimizer built before loading keeps working); tensors on the
    meta device are created on their device. Dtypes must match exactly (this is for resuming). Under
    torchrun every process calls it and reads only its own rank's boxes; an error on any rank is raised on
    every rank.

    Everything is checked before the model changes: names, shapes, dtypes, that the stored boxes cover
    every tensor, that every file exists and its header matches (a truncated or damaged file is named),
    the optimizer's class, groups and state.

    Args:
        optimizer: restore its state and hyperparameters too (it must be built over ``model.parameters()``
            with the same param groups as when saving).
        strict: refuse checkpoints with tensors the model lacks, or lacking tensors the model has.
        progress: show a tqdm progress bar (on global rank 0 only, under torchrun).
    """
    folder = Path(path)
    layout = model_layout(model)
    job = job_of(layout)
    opened: dict = {}

    def check() -> None:
        source, index = open_folder(folder)
        opened["source"] = source
        aliases = (index or {}).get("aliases", {})
        _report_plan(layout, index, folder, log=job.coordinator)
        opened["pairs"] = match_tensors(layout, source, aliases=aliases, strict=strict, exact_dtype=True)
        if optimizer is not None:
            section = (index or {}).get("optimizer")
            if not section:
                raise ValueError(f"{folder} holds no optimizer state (it was saved without optimizer=...)")
            files = [f for f in index["files"] if f.startswith(OPTIMIZER_DIR + "/")]
            optimizer_source = SafetensorsSource.from_index(
                folder, section["tensors"], f"optimizer state in {folder}", files
            )
            check_optimizer_section(section, layout, optimizer, optimizer_source, aliases)
            opened["optimizer"] = (optimizer_source, section, aliases)

    def read() -> None:
        fill(layout, opened["pairs"], opened["source"], progress=progress and job.coordinator, desc=f"loading {folder.name}")
        if optimizer is not None:
            load_optimizer(layout, optimizer, *opened["optimizer"])

    try:
        job.agree("checking the checkpoint", check)  # nothing has changed yet on any rank
        job.agree("reading the checkpoint", read)
    finally:
        if "source" in opened:
            opened["source"].close()
    if job.coordinator:
        logger.info(
            "loaded %s into %s at %d device(s)%s", folder, type(model).__name__, layout.world_size,
            " with optimizer state" if optimizer is not None else "",
        )
    return model


def _plan_data(plan) -> dict | None:
    """The plan as JSON data, or None (with a warning) when a custom style cannot be written as JSON."""
    if plan is None:
        return None
    try:
        data = plan.to_dict()
        json.dumps(data)
        return data
    except (TypeError, ValueError) as e:
        logger.warning("the plan cannot be stored as JSON (%s); the checkpoint records no plan", e)
        return None


def _report_plan(layout: ModelLayout, index: dict | None, folder: Path, log: bool = True) -> None:
    if index is None or layout.plan is None or index.get("plan") is None:
        return
    saved = index["plan"]
    if saved != layout.plan.to_dict():
        try:
            Plan.from_dict(saved)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{folder / INDEX_NAME}: the stored plan cannot be read ({e})") from None
        if log:
            logger.info(
                "%s was saved with another plan (at %s device(s)); tensors are matched by their global index "
                "ranges, so it loads into this plan exactly", folder, index.get("world_size"),
            )


__all__ = ["load_sharded", "read_index", "save_sharded"]
