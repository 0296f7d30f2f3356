"""Gathered saving: the state dict of the unsplit model, assembled from the shards one tensor at a time.

    with tp.save_tensor_parallel(model):
        torch.save(model.state_dict(), "model.pt")   # unsplit keys and shapes, loadable by a plain model

`gathered_state_dict(model)` yields ``(name, tensor)`` pairs in the original model's order, each tensor
assembled on the CPU just before it is yielded, so a caller that writes and drops each tensor never holds
more than one gathered tensor besides the shards. Keys are the original module's (no ``module_shards.N``).

`save_gathered(model, folder)` writes the same tensors straight to Hugging Face-style safetensors files,
one tensor at a time, atomically.

Under torchrun (a module split by `parallelize`) the same functions are collective: every process calls
them and iterates in step; a split tensor is one all-gather over the tensor-parallel group, assembled from
the engine's partitions, so the result is the real weight (DTensor's ``full_tensor()`` of a parameter in
the padded "stacked" layout would return the padding too). `save_gathered` writes from global rank 0; a
transformers model's own ``save_pretrained`` is routed here by `parallelize` (`gathering_save_pretrained`).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from ..layers import is_transformers_model
from ..logs import get_logger
from ..plans.slices import after_split
from .atomic import atomic_write, fsync_dir, publish, write_into_folder
from .describe import model_layout
from .files import FileEntry, write_safetensors
from .layout import ModelLayout, TensorEntry, is_split_model
from .sources import HF_INDEX_NAME, HF_SINGLE_NAME
from .torchrun import TorchrunJob, is_parallelized, job_of

logger = get_logger(__name__)


def _require_split(model: object, what: str) -> None:
    if not (is_split_model(model) or is_parallelized(model)):
        raise TypeError(
            f"{what} needs a model split by tensorshard (a TensorParallel from tensor_parallel(), or a module split "
            f"by parallelize() under torchrun); got {type(model).__name__}"
        )


def gathered_state_dict(
    model: nn.Module, *, device: torch.device | str = "cpu", only: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the unsplit model's state dict entries, one gathered tensor at a time (on `device`); with
    `only`, just the names it accepts (an adapter's tensors, say).

    Tied weights are gathered once and yielded under each of their names (the same tensor, as a plain
    model's state dict has them). Under torchrun every process must iterate to the end, in step (each
    split tensor is an all-gather); every process receives every tensor.
    """
    _require_split(model, "gathered_state_dict")
    layout = model_layout(model)  # the plan's splits, and ZeRO-3's partitions of the rest
    by_name = layout.by_alias()
    tied: dict[str, torch.Tensor] = {}
    for name in layout.state_names:  # persistent buffers only, as a plain model saves
        if only is not None and not only(name):
            continue
        entry = by_name[name]
        tensor = tied.get(entry.name)
        if tensor is None:
            tensor = layout.gather(entry, device)
            if entry.aliases:
                tied[entry.name] = tensor
        yield name, tensor


@contextmanager
def save_tensor_parallel(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``model.state_dict()`` returns the unsplit model's state dict (as the
    tensor_parallel package's context of the same name does). Under torchrun every process gets it (a
    collective: call ``state_dict()`` on every process). `model` may also be a module whose tensors are all
    a split model's inside it (a PeftModel around a split model): its names then lead to that model's."""
    split, path = _split_inside(model)
    own = model.__dict__.get("state_dict")

    def state_dict(*args, destination=None, prefix: str = "", keep_vars: bool = False):
        if args:  # nn.Module.state_dict's old positional form: (destination, prefix, keep_vars)
            destination, prefix = args[0], (args[1] if len(args) > 1 else prefix)
        out = destination if destination is not None else {}
        for key, value in gathered_state_dict(split):
            out[prefix + path + key] = value
        return out

    # This instance only, for the block: torch.distributed.checkpoint and Lightning see DTensors outside it.
    model.__dict__["state_dict"] = state_dict
    try:
        yield model
    finally:
        if own is None:
            model.__dict__.pop("state_dict", None)
        else:
            model.__dict__["state_dict"] = own


def _split_inside(model: nn.Module) -> tuple[nn.Module, str]:
    """`model` itself when it is split; else the one split model inside it that holds every tensor it has, with
    its path (``base_model.model.``); else the TypeError of `_require_split`."""
    if isinstance(model, nn.Module) and not (is_split_model(model) or is_parallelized(model)):
        inside = [(name, m) for name, m in model.named_modules() if name and (is_split_model(m) or is_parallelized(m))]
        outermost = [(name, m) for name, m in inside if not any(name.startswith(other + ".") for other, _ in inside)]
        if len(outermost) == 1:
            name, split = outermost[0]
            held = {id(t) for t in (*split.parameters(), *split.buffers())}
            if all(id(t) in held for t in (*model.parameters(), *model.buffers())):
                return split, name + "."
    _require_split(model, "save_tensor_parallel")
    return model, ""


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
    Under torchrun every process calls it; global rank 0 writes.

    Safe against interruption: files are written under temporary names; new data files never take the
    name of a file the current index uses; the index (or the single file) is renamed into place last, and
    only then are the previous files removed.
    """
    _require_split(model, "save_gathered")
    folder = Path(path)
    layout = model_layout(model)
    layout.refuse_quantized()
    job = job_of(layout)
    limit = _parse_size(max_shard_size)

    def prepare() -> None:
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file; save_gathered writes a folder")
        if job.coordinator:
            folder.mkdir(parents=True, exist_ok=True)

    job.agree("preparing the folder", prepare)
    entries = [e for e in layout if e.persistent]
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    gathered = _InStep(layout, [e for group in groups for e in group])

    def write() -> None:
        if not job.coordinator:
            gathered.rest()  # take part in every all-gather; rank 0 writes
            return
        try:
            _write_gathered(layout, folder, groups, gathered, progress)
        except Exception:
            if job.distributed:
                gathered.rest()  # the other ranks wait in these all-gathers
            raise

    job.agree("saving the gathered model", write)
    if job.coordinator:
        logger.info("saved the unsplit %s to %s (%d file(s))", type(model).__name__, folder, len(groups))
    return folder


