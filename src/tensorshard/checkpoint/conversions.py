"""Checkpoints in the hub's key layout, converted on the fly the way transformers converts them on load.

transformers 5 renamed many modules (ViT's ``encoder.layer.0.attention.attention.query`` is now
``layers.0.attention.q_proj``) and fused others (Mixtral's per-expert ``w1``/``w3``/``w2`` are stacked into
one ``experts.gate_up_proj`` and ``experts.down_proj``), yet its ``save_pretrained`` still writes the old
layout, and hub checkpoints of those families have it too. Its ``from_pretrained`` converts on load, with a
description per model type (``transformers.conversion_mapping.get_model_conversion_mapping``): a list of
`WeightRenaming` (a stored name maps to a model name) and `WeightConverter` (several stored tensors make
one model tensor, or one makes several, through operations such as `MergeModulelist` and `Concatenate`).

`HubConversions` takes that description from transformers for the model being loaded, and `wrap` turns a
checkpoint `Source` into one that speaks the model's names, so the streaming load needs no family-specific
code:

- a renamed tensor is read box by box from its stored name, as before (no extra host memory);
- a converted tensor is built whole on the host by transformers' own operation objects from the whole stored
  tensors it comes from, and each device then copies its boxes out of it. It costs its whole size in host
  memory while it is read, up to twice that at the peak while the operations stack and concatenate the
  parts; one converted tensor at a time. The shapes are found before anything is read, by running the same
  operations on meta tensors, so a checkpoint that does not fit is refused before the model changes.

Stored names are renamed exactly as transformers does (`core_model_loading.rename_source_key`, keys in its
order, the base-model prefix added or removed), so whatever ``transformers.AutoModel*.from_pretrained``
loads, this loads too, except operations that are not plain functions of whole tensors (Ernie's and
Inkling's expert ops, quantizer ops): those are refused before loading, with the fix.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace
from typing import Any, Sequence

import torch
from torch import nn

from ..logs import get_logger
from .layout import Box
from .sources import Source, Target, describe_names

logger = get_logger(__name__)

# transformers' operations that are plain functions of whole tensors (and of the config, or of the model's
# parameter shapes, which `_Shapes` answers): applying them to the whole stored tensors gives the whole
# model tensor. Others (expert ops that dequantize or read the model's modules) are refused.
SUPPORTED_OPERATIONS = frozenset(
    {"MergeModulelist", "Concatenate", "Chunk", "Split", "Transpose", "Interleave", "PermuteForRope"}
)

_FIX = (
    "Load the model with transformers' from_pretrained (it converts the checkpoint in host memory), then split "
    "it with tp.tensor_parallel(model, devices)."
)


def _transformers_loading() -> SimpleNamespace | None:
    """transformers' loading modules, or None when transformers is not imported or has no conversion mappings
    (before 5.0). A transformers model cannot exist without transformers imported, so for any other model
    nothing is imported here."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    try:
        # deferred: transformers is an optional heavy dependency (imported already for any transformers model)
        from transformers import conversion_mapping, core_model_loading
    except ImportError:
        return None
    return SimpleNamespace(PreTrainedModel=transformers.PreTrainedModel, conversion_mapping=conversion_mapping,
                           core_model_loading=core_model_loading)


