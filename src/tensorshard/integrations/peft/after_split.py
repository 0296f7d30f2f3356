"""PEFT's own API around a model that was split first: the order people write when they load a model the
tensor-parallel way and then fine-tune it.

    split = tp.tensor_parallel(AutoModelForCausalLM.from_pretrained(...), devices)   # or tp.parallelize(..., mesh)
    model = get_peft_model(split, LoraConfig(...))             # a PeftModel, as PEFT builds it
    model.save_pretrained("adapter/")                          # PEFT's format: unsplit names and shapes
    model = PeftModel.from_pretrained(split, "adapter/")       # an adapter made on an unsplit model: each
                                                               # device takes its slices
    Trainer(model=model, args=TrainingArguments(save_steps=...), ...).train(resume_from_checkpoint=True)

PEFT builds its PeftModel around the split model and wraps every device's layers (in one process: each
shard's, named ``module_shards.N...``; under torchrun: this rank's, with the unsplit names). Nothing in
PEFT calls back into tensorshard, so a module-registration hook (torch's global
``register_module_module_registration_hook``, `PEFT_HOOK`: installed while a split model lives, global_hooks.py;
it looks at nothing but PEFT objects taking a split model) steps in at two moments:

1. A PEFT tuner (LoraModel, IA3Model, ...) takes a split model as its ``model``, before PEFT wraps any layer:
   a method that cannot follow a split (LoHa, VeRA, ... anything but LoRA, DoRA and IA3) is refused here,
   before anything changes.
2. A PeftModel takes that tuner as its ``base_model``, once every layer is wrapped: the split model adopts
   the adapters (late_adapters.py: the styles, splits and values they would have had if added before
   splitting; what cannot follow is refused and taken out again), and the PeftModel's class becomes
   `AroundSplit` over PEFT's own, so that its methods that read or write the adapter by name work on the split
   model. A prompt-learning method (prompt tuning, prefix tuning, P-tuning) takes the split model itself as
   ``base_model``: refused, as its encoder reads the whole vocabulary's embedding, which the split model does
   not hold in one piece.

`AroundSplit` runs PEFT's own ``save_pretrained`` and ``load_adapter`` (so PEFT names, selects and converts
the tensors as it would for an unsplit model), with two differences: the adapter's tensors are gathered
(only the adapter's, one at a time: never the frozen base weights), and, in one process, PEFT looks at the
first device's shard, whose module names are the unsplit model's, while tensors loaded into it go to the
split model, which gives each device its slices. Under torchrun, PEFT's own resharding of what it loads (a
contiguous chunk per rank) is preceded by the engine's (`_engine_slices_first`: fused blocks such as GPT-2's
q|k|v, uneven and padded splits), for every PeftModel holding a model tensorshard split in place, in either
order (`RESHARD_PATCH`, installed while such a model lives: the first time a PEFT tuner takes a model split
under torchrun, or when a PeftModel is parallelized; a PEFT whose function is gone or takes other arguments is
refused there). ``transformers.Trainer`` checkpoints, ``save_model`` and
``resume_from_checkpoint`` go through these two methods. ``get_nb_trainable_parameters`` (and so
``print_trainable_parameters``) counts the unsplit model's parameters, each once. Methods that rebuild the module tree
(``merge_and_unload``, ``unload``, ``add_weighted_adapter``, ``delete_adapter``) are refused as for a PeftModel split
whole. What this shares with the other ways of holding an adapter on a split model (the saved files, gathering,
the refusals, merging on whole factors) is in adapter_io.py.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_module_registration_hook

from ...checkpoint.atomic import write_into_folder
from ...checkpoint.gather import save_pretrained_options
from ...checkpoint.torchrun import Job, TorchrunJob, is_parallelized
from ...comm.dtensor import mesh_device
from ...engines.inprocess import TensorParallel
from ...engines.inprocess.param_count import UnsplitParameter, count_parameters, unsplit_parameters
from ...global_hooks import GlobalHook, Patch
from ...logs import get_logger
from .adapter_plan import has_adapters
from .adapter_io import (
    ADAPTER_FILES,
    PEFT_PREFIX,
    RestructuringRefused,
    check_mergeable,
    check_save_folder,
    gathered_adapter,
    hub_options,
    whole_adapter_tensors,
    with_adapter_names,
)
from .late_in_process import adopt_in_process
from .late_torchrun import adopt_under_torchrun, building_views
from .recognised import is_peft_model

logger = get_logger(__name__)

# the PEFT methods whose layers follow a split (lora_styles.py, ia3_styles.py)
SUPPORTED_TUNERS = ("LoraModel", "IA3Model")

def _on_registration(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    if submodule is None or name not in ("model", "base_model"):
        return None
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    if name == "model" and _is_tuner(module, peft) and _is_split(submodule):
        _before_injection(module, submodule)
    elif name == "base_model" and is_peft_model(module):
        if _is_split(submodule):
            raise NotImplementedError(
                f"{type(module).__name__} with a prompt-learning method (prompt tuning, prefix tuning, P-tuning) "
                "around a split model: its prompt encoder reads the whole vocabulary's embeddings, which the split "
                "model holds in slices. Use LoRA, DoRA or IA3 on a split model, or train the prompt on an unsplit one"
            )
        if _is_tuner(submodule, peft) and _is_split(getattr(submodule, "model", None)):
            _adopt(submodule.model)
            module.__class__ = around_split_class(type(module))
    return None


def _is_tuner(module: nn.Module, peft) -> bool:
    return isinstance(module, peft.tuners.tuners_utils.BaseTuner)


def _is_split(module: object) -> bool:
    """A split model itself (a PEFT tuner forwards unknown attributes, `tensorshard` included, to its model)."""
    if isinstance(module, TensorParallel):
        return True
    return isinstance(module, nn.Module) and "tensorshard" in vars(module) and is_parallelized(module)


def _before_injection(tuner: nn.Module, split: nn.Module) -> None:
    """A PEFT tuner is about to wrap the layers of `split`: refuse a method that cannot follow the split; under
    torchrun, let PEFT build on this rank's plain slices (engines/torchrun/local_views.py)."""
    kind = type(tuner).__name__
    if kind not in SUPPORTED_TUNERS:
        raise NotImplementedError(
            f"{kind.removesuffix('Model')} adapters cannot follow the split of a model split by tensorshard (in "
            "either order): only LoRA (also rsLoRA, DoRA and modules_to_save) and IA3 layers do. Use one of those, "
            "or train this adapter on the unsplit model"
        )
    _check_initialisations(tuner)
    if not isinstance(split, TensorParallel):
        RESHARD_PATCH.hold(split)  # PEFT's loads into it take the engine's slices first (refused if it cannot)
        building_views(split, split.tensorshard)  # PEFT builds its layers on this rank's plain slices


