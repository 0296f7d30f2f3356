"""A PeftModel split whole (the adapter added before splitting): still a PeftModel, whose save_pretrained writes
PEFT's own adapter format.

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(...), LoraConfig(...))
    model = tp.tensor_parallel(model, ["cuda:0", "cuda:1"])   # an instance of TensorParallelPeftModelForCausalLM
    ...train...
    model.save_pretrained("adapter/")                         # adapter_config.json + adapter_model.safetensors

The plan is the inner transformers model's, prefixed with ``base_model.model.``, with every LoRA layer's
factors following its base layer's split (adapter_plan.py, lora_styles.py). The result is an instance of the
PeftModel's class too, so ``transformers.Trainer`` saves it through ``save_pretrained``: the adapter's
tensors are gathered (one at a time, only the adapter's: never the frozen base weights) under the unsplit
names and shapes, and written by PEFT's own ``save_pretrained``, so plain PEFT loads them into an unsplit
model (``PeftModel.from_pretrained(model, "adapter/")``). ``generate`` and ``get_base_model()`` are the
inner transformers model's (split, sharing the shards: integrations/transformers/wrapped.py, whose
`WrapperTensorParallel` the transformers integration hands to `tensor_parallel_peft`: this package does not import
it, as transformers' split models take their adapter methods from here). What this shares with the other ways of
holding an adapter on a split model (the saved files, gathering, the refusals, merging on whole factors) is in
adapter_io.py.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from pathlib import Path
from typing import Any

from torch import nn

from ...checkpoint.atomic import write_into_folder
from ...checkpoint.gather import save_pretrained_options
from ...engines.inprocess.param_count import count_parameters, unsplit_parameters
from ...logs import get_logger
from .adapter_io import (
    ADAPTER_FILES,
    RestructuringRefused,
    check_mergeable,
    check_save_folder,
    gathered_adapter,
    refuse_restructuring,
    standing_in_for,
    whole_adapter_tensors,
    with_adapter_names,
)
from .adapter_plan import refuse_prompt_learning

logger = get_logger(__name__)


def tensor_parallel_peft(module: nn.Module, device_ids=None, *, split_class: type, **kwargs) -> "PeftTensorParallel":
    """Split a PeftModel; the result is also an instance of its class (see the module docstring). `split_class`:
    the engine's class for a module holding a transformers model (integrations/transformers' WrapperTensorParallel)."""
    refuse_prompt_learning(module)  # before anything is built (adapter_plan.py)
    return peft_split_class(type(module), split_class)(module, device_ids, **kwargs)


@functools.lru_cache(maxsize=None)
def peft_split_class(peft_class: type, split_class: type) -> type:
    """``TensorParallel<PeftClass>``: PeftTensorParallel, then the engine's `split_class`, then PEFT's own class."""

    def forward(self, *args, **kwargs):
        return split_class.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(peft_class.forward)  # Trainer keeps the columns forward names
    bases = (PeftTensorParallel, split_class, peft_class)
    return type(f"TensorParallel{peft_class.__name__}", bases, {"forward": forward, "__module__": __name__})


class PeftTensorParallel(RestructuringRefused):
    """The engine side of a split PeftModel, first in its class's MRO (`peft_split_class`), before the engine's
    class and PEFT's. The methods that rebuild the module tree (RestructuringRefused) are refused, `add_adapter`
    too."""

    def __init__(self, module: nn.Module, device_ids=None, **kwargs) -> None:
        super().__init__(module, device_ids, **kwargs)
        object.__setattr__(self, "_peft", module)  # consumed (on meta): its configs; not a submodule

    # What PEFT and the Trainer ask of a PeftModel: answered from the (consumed) original's configs.
    @property
    def peft_config(self):
        return self._peft.peft_config

    @property
    def active_adapter(self):
        return self._peft.active_adapter

    @property
    def active_adapters(self):
        return self._peft.active_adapters

    @active_adapter.setter
    def active_adapter(self, name) -> None:  # PeftModel.set_adapter assigns it
        self._peft.active_adapter = name

    def __getattr__(self, name: str) -> Any:
        """A PeftModel hands the names it lacks to its tuner, which hands them to the transformers model inside
        (``gradient_checkpointing_enable``, ``enable_input_require_grads``, ...): here that is the split one,
        ``get_base_model()``. The tuner itself exists only per device."""
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            if name == "base_model":
                raise AttributeError(
                    f"{type(self).__name__} is split over {self.labels}: its LoRA model lives in "
                    "model.module_shards[r].base_model; the split transformers model inside is model.get_base_model()"
                ) from None
            if name.startswith("_") or name in ("inner_model", "module_shards"):  # not yet built: no forwarding
                raise
        return getattr(self.get_base_model(), name)

    # Switching and merging adapters: every device does it on its own slices, through PEFT's own methods on its
    # shard (lora_styles.py: B_d A and B A_d are exactly this device's slice of the merged weight). PEFT merges or
    # unmerges inside several of them (disabling or switching a merged adapter unmerges it first).
    def merge_adapter(self, adapter_names: list[str] | None = None, safe_merge: bool = False) -> None:
        """Adds the adapters (default: the active ones) into the split weights in place, as PEFT's
        ``merge_adapter`` does; ``unmerge_adapter()`` takes them out again."""
        with whole_adapter_tensors(self):
            check_mergeable(self.module_shards, self.splits, self._split_subject())
        self._on_every_shard(lambda shard: shard.base_model.merge_adapter(adapter_names=adapter_names, safe_merge=safe_merge))

    def unmerge_adapter(self) -> None:
        self._on_every_shard(lambda shard: shard.base_model.unmerge_adapter())

    def enable_adapter_layers(self) -> None:
        self._on_every_shard(lambda shard: shard.base_model.enable_adapter_layers())

    def disable_adapter_layers(self) -> None:
        # PEFT's forward unmerges a disabled merged layer when it next runs; here, with whole factors, at once
        self._on_every_shard(lambda shard: (shard.base_model.unmerge_adapter(), shard.base_model.disable_adapter_layers()))

    def set_adapter(self, adapter_name: str, inference_mode: bool = False) -> None:
        """Makes `adapter_name` the active adapter on every device (trainable unless `inference_mode`)."""
        if adapter_name not in self.peft_config:
            raise ValueError(f"set_adapter({adapter_name!r}): this model holds the adapter(s) {sorted(self.peft_config)}")
        self._on_every_shard(lambda shard: shard.set_adapter(adapter_name, inference_mode=inference_mode))
        self._peft.active_adapter = adapter_name

    @contextlib.contextmanager
    def disable_adapter(self):
        """Runs the base model without the adapters inside the block (PEFT's ``disable_adapter``), on every device."""
        stack = contextlib.ExitStack()
        self._on_every_shard(lambda shard: stack.enter_context(shard.disable_adapter()))
        try:
            yield
        finally:
            with whole_adapter_tensors(self):
                stack.close()

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable, all) parameters of the unsplit PeftModel, as PEFT counts them (``print_trainable_parameters``
        prints these): each once, whatever the devices hold (engines/inprocess/param_count.py)."""
        params = unsplit_parameters(self)
        return count_parameters(params, only_trainable=True), count_parameters(params)

    def _on_every_shard(self, action) -> None:
        with whole_adapter_tensors(self):  # PEFT's merge multiplies whole factors, which ZeRO-3 keeps in pieces
            for shard in self.module_shards:
                action(shard)

    def _split_subject(self) -> str:
        return f"a model split over {self.labels}"

    def add_adapter(self, *args: Any, **kwargs: Any):
        refuse_restructuring("add_adapter", self._split_subject())  # a new adapter: into the unsplit model

    def get_base_model(self) -> nn.Module:
        return self.inner_model

    def load_adapter(self, model_id: str | os.PathLike, adapter_name: str = "default", is_trainable: bool = False, **kwargs: Any):
        """PEFT's ``load_adapter`` into adapter `adapter_name`, which this model already holds (Trainer's
        resume_from_checkpoint): PEFT names and converts the saved tensors on the unsplit PeftModel this model was
        split from (kept, empty, on the meta device), and what it loads goes to this model, each device taking its
        slices. A new adapter cannot be added to a model split with its adapters: load it before splitting."""
        if adapter_name not in self.peft_config:
            raise NotImplementedError(
                f"load_adapter({adapter_name!r}): this split model holds the adapter(s) {sorted(self.peft_config)}; a new "
                "one cannot be added after splitting. Load it into the unsplit model before tensor_parallel()"
            )
        with standing_in_for(self, self._peft):  # what PEFT loads into the unsplit one: each device takes its slice
            result = type(self._peft).load_adapter(self._peft, model_id, adapter_name, is_trainable=is_trainable, **kwargs)
        if not is_trainable:
            for name, p in self.named_parameters():
                if f".{adapter_name}." in name or name.endswith(f".{adapter_name}"):
                    p.requires_grad_(False)
        return result

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As the split model's; PEFT's checkpoint names (``set_peft_model_state_dict``) load too."""
        return super().load_state_dict(with_adapter_names(state_dict, self.splits, self.peft_config), strict, assign)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """PEFT's adapter format (adapter_config.json, adapter_model.safetensors) with unsplit names and
        shapes, written by PEFT's own ``save_pretrained`` into a temporary folder moved into place. Accepts
        PEFT's options (``selected_adapters``, ``safe_serialization``, ``is_main_process``, ...)."""
        kwargs, given = save_pretrained_options(kwargs)
        target = Path(save_directory)
        check_save_folder(target)
        state = given if given is not None else gathered_adapter(self)
        peft_save = functools.partial(type(self._peft).save_pretrained, self._peft, state_dict=state, **kwargs)
        write_into_folder(target, peft_save, replaces=ADAPTER_FILES)
        logger.info("saved the adapter of the split %s to %s (%d tensors)", type(self._peft).__name__, target, len(state))
