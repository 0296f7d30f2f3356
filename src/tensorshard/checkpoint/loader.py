"""Filling a model's tensors from a `Source`, rank by rank, checking first that everything fits.

`match_tensors` pairs every tensor of the model with a tensor of the checkpoint (by name, tied weights by
any of their names) and raises one error that lists every name that is missing, unexpected, or of the
wrong shape or dtype, before anything is read. `fill` then asks the source for each rank's boxes:

- a tensor that is already real is overwritten in place (a resumed optimizer keeps its parameters);
- a tensor on the meta device gets new storage on its rank's device, swapped into every module that holds
  it (ties stay tied) once every tensor is read, allocated only when its turn comes.

Everything that can be checked without reading data is checked by `match_tensors` (sources.py checks
file headers and sizes too), so a damaged checkpoint is refused before the model changes. A read that
fails anyway (an I/O error, a file removed meanwhile) raises with a note that says what was loaded.

Host memory beyond the destination tensors: what the source needs for one tensor (see sources.py).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from .layout import ModelLayout, TensorEntry, local_view, rank_pieces
from .sources import Source, describe_names

logger = logging.getLogger(__name__)


def match_tensors(
    layout: ModelLayout,
    source: Source,
    *,
    aliases: dict[str, str] | None = None,
    strict: bool = True,
    exact_dtype: bool = True,
    fix: str = "",
) -> list[tuple[TensorEntry, str]]:
    """(entry, name in the source) for every persistent tensor of the model that the source holds."""
    if hasattr(source, "choose_prefix"):  # DCP folders keep the model under a key prefix
        source.choose_prefix(n for e in layout for n in e.names)
    names = set(source.names())
    aliases = aliases or {}
    pairs, missing, used = [], [], set()
    wrong_shape, wrong_dtype, broken = [], [], []
    padded, saved_dtype = False, None
    for entry in layout:
        found = next((n for n in entry.names if n in names), None)
        if found is None:
            found = next((aliases[n] for n in entry.names if aliases.get(n) in names), None)
        if found is None:
            if entry.persistent:
                missing.append(entry.name)
            continue
        used.add(found)
        layout.refuse_quantized(entry)
        shape, dtype = source.info(found)
        if tuple(shape) != tuple(entry.shape):
            wrong_shape.append(f"{entry.name}: checkpoint {list(shape)}, model {list(entry.shape)}")
            padded |= _looks_padded(entry, shape)
        elif exact_dtype and dtype != entry.dtype:
            wrong_dtype.append(f"{entry.name}: checkpoint {dtype}, model {entry.dtype}")
            saved_dtype = saved_dtype or dtype
        else:
            problems = source.problems(found)
            if problems:
                broken.append(f"{found}: {'; '.join(problems)}")
        pairs.append((entry, found))
    unexpected = sorted(names - used - set(aliases))
    lines = []
    damaged = source.damage() if hasattr(source, "damage") else []
    if damaged:
        lines.append(
            "the checkpoint is damaged: " + "; ".join(damaged[:8])
            + ". Restore the damaged or missing files from a copy, or save the checkpoint again"
        )
    if wrong_shape:
        lines.append(f"{len(wrong_shape)} tensor(s) have another shape: " + "; ".join(wrong_shape[:8]))
        if padded:
            lines.append(
                "tensors larger than the model's only along the dimension the plan splits look like the padded "
                "'stacked' layout in which the torchrun engine keeps uneven or fused splits as DTensors: a "
                "torch.distributed.checkpoint of such a model (Lightning's save_checkpoint) loads back only through "
                "DCP at the rank count and plan it was saved with. Load it there, then tp.save_sharded(model, folder) "
                "writes a checkpoint of the real tensors that loads anywhere (docs/checkpoints.md)"
            )
    if wrong_dtype:
        lines.append(
            f"{len(wrong_dtype)} tensor(s) have another dtype: " + "; ".join(wrong_dtype[:8])
            + f" (convert the model to the checkpoint's dtype first, e.g. model.to({saved_dtype}), to resume exactly; "
            "tp.from_pretrained(..., dtype=...) casts while loading)"
        )
    if broken:
        lines.append(f"{len(broken)} tensor(s) cannot be read: " + "; ".join(broken[:8]))
    if strict and missing:
        lines.append(f"{len(missing)} tensor(s) of the model are not in the checkpoint: {describe_names(missing)}")
    if strict and unexpected:
        lines.append(f"{len(unexpected)} tensor(s) of the checkpoint are not in the model: {describe_names(unexpected)}")
    if lines:
        raise ValueError(
            f"{source.description} does not fit this {type(layout.root).__name__}:\n  " + "\n  ".join(lines)
            + (f"\n{fix}" if fix else "") + "\nNothing was loaded; the model is unchanged."
        )
    if missing:
        logger.warning("not in %s, left as they are: %s", source.description, describe_names(missing))
    if unexpected:
        logger.info("in %s but not in the model, skipped: %s", source.description, describe_names(unexpected))
    return pairs


def _looks_padded(entry: TensorEntry, shape) -> bool:
    """The checkpoint's tensor is larger than the model's only along the split dimension."""
    if entry.placement is None or len(shape) != len(entry.shape):
        return False
    dim = entry.placement[0]
    return all(a == b for d, (a, b) in enumerate(zip(shape, entry.shape)) if d != dim) and shape[dim] > entry.shape[dim]


def fill(
    layout: ModelLayout,
    pairs: Sequence[tuple[TensorEntry, str]],
    source: Source,
    *,
    progress: bool = True,
    desc: str = "loading",
    convert: Callable[[TensorEntry, int, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Copy every paired tensor's boxes into each rank held here (in place, or into new storage for meta
    tensors, installed once everything is read).

    `convert(entry, rank, storage)`: applied to each new storage as soon as its tensor is read, its result
    installed instead (quantizing while loading, quant/loading.py); it returns the storage to keep it."""
    created: list[tuple[TensorEntry, int, torch.Tensor]] = []
    pending: dict[str, list[int]] = {}  # source name -> indices into `created` not converted yet
    done: list[str] = []
    current: list[str] = []

    def requests():
        for entry, name in pairs:
            targets = []
            for rank in layout.ranks:
                local = layout.local(entry, rank)
                if local.is_meta:
                    holder, dest = layout.new_local(entry, rank)
                    pending.setdefault(name, []).append(len(created))
                    created.append((entry, rank, holder))
                else:
                    dest = local.detach()
                pieces = rank_pieces(entry.shape, entry.placement, rank)
                targets += [(box, local_view(dest, entry.placement, box, start)) for box, start in pieces]
            current[:] = [name]
            yield name, targets

    def finished(name: str) -> None:
        done.append(name)
        bar.update(nbytes[name])
        for i in pending.pop(name, ()) if convert is not None else ():
            entry, rank, holder = created[i]
            created[i] = (entry, rank, convert(entry, rank, holder))

    nbytes = {name: entry.nbytes for entry, name in pairs}
    bar = tqdm(total=sum(nbytes.values()), unit="B", unit_scale=True, desc=desc, disable=not progress, leave=False)
    try:
        with torch.no_grad():
            source.read_all(requests(), finished)
    except Exception as e:
        e.add_note(_partial_load_note(layout, pairs, done, current, created, source))
        raise
    finally:
        bar.close()
    for entry, rank, holder in created:
        layout.install(entry, rank, holder)


def _partial_load_note(layout, pairs, done, current, created, source) -> str:
    in_place = {e.name for e, _ in pairs} - {e.name for e, _, _ in created}
    changed = [n for n in done if n in in_place]
    where = f"while reading {current[0]!r} " if current else ""
    if not changed and not (current and current[0] in in_place):
        return (
            f"the load failed {where}from {source.description}; nothing in the model was changed "
            "(tensors on the meta device stay there)."
        )
    return (
        f"the load failed {where}from {source.description} after {len(changed)} of {len(in_place)} tensors "
        f"had been copied into the model ({describe_names(changed) or 'none'}); the tensor being read may be "
        "partly written and the others keep their previous values. Load a complete checkpoint before using "
        "the model."
    )


def still_meta(layout: ModelLayout) -> list[str]:
    """Names of tensors that no load has filled yet."""
    return [e.name for e in layout if any(layout.local(e, r).is_meta for r in layout.ranks)]
