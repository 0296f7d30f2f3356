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

from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from ..logs import get_logger
from ..plans import resolve_plan
from ..plans.sharding import shard_plan
from .layout import ModelLayout, TensorEntry, local_view, rank_pieces
from .sources import Source, describe_names

logger = get_logger(__name__)


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
    fitting: list[tuple[TensorEntry, str]] = []  # shapes that agree (checked for the stacked layout below)
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
            fitting.append((entry, found))
        else:
            fitting.append((entry, found))
            problems = source.problems(found)
            if problems:
                broken.append(f"{found}: {'; '.join(problems)}")
        pairs.append((entry, found))
    unexpected = sorted(names - used - set(aliases))
    stacked = _stacked_fused(layout, source, fitting) if hasattr(source, "pieces_along") else []
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
    if stacked:
        lines.append(
            f"{len(stacked)} tensor(s) split by blocks (fused projections such as q|k|v) are stored as one equal "
            "piece per saving rank along the split dimension: " + "; ".join(stacked[:8]) + ". That is the 'stacked' "
            "layout in which the torchrun engine keeps fused splits as DTensors: each piece holds that rank's rows "
            "of every block, so the stored 'global' tensor is the real one with its rows permuted, and reading it "
            "as the real tensor would load wrong weights. A torch.distributed.checkpoint of such a model (dcp.save "
            "of model.state_dict(), Lightning's save_checkpoint) loads back only through DCP (dcp.load) into a "
            "model parallelized with the same plan at the same rank count; from there tp.save_sharded(model, "
            "folder) writes the real tensors, which load at any count (save with tp.save_sharded in the first "
            "place to skip this). A checkpoint of an unsplit model sharded by FSDP2 alone can look the same: "
            "dcp.load it into that model, then tp.save_sharded it (docs/checkpoints.md)"
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


def _stacked_fused(layout: ModelLayout, source: Source, fitting: Sequence[tuple[TensorEntry, str]]) -> list[str]:
    """The tensors a DCP checkpoint may hold in the torchrun engine's stacked layout although their shapes
    are the real ones, described for the error.

    An uneven split pads the stacked tensor, which the shape check catches; a fused split by blocks
    (q|k|v, gate|up) that divides evenly has no padding, so the stored tensor has the real shape with its
    rows permuted (rank 0's q, k, v rows, then rank 1's). DCP's metadata says only where each chunk lies,
    and an FSDP2 checkpoint of the unsplit model (the real rows) can place its chunks the same way, so the
    rows cannot be put back with certainty: such tensors are refused, never guessed. A tensor is named when
    the plan splits it by blocks along a dimension along which the checkpoint stores two or more equal
    pieces that tile it (what the engine writes at that many ranks). Tensors stored whole (one process, or
    `tp.save_sharded`'s real tensors read through DCP) pass.
    """
    suspects: dict[str, tuple[str, int, int]] = {}  # canonical name -> (name in the source, dim, pieces)
    for entry, found in fitting:
        for dim, size in enumerate(entry.shape):
            pieces = source.pieces_along(found, dim)
            if _equal_tiling(pieces, size):
                suspects.setdefault(entry.name, (found, dim, len(pieces)))
    if not suspects:
        return []
    fused = _fused_dims(layout, suspects)
    return [
        f"{found} ({n} pieces along dim {dim}, as {n} ranks hold it)"
        for name, (found, dim, n) in suspects.items()
        if fused.get(name) == dim
    ]


def _equal_tiling(pieces: Sequence[tuple[int, int]], size: int) -> bool:
    """Two or more ranges of one length, end to end, covering [0, size)."""
    if len(pieces) < 2 or pieces[0][0] != 0 or pieces[-1][1] != size:
        return False
    length = pieces[0][1] - pieces[0][0]
    return all(b - a == length for a, b in pieces) and all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))


def _fused_dims(layout: ModelLayout, names) -> dict[str, int]:
    """Canonical name -> the dimension along which the plan splits the tensor by two or more blocks.

    At 2+ ranks a split by blocks gives some rank several separate ranges (its piece of each block). A
    model held whole here (a plain module, or split over one device, where every partition is one range)
    is asked how its plan (given, else the one `tp.parallelize` would infer) splits it at 2 devices; if
    that fails nothing is named (logged), as before this check existed.
    """
    out, unknown = {}, []
    for name in names:
        placement = layout.entries[name].placement
        if placement is not None and any(len(r) > 1 for r in placement[1].ranges):
            out[name] = placement[0]
        elif layout.world_size == 1:
            unknown.append(name)
    if unknown:
        try:
            root = layout.root
            splits = shard_plan(root, resolve_plan(root, layout.plan, 2, check=False), 2).slice_map(root)
        except Exception as e:  # noqa: BLE001 - only a check: a model no plan splits loads as it did
            logger.info("could not tell how a plan would split %s (%s: %s); its DCP chunks are read as stored",
                        describe_names(unknown), type(e).__name__, e)
            return out
        for name in unknown:
            split = next((splits[n] for n in layout.entries[name].names if splits.get(n) is not None), None)
            if split is not None and any(len(r) > 1 for r in split[1].ranges):
                out[name] = split[0]
    return out


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
