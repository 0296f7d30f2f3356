"""How a split model's PEFT adapters are saved, loaded and protected: what the three ways of holding an adapter
on a split model share.

    model = get_peft_model(split, LoraConfig(...))    # split, then adapter: PEFT's API (peft/after_split.py)
    split.load_adapter("adapter/")                    # split, then adapter: transformers' (transformers_adapters.py)
    model = tp.tensor_parallel(peft_model, devices)   # adapter, then split (before_split.py)

Saving writes PEFT's format (`ADAPTER_FILES`) with the unsplit names and shapes: the adapter's tensors are
gathered (`gathered_adapter`: only the adapter's, one at a time, never the frozen base weights) and written by
PEFT's own code into a temporary folder whose files then replace the target's (`check_save_folder` first
refuses a target that is a file). Loading lets PEFT name, select and convert the saved tensors on a module with
the unsplit names (`standing_in_for`: the first device's shard, or the unsplit PeftModel kept on meta), while
what it loads goes to the split model, each device taking its slices. Protection: the methods that rebuild
the module tree, which the split's layout describes, are refused before anything changes
(`RestructuringRefused`); merging is refused where a device's slices cannot be merged on their own
(`check_mergeable`), and PEFT's merge sees whole factors where ZeRO-3 keeps them in pieces
(`whole_adapter_tensors`).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterable, NoReturn

import torch
from torch import nn

from ...checkpoint.gather import gathered_state_dict, gathering_save_pretrained
from ...engines.inprocess import TensorParallel
from .recognised import is_peft_model
from ...plans.slices import after_split

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_config.json")  # what a save replaces
PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps the model it adapts (the prefix of PEFT's names)
HUB_OPTIONS = ("revision", "token", "cache_dir", "subfolder", "local_files_only")  # for PEFT's config and weights


# -- saving --------------------------------------------------------------------------------------------------


def is_adapter_tensor(name: str) -> bool:
    """A tensor PEFT saves for an adapter (by its state-dict name): LoRA factors and DoRA magnitudes, IA3
    vectors, modules_to_save copies."""
    return "lora_" in name or ".ia3_l." in name or ".modules_to_save." in name


@after_split
def _install_gathering_save_pretrained(module: nn.Module) -> None:
    """A PeftModel split by `parallelize` saves PEFT's adapter format from the gathered adapter, not DTensor pieces
    (checkpoint/gather.py does the same for a transformers model, with every tensor)."""
    if is_peft_model(module):
        module.save_pretrained = gathering_save_pretrained(module, only=is_adapter_tensor)


def check_save_folder(target: Path) -> None:
    """``save_pretrained`` writes a folder: refuse a target that is a file, before anything is gathered."""
    if target.exists() and not target.is_dir():
        raise ValueError(f"save_pretrained({str(target)!r}): a file of that name exists; give a folder path")


def gathered_adapter(split: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The adapter's tensors of `split`, whole, under its unsplit names (after `prefix`), gathered one at a time
    (collective under torchrun: every rank calls it)."""
    return {prefix + name: tensor.contiguous() for name, tensor in gathered_state_dict(split, only=is_adapter_tensor)}


# -- loading -------------------------------------------------------------------------------------------------


def hub_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The options of a ``load_adapter`` call that say where PEFT finds the adapter's config and weights."""
    return {k: kwargs[k] for k in HUB_OPTIONS if k in kwargs}


@contextlib.contextmanager
def standing_in_for(split: nn.Module, stand_in: nn.Module, **attributes: Any):
    """Inside the block, `stand_in` (a module with the unsplit module names) stands for `split` in PEFT's and
    transformers' adapter code: what is loaded into it (``load_state_dict``, unsplit names, only the adapter's
    tensors: not strict) goes to `split`, which gives each device its slices; `attributes` (the split model's
    adapter configs, ...) are set on it too. Its own attributes are back after the block."""

    def load_state_dict(state_dict, strict: bool = True, assign: bool = False):
        return split.load_state_dict(state_dict, strict=False)

    added = {"load_state_dict": load_state_dict, **attributes}
    saved = {k: stand_in.__dict__[k] for k in added if k in stand_in.__dict__}
    stand_in.__dict__.update(added)
    try:
        yield stand_in
    finally:
        for key in added:
            stand_in.__dict__.pop(key, None)
        stand_in.__dict__.update(saved)