# LoRA initialisations that do not read the base weight; the others (PiSSA, OLoRA, LoftQ, CorDA, EVA, ...) would
# compute each device's factors from its slice of the weight and rewrite that slice with them, and no single
# adapter then matches the devices' weights.
PLAIN_INITIALISATIONS = (True, False, "gaussian")


def _check_initialisations(tuner: nn.Module) -> None:
    """Before PEFT injects an adapter into the split model (this one, or one added later with add_adapter),
    refuse a LoRA initialisation that reads the base weight: it would change the weights on every device first."""
    inject = tuner.inject_adapter  # the tuner's __init__ calls it right after setting its model (this hook)

    def checked(model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        config = tuner.peft_config.get(adapter_name)
        init = getattr(config, "init_lora_weights", True)
        if init not in PLAIN_INITIALISATIONS:
            raise NotImplementedError(
                f"init_lora_weights={init!r} on a split model: it computes the adapter from the base weight, which "
                "each device holds a slice of (and rewrites it). Add the adapter to the unsplit model first and split "
                "the PeftModel, or use init_lora_weights=True, False or 'gaussian' here"
            )
        return inject(model, adapter_name, *args, **kwargs)

    object.__setattr__(tuner, "inject_adapter", checked)


def _adopt(split: nn.Module) -> None:
    """The split model adopts the adapters PEFT just added; a refusal leaves it as it was."""
    try:
        adopt(split)
    except NotImplementedError:
        split.__dict__.pop("peft_config", None)  # set on it by PEFT's tuner
        raise


def adopt(split: nn.Module) -> None:
    """The split model (of either engine) adopts what PEFT added to it since the last look, or refuses it."""
    if isinstance(split, TensorParallel):
        adopt_in_process(split)
    else:
        adopt_under_torchrun(split)


@functools.lru_cache(maxsize=None)
def around_split_class(peft_class: type) -> type:
    """``<PeftClass>AroundSplit``: `AroundSplit` first in the MRO, then PEFT's own class."""
    return type(f"{peft_class.__name__}AroundSplit", (AroundSplit, peft_class), {"__module__": __name__})


class AroundSplit(RestructuringRefused):
    """What a PeftModel around a split model does differently (see the module docstring)."""

    def _split_subject(self) -> str:
        return "a PeftModel around a split model"

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable, all) parameters as PEFT counts them on the unsplit model (``print_trainable_parameters``
        prints these). PEFT sums over this PeftModel's parameters, which in one process are every device's
        tensors: a replicated one would count once per device. Here each counts once
        (engines/inprocess/param_count.py); under torchrun a DTensor's numel is already the whole tensor's."""
        split = self._split_model()
        if not isinstance(split, TensorParallel):
            return super().get_nb_trainable_parameters()
        inside = {id(p) for p in split.parameters()}
        outside = [UnsplitParameter(n, p, p.numel()) for n, p in self.named_parameters() if id(p) not in inside]
        params = unsplit_parameters(split) + outside
        return count_parameters(params, only_trainable=True), count_parameters(params)

    def _split_model(self) -> nn.Module:
        return self.base_model._modules["model"] if "_viewing" not in self.__dict__ else self.__dict__["_viewing"]

    @contextlib.contextmanager
    def _unsplit_view(self):
        """PEFT looks at the first device's shard instead of the split model: the unsplit model's module names
        (in one process; under torchrun the model keeps them already)."""
        split = self._split_model()
        if not isinstance(split, TensorParallel) or "_viewing" in self.__dict__:
            yield
            return
        tuner = self.base_model
        self.__dict__["_viewing"] = split
        tuner._modules["model"] = split.module_shards[0]
        try:
            yield
        finally:
            tuner._modules["model"] = split
            del self.__dict__["_viewing"]

    @contextlib.contextmanager
    def _whole_model(self):
        """The split model back in its place, inside an `_unsplit_view`."""
        split = self.__dict__.get("_viewing")
        if split is None:
            yield
            return
        view = self.base_model._modules["model"]
        self.base_model._modules["model"] = split
        try:
            yield
        finally:
            self.base_model._modules["model"] = view

    # -- saving ------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """PEFT's adapter format (adapter_config.json, adapter_model.safetensors) with unsplit names and shapes,
        written by PEFT's own ``save_pretrained`` into a temporary folder moved into place; PEFT's options
        (``selected_adapters``, ``safe_serialization``, ``is_main_process``, ...) pass through. Under torchrun
        every process calls it; the first process writes."""
        kwargs, given = save_pretrained_options(kwargs)
        if given is not None and any("module_shards." in k for k in given):
            given = None  # the split model's own state dict: gather it
        target = Path(save_directory)
        split = self._split_model()
        peft_save = functools.partial(super().save_pretrained, **kwargs)
        adopt(split)
        job = Job() if isinstance(split, TensorParallel) else TorchrunJob()
        job.agree("checking the folder", lambda: check_save_folder(target))
        state = given if given is not None else gathered_adapter(split, PEFT_PREFIX)  # collective: every rank gathers

        def write() -> None:
            if job.coordinator:
                with self._unsplit_view():
                    write_into_folder(target, functools.partial(peft_save, state_dict=state), replaces=ADAPTER_FILES)
                logger.info("saved the adapter of %s to %s (%d tensors)", type(self).__name__, target, len(state))

        job.agree("writing the adapter", write)

    # -- loading -----------------------------------------------------------------------------------------

    def load_adapter(self, model_id: str | os.PathLike, adapter_name: str, is_trainable: bool = False, **kwargs: Any):
        """PEFT's ``load_adapter``: a PEFT adapter (made on an unsplit model, or saved from a split one) into
        adapter `adapter_name`, a new one or one this model holds (Trainer's resume); each device takes its
        slices of the saved tensors."""
        if kwargs.get("low_cpu_mem_usage"):
            raise NotImplementedError("load_adapter(low_cpu_mem_usage=True) into a split model: leave it False (the "
                                      "adapter is created on every device, then each takes its slice of the saved one)")
        split = self._split_model()
        if adapter_name not in self.peft_config:  # PEFT's own steps for a new adapter; add_adapter adopts it
            peft = sys.modules["peft"]
            config = peft.PeftConfig.from_pretrained(model_id, **hub_options(kwargs))
            self._check_new_adapter_config(config, is_trainable=is_trainable)
            config.inference_mode = not is_trainable
            self.add_adapter(adapter_name, config, autocast_adapter_dtype=kwargs.get("autocast_adapter_dtype", True))
            if is_trainable:
                self.set_requires_grad(adapter_name)
        with self._unsplit_view():
            result = super().load_adapter(model_id, adapter_name, is_trainable=is_trainable, **kwargs)
        # What PEFT just did to the first shard only (in the view), for every device:
        if hasattr(self.base_model, "_cast_adapter_dtype"):
            self.base_model._cast_adapter_dtype(adapter_name=adapter_name,
                                                autocast_adapter_dtype=kwargs.get("autocast_adapter_dtype", True))
        if not is_trainable:
            self.eval()
        logger.info("loaded adapter %r from %s into the split %s", adapter_name, model_id, type(split).__name__)
        return result

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As for any module; inside PEFT's load (where PEFT looks at the first shard), into the split model:
        unsplit names are sliced for every device (the split model's load pre-hook)."""
        with self._whole_model():
            split = self._split_model()
            if not isinstance(split, TensorParallel):
                adopt_under_torchrun(split)
                state_dict = _local_for_torchrun(split, state_dict)
            else:  # PEFT's checkpoint names (set_peft_model_state_dict): the unsplit names say where they go
                adopt_in_process(split)
                state_dict = with_adapter_names(state_dict, [PEFT_PREFIX + n for n in split.splits], self.peft_config)
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def add_adapter(self, adapter_name: str, peft_config, *args: Any, **kwargs: Any) -> None:
        """PEFT's ``add_adapter``, into every device's layers; the split model then adopts it (or refuses it,
        leaving the model as it was)."""
        with self._whole_model():
            split = self._split_model()
            if not isinstance(split, TensorParallel):
                building_views(split, split.tensorshard)  # PEFT builds its layers on this rank's plain slices
            super().add_adapter(adapter_name, peft_config, *args, **kwargs)
            try:
                adopt(split)
            except NotImplementedError:
                self.peft_config.pop(adapter_name, None)
                raise

    def set_requires_grad(self, *args: Any, **kwargs: Any) -> None:
        with self._whole_model():
            super().set_requires_grad(*args, **kwargs)

    # -- merging (the methods that rebuild the module tree: refused, RestructuringRefused) ---------------------

    def merge_adapter(self, *args: Any, **kwargs: Any) -> None:
        """PEFT's ``merge_adapter`` on every device's slices (B_d A beside a column-parallel layer, B A_d beside a
        row-parallel one: exactly each device's slice of the merged weight)."""
        split = self._split_model()
        in_process = isinstance(split, TensorParallel)
        with whole_adapter_tensors(split):
            roots = list(split.module_shards) if in_process else [split]
            check_mergeable(roots, split.splits if in_process else split.tensorshard.splits, self._split_subject())
            self.base_model.merge_adapter(*args, **kwargs)  # the tuner's (PeftModel forwards it)

    def unmerge_adapter(self, *args: Any, **kwargs: Any) -> None:
        with whole_adapter_tensors(self._split_model()):
            self.base_model.unmerge_adapter(*args, **kwargs)


def _local_for_torchrun(root: nn.Module, state_dict):
    """Whole tensors headed for the parameters of a parallelized model: this rank's slices, as the DTensors
    the parameters are (a tensor already a DTensor passes as it is: `_engine_slices_first` made those PEFT
    loads)."""
    state = root.tensorshard
    out = dict(state_dict)
    for key, value in state_dict.items():
        local = _local_slice(state, key.removeprefix(PEFT_PREFIX), value)
        if local is not None:
            out[key] = local
    return out


def _local_slice(state, name: str, value):
    """This rank's slice of `value`, the whole tensor `name` of a parallelized model (`state`: its TorchrunState),
    as the DTensor the parameter is; None where tensorshard does not hold `name`, `value` is a DTensor already, or
    it is not the whole tensor (left for the load to report its shape)."""
    layout = state.layouts.get(name)
    if layout is None or isinstance(value, DTensor):
        return None
    split = state.splits.get(name)
    if split is not None and (value.dim() <= split[0] or value.shape[split[0]] != split[1].size):
        return None
    local = value if split is None else split[1].take(value, split[0], state.comm.rank)
    return layout.to_dtensor(local.to(mesh_device(state.mesh)).contiguous(), state.mesh)


def _local_for_parallelized(model: nn.Module, state_dict: dict) -> dict:
    """`state_dict` (by `model`'s names) with every whole tensor headed for a module that tensorshard split in
    place (`model` itself, or one inside it) replaced by this rank's slice, as the DTensor the parameter is."""
    roots = [(f"{prefix}." if prefix else "", m.tensorshard) for prefix, m in model.named_modules()
             if "tensorshard" in vars(m) and is_parallelized(m)]
    if not roots:
        return state_dict
    roots.sort(key=lambda root: len(root[0]), reverse=True)  # the innermost split module holding a name wins
    out = dict(state_dict)
    for key, value in state_dict.items():
        for prefix, state in roots:
            local = _local_slice(state, key[len(prefix):], value) if key.startswith(prefix) else None
            if local is not None:
                out[key] = local
                break
    return out


def _engine_slices_first(reshard, then_peft: bool = True):
    """PEFT's `_reshard_dtensor_values_for_load`, after this rank has taken its slices of the tensors headed for a
    model split by tensorshard.

    PEFT (>= 0.21, with transformers' DTensor tensor parallelism) turns each whole tensor it loads into a
    DTensor with the parameter's placement: a `Shard(0)` parameter gets a contiguous chunk of the saved rows.
    tensorshard's parameters are `Shard` DTensors of its own layout (comm/dtensor.py): fused blocks (GPT-2's
    q|k|v in one c_attn: rank 0 holds rows 0-31, 64-95 and 128-159 of 192) are stored as the rank-order
    concatenation of the slices, the same global shape as the saved tensor, so PEFT's chunk loaded the wrong
    rows without a word. Here the engine's partition slices them first (blocks, uneven and padded splits as
    `parallelize` did), and PEFT passes DTensors through; every other tensor is left to PEFT (`then_peft`: where
    transformers has the DTensor support PEFT's function imports; otherwise there is nothing else to reshard)."""

    @functools.wraps(reshard)
    def resharded(model: nn.Module, state_dict: dict) -> dict:
        local = _local_for_parallelized(model, state_dict)
        return reshard(model, local) if then_peft else local

    resharded.tensorshard_slices_first = True
    return resharded


# PEFT's function that reshards what it loads into DTensor parameters (peft >= 0.21), as `_engine_slices_first`
# expects it: (model, state_dict) -> state_dict.
RESHARD = ("peft.utils.save_and_load", "_reshard_dtensor_values_for_load", ("model", "state_dict"))
# PEFT calls it only where transformers has DTensor tensor parallelism of its own (PEFT's flag below: it found
# `transformers.distributed.tensor_parallel`, which transformers 5.0 lacks). Without it, PEFT would copy whole
# tensors into tensorshard's DTensor parameters (torch: "got mixed torch.Tensor and DTensor"), so the flag is
# raised while the patch lives, and the resharding is the engine's alone (PEFT's function would import the
# missing module).
_PEFT_RESHARDS = "is_transformers_dtensor_tp"


def _install_reshard_patch() -> list[Patch]:
    """`_engine_slices_first` around PEFT's resharding of loaded tensors (every peft this package supports, >= 0.21.2,
    has it). A PEFT where it is gone or takes other arguments is refused: it may reshard some other way, and its loads
    would take the wrong rows of fused or uneven splits without a word."""
    where, name, params = RESHARD
    reshard = getattr(sys.modules.get(where), name, None)
    found = None if reshard is None else tuple(inspect.signature(reshard).parameters)
    if found != params:
        version = getattr(sys.modules.get("peft"), "__version__", "?")
        has = "has no such function" if reshard is None else f"takes {found}"
        raise NotImplementedError(
            f"peft {version}'s {where}.{name} {has}, not {params}: tensorshard cannot give PEFT's loads into a model "
            "split under torchrun the engine's slices. Add or load the adapter on the unsplit model before "
            "tp.parallelize, or use a peft release whose function takes (model, state_dict)"
        )
    logger.debug("PEFT's loads into models split by tensorshard take the engine's slices first")
    peft_reshards = getattr(sys.modules[where], _PEFT_RESHARDS, True) is not False
    patches = [Patch(sys.modules[where], name, _engine_slices_first(reshard, then_peft=peft_reshards))]
    if not peft_reshards:
        patches.append(Patch(sys.modules[where], _PEFT_RESHARDS, True))
    return patches


def _holds_peft_layers(model: object) -> bool:
    """A model split under torchrun that holds PEFT's layers (a PeftModel, or its inner model, parallelized)."""
    return ("peft" in sys.modules and isinstance(model, nn.Module) and not isinstance(model, TensorParallel)
            and has_adapters(model))


RESHARD_PATCH = GlobalHook(f"peft's {RESHARD[0]}.{RESHARD[1]} wrapped (integrations/peft/after_split.py)",
                           _install_reshard_patch, needed_by=_holds_peft_layers)
PEFT_HOOK = GlobalHook("torch.nn module-registration hook for PEFT around split models (integrations/peft/after_split.py)",
                       lambda: [register_module_module_registration_hook(_on_registration)],
                       needed_by=lambda model: True)