class _InStep:
    """Gathers `order`'s tensors one by one; `rest()` performs the ones not gathered yet (for the ranks
    that do not write, and for rank 0 after a failed write, so that every rank makes the same calls)."""

    def __init__(self, layout: ModelLayout, order: list[TensorEntry]) -> None:
        self.layout, self.order, self.count, self.broken = layout, order, 0, False

    def __call__(self, entry: TensorEntry) -> torch.Tensor:
        try:
            tensor = self.layout.gather(entry)
        except Exception:
            self.broken = True  # a failed collective: the group is gone, do not try the others
            raise
        self.count += 1
        return tensor

    def rest(self) -> None:
        if self.broken:
            return
        for entry in self.order[self.count:]:
            self(entry)


def _write_gathered(layout, folder: Path, groups: list[list[TensorEntry]], gather: Callable, progress: bool) -> None:
    old = _hf_files(folder)
    names = _fresh_names(len(groups), old)
    entries = [e for group in groups for e in group]
    total = sum(e.nbytes for e in entries)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"saving {folder.name}", disable=not progress, leave=False)
    renames = []
    try:
        for file_name, group in zip(names, groups):
            items = [FileEntry(e.name, e.shape, e.dtype, _counted(bar, e, partial(gather, e))) for e in group]
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
        with atomic_write(folder / HF_INDEX_NAME, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    for stale in old - set(names) - ({HF_INDEX_NAME} if len(groups) > 1 else set()):
        (folder / stale).unlink(missing_ok=True)
    fsync_dir(folder)


# --- save_pretrained of a transformers model split by parallelize -----------------------------------------

WEIGHT_FILES = (  # what save_pretrained writes (an earlier save's extra shards are removed)
    "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json")


def save_pretrained_options(kwargs: dict) -> tuple[dict, dict | None]:
    """The save_pretrained options to pass on, and a state dict given by the caller in unsplit form (else None).

    Both engines' save_pretrained accept every option of transformers' own. ``state_dict=None`` (what
    ``Trainer`` passes) and the split model's own ``state_dict()`` (per-shard keys, or DTensors) mean "the
    model's weights": they are gathered. A state dict with the unsplit names and whole tensors is written as
    given."""
    if kwargs.get("push_to_hub"):
        raise NotImplementedError("push_to_hub from a split model: save_pretrained locally, then upload the folder")
    options = dict(kwargs)
    given = options.pop("state_dict", None)
    if given is not None and any(k.startswith("module_shards.") or _is_dtensor(v) for k, v in given.items()):
        given = None  # the split model's own state: gather it
    return options, given


def _is_dtensor(value) -> bool:
    return type(value).__name__ == "DTensor"


def gathering_save_pretrained(model: nn.Module, *, only: Callable[[str], bool] | None = None) -> Callable:
    """``model.save_pretrained`` for a transformers model (or, with `only` picking the adapter's tensors, a
    PeftModel) split by `parallelize` (installed by it).

    Every process calls it. The unsplit weights are gathered one tensor at a time (without the padding of
    the stacked layout) and kept on global rank 0 only, which writes them with the class's own
    ``save_pretrained`` (config, generation config, tied weights, the same files as an unsplit save) into
    a temporary folder whose files then replace those of `save_directory`. Peak host memory on rank 0: one
    full copy of the model; the other ranks: one tensor. `tp.save_gathered` writes the weights with one
    tensor at a time on rank 0 too.
    """
    original = model.save_pretrained  # the class's method, bound

    def save_pretrained(save_directory: str | os.PathLike, **kwargs) -> None:
        kwargs, given = save_pretrained_options(kwargs)
        target = Path(save_directory)
        job = TorchrunJob()

        def check() -> None:
            if target.exists() and not target.is_dir():
                raise ValueError(f"save_pretrained({str(target)!r}): a file of that name exists; give a folder path")

        job.agree("checking the folder", check)
        state = given if given is not None else {}
        for name, tensor in gathered_state_dict(model, only=only) if given is None else ():
            if job.coordinator:
                state[name] = tensor

        def write() -> None:
            if not job.coordinator:
                return
            write_into_folder(target, partial(original, state_dict=state, **kwargs), replaces=WEIGHT_FILES)

        job.agree("writing the model", write)
        if job.coordinator:
            logger.info("saved the unsplit %s to %s", type(model).__name__, target)

    save_pretrained.__doc__ = gathering_save_pretrained.__doc__
    return save_pretrained


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


@after_split
def _install_gathering_save_pretrained(module: nn.Module) -> None:
    """A transformers model split by `parallelize` saves the unsplit weights, not DTensor pieces (a PeftModel, the
    adapter's only: integrations/peft/adapter_io.py)."""
    if is_transformers_model(module):
        module.save_pretrained = gathering_save_pretrained(module)