def with_adapter_names(state_dict: dict[str, Any], model_names: Iterable[str], peft_config: dict) -> dict[str, Any]:
    """`state_dict` with PEFT's checkpoint names (the adapter's name left out: ``q_proj.lora_A.weight``) given
    the model's (``q_proj.lora_A.default.weight``). PEFT's ``set_peft_model_state_dict`` puts the name back by
    looking at the model's own state-dict names, which a split model keeps per device (``module_shards.N.``),
    so it finds none and loads nothing; here the unsplit `model_names` say where each tensor goes. Names that
    would fit several of the model's adapters are refused: the state dict does not say which one it is."""
    names = set(model_names)
    unknown = [k for k in state_dict if k not in names]
    if not unknown:
        return state_dict
    tuners = sys.modules["peft"].tuners.tuners_utils.BaseTuner  # PEFT's own mapping, saving and loading alike
    fits: dict[str, dict[str, str]] = {}  # checkpoint name -> {adapter: model name}
    for adapter in peft_config:
        for name in names:
            key = tuners._remove_adapter_name_from_key(name, adapter)
            if key != name:  # PEFT drops its prefix when the model's own names lack it, as a split model's do
                for form in {key, key.removeprefix(PEFT_PREFIX)}:
                    fits.setdefault(form, {})[adapter] = name
    ambiguous = sorted({a for k in unknown for a in fits.get(k, {})})
    if len(ambiguous) > 1:
        raise ValueError(
            f"load_state_dict: the adapter tensors given (e.g. {next(k for k in unknown if k in fits)!r}) name no "
            f"adapter, and this split model holds {ambiguous}: load them with model.load_adapter(folder, "
            "adapter_name=...), which names the adapter"
        )
    return {next(iter(fits[k].values())) if k in fits else k: v for k, v in state_dict.items()}


# -- protecting ----------------------------------------------------------------------------------------------


def refuse_restructuring(method: str, subject: str) -> NoReturn:
    raise NotImplementedError(
        f"{method}() on {subject}: it rebuilds the module tree, which the split's layout describes. Save the adapter "
        "(model.save_pretrained(folder)), load it into the unsplit model (PeftModel.from_pretrained(base, folder)) and "
        "call it there, then split the result; or call merge_adapter(), which merges in place on every device"
    )


class RestructuringRefused:
    """PEFT's methods that rebuild the module tree, refused before anything changes; first in the MRO, before
    PEFT's own class. `_split_subject` says, in messages, what the methods were called on."""

    def _split_subject(self) -> str:
        return "a split model"

    def merge_and_unload(self, *args: Any, **kwargs: Any):
        refuse_restructuring("merge_and_unload", self._split_subject())

    def unload(self, *args: Any, **kwargs: Any):
        refuse_restructuring("unload", self._split_subject())

    def add_weighted_adapter(self, *args: Any, **kwargs: Any):
        refuse_restructuring("add_weighted_adapter", self._split_subject())

    def delete_adapter(self, *args: Any, **kwargs: Any):
        # the layout, ZeRO-3's partitions and the splits still hold its tensors
        refuse_restructuring("delete_adapter", self._split_subject())


def check_mergeable(roots: Iterable[nn.Module], splits: dict, subject: str) -> None:
    """Refuse ``merge_adapter()`` on `subject` when some device's slices cannot be merged on their own
    (`unmergeable`); `roots`: every device's module tree in this process, `splits`: the split model's."""
    problem = next((p for p in (unmergeable(root, splits) for root in roots) if p), None)
    if problem:
        raise NotImplementedError(f"merge_adapter() on {subject}: {problem}. Merge in the unsplit model instead (save "
                                  "the adapter, load it there, merge_and_unload)")


@contextlib.contextmanager
def whole_adapter_tensors(split: nn.Module):
    """Inside the block, every device of an in-process split model holds whole copies of the adapter tensors that
    ZeRO-3 keeps in row pieces (PEFT's merge multiplies whole factors); nothing to do under torchrun."""
    names = [n for n in getattr(split, "zero_splits", None) or {} if is_adapter_tensor(n)]
    if not isinstance(split, TensorParallel) or not names:
        yield
        return
    whole = dict(gathered_state_dict(split, only=names.__contains__))
    held = []
    try:
        for shard in split.module_shards:
            for name, tensor in whole.items():
                owner, attr = name.rsplit(".", 1)
                module = shard.get_submodule(owner)
                piece = module._parameters[attr]
                held.append((module, attr, piece))
                module._parameters[attr] = nn.Parameter(tensor.to(piece.device), requires_grad=False)
        yield
    finally:
        for module, attr, piece in held:
            module._parameters[attr] = piece


def unmergeable(root: nn.Module, splits: dict) -> str | None:
    """Why PEFT's merge would be wrong on this device's slices, or None: a base weight that is quantized (the
    merge would requantize a slice) or held in ZeRO-3 pieces (its local tensor is not the adapter's slice), or
    DoRA beside a row-parallel layer (its row norms span every device). `splits`: the split model's."""
    for name, module in root.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "get_base_layer")):
            continue
        weight = getattr(module.get_base_layer(), "weight", None)
        if weight is None or not weight.is_floating_point():
            return f"{name} wraps a quantized layer (merging would requantize a slice)"
        split = splits.get(f"{name}.base_layer.weight")
        in_dim = 0 if getattr(module, "fan_in_fan_out", False) else 1
        if getattr(module, "lora_magnitude_vector", None) and split is not None and split[0] == in_dim:
            return f"{name} holds DoRA beside a row-parallel layer (its row norms span every device)"
        if hasattr(weight, "to_local"):
            continue  # under torchrun: no ZeRO-3 pieces
        for adapter, A in module.lora_A.items():
            rows, cols = module.lora_B[adapter].weight.shape[0], A.weight.shape[1]
            expected = (cols, rows) if getattr(module, "fan_in_fan_out", False) else (rows, cols)
            if tuple(weight.shape) != expected:
                return f"{name}'s weight is held in ZeRO-3 pieces (sharded_param_names), not as the adapter's slice"
    return None