class _Shapes:
    """What transformers' operations ask of the model (`Split`, `Transpose(check_dims=True)`): a parameter
    by name, for its shape. Answered with meta tensors of the unsplit model's shapes, so the operations see
    the global shapes whatever the split did to the module since."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes

    def get_parameter(self, name: str) -> torch.Tensor:
        return torch.empty(self.shapes[name], device="meta")


class HubConversions:
    """transformers' conversion description for one model, with what its operations need (the config, the
    unsplit shapes). Build it before the model is split: `of(module)`."""

    def __init__(self, transforms: list, config: Any, shapes: dict[str, tuple[int, ...]], prefix: str | None) -> None:
        self.transforms = transforms
        self.config = config
        self.shapes = shapes
        self.prefix = prefix

    @classmethod
    def of(cls, module: nn.Module) -> "HubConversions | None":
        """The conversions transformers applies when loading `module` (a transformers model, may be on the
        meta device), or None for other modules and transformers versions without conversion mappings."""
        hf = _transformers_loading()
        if hf is None or not isinstance(module, hf.PreTrainedModel):
            return None
        transforms = hf.conversion_mapping.get_model_conversion_mapping(module)
        if not transforms:
            return None
        shapes = {name: tuple(t.shape) for name, t in module.state_dict(keep_vars=True).items()}
        return cls(transforms, module.config, shapes, getattr(module, "base_model_prefix", None))

    def wrap(self, source: Source) -> Source:
        """`source` under the model's names; `source` itself when no stored name needs converting. Refuses
        (ValueError, nothing read) a converter whose operation cannot run here or fails on the stored shapes."""
        loading = _transformers_loading().core_model_loading
        WeightConverter, WeightRenaming = loading.WeightConverter, loading.WeightRenaming
        dot_natural_key, rename_source_key = loading.dot_natural_key, loading.rename_source_key
        transforms = copy.deepcopy(self.transforms)  # renaming keeps state (GroupWeightRename's guard)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        present = dict.fromkeys(self.shapes, True)  # what rename_source_key looks names up in

        renamed: dict[str, str] = {}  # model name -> stored name
        groups: dict[str, tuple[Any, list[tuple[str, str, str]]]] = {}  # first target -> (converter, members)
        unmatched: list[str] = []
        for stored in sorted(source.names(), key=dot_natural_key):  # transformers' order: experts 0, 1, ... 10
            key, pattern = rename_source_key(stored, renamings, converters, self.prefix, present)
            if key not in present and stored in present:  # transformers keeps a name the model already has
                key, pattern = rename_source_key(stored, [], [], self.prefix, present)
            if key not in present:
                unmatched.append(stored)
            elif pattern is not None:
                groups.setdefault(key, (by_pattern[pattern], []))[1].append((key, stored, pattern))
            elif key not in renamed:
                renamed[key] = stored
            else:
                unmatched.append(stored)  # a second stored tensor for the same name: transformers keeps the first
        if not groups and all(k == s for k, s in renamed.items()):
            return source
        converted = ConvertedSource(source, renamed, groups, unmatched, self.config, _Shapes(self.shapes))
        logger.info(
            "%s is in the hub's key layout: %d tensor(s) renamed and %d built whole by transformers' conversion "
            "operations, as transformers loads it",
            source.description, sum(k != s for k, s in renamed.items()), len(converted.converted),
        )
        return converted


class ConvertedSource(Source):
    """A `Source` under the model's names, reading from a source in the hub's key layout (see the module's
    docstring). Made by `HubConversions.wrap`."""

    def __init__(self, source: Source, renamed: dict[str, str], groups: dict, unmatched: list[str], config: Any,
                 shapes: _Shapes) -> None:
        self.source = source
        self.description = source.description
        self.renamed = renamed
        self.groups = groups
        self.unmatched = unmatched
        self.config = config
        self.model = shapes
        self.converted: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}  # name -> (group, shape, dtype)
        self._cache: tuple[str, dict[str, torch.Tensor]] | None = None  # one group's outputs not read yet
        for first, (converter, members) in groups.items():
            self._refuse_unsupported(first, converter, members)
            outputs = self._run(first, self._meta)
            for name, tensor in outputs.items():
                if name in self.model.shapes:
                    self.converted[name] = (first, tuple(tensor.shape), tensor.dtype)

    # -- building converted tensors --------------------------------------------------------------------------

    def _refuse_unsupported(self, first: str, converter, members) -> None:
        for op in converter.operations:
            if type(op).__name__ not in SUPPORTED_OPERATIONS:
                raise ValueError(
                    f"{self.description}: transformers builds {first} from {describe_names([s for _, s, _ in members])} "
                    f"with {type(op).__name__}, which tensorshard cannot apply while streaming (it applies "
                    f"{', '.join(sorted(SUPPORTED_OPERATIONS))}). {_FIX} Nothing was loaded."
                )

    def _run(self, first: str, whole) -> dict[str, torch.Tensor]:
        """transformers' converter for group `first`, fed `whole(stored)` for each stored tensor: the model
        tensors it makes, by full name."""
        converter, members = self.groups[first]
        converter = copy.deepcopy(converter)  # converting consumes what was collected
        parts = {stored: whole(stored) for _, stored, _ in members}  # read errors are not conversion errors
        for key, stored, pattern in members:
            converter.add_tensor(key, stored, pattern, lambda stored=stored: parts.pop(stored))  # held once
        try:
            outputs = converter.convert(first, model=self.model, config=self.config)
        except Exception as e:
            ops = ", ".join(type(op).__name__ for op in converter.operations)
            raise ValueError(
                f"{self.description}: transformers' conversion of {describe_names([s for _, s, _ in members])} into "
                f"{first} ({ops}) fails on these tensors ({type(e).__name__}: {e}). Check that the checkpoint "
                f"belongs to this model. {_FIX} Nothing was loaded."
            ) from e
        return {name: t[0] if isinstance(t, list) else t for name, t in outputs.items()}

    def _meta(self, stored: str) -> torch.Tensor:
        shape, dtype = self.source.info(stored)
        return torch.empty(shape, dtype=dtype, device="meta")

    def _whole(self, stored: str) -> torch.Tensor:
        shape, dtype = self.source.info(stored)
        out = torch.empty(shape, dtype=dtype)
        self.source.read(stored, [(Box.whole(shape), out)])
        return out

    def _converted(self, name: str) -> torch.Tensor:
        """The whole model tensor `name`; the other outputs of its converter (a fused tensor split in
        several) wait in the cache until they are read, one converter's outputs at a time."""
        first = self.converted[name][0]
        if self._cache is None or self._cache[0] != first:
            self._cache = None  # release the previous outputs before building new ones
            self._cache = (first, self._run(first, self._whole))
        outputs = self._cache[1]
        full = outputs.pop(name)
        if not any(n in self.converted for n in outputs):
            self._cache = None
        return full

    # -- the Source interface ----------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self.renamed) + list(self.converted) + self.unmatched

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if name in self.converted:
            return self.converted[name][1:]
        return self.source.info(self.renamed.get(name, name))

    def problems(self, name: str) -> list[str]:
        if name in self.converted:
            members = self.groups[self.converted[name][0]][1]
            return [f"{stored}: {p}" for _, stored, _ in members for p in self.source.problems(stored)]
        return self.source.problems(self.renamed.get(name, name))

    def damage(self) -> list[str]:
        return self.source.damage()

    def read(self, name: str, targets: Sequence[Target]) -> None:
        if name not in self.converted:
            self.source.read(self.renamed.get(name, name), targets)
            return
        full = self._converted(name)
        whole = Box.whole(tuple(full.shape))
        for box, out in targets:
            out.copy_(full[box.within(whole)] if box.sizes else full)
        del full

    def close(self) -> None:
        self._cache = None
        self.source.close()
