"""transformers' own adapter methods on a split model: ``add_adapter``, ``load_adapter`` and the adapter
format of ``save_pretrained``.

    split = tp.tensor_parallel(AutoModelForCausalLM.from_pretrained(...), devices)
    split.load_adapter("adapter/", adapter_name="default")    # a PEFT adapter made on an unsplit model
    split.save_pretrained("out/")                             # the adapter, in PEFT's format (transformers'
                                                              # behaviour for a model holding adapters)

transformers injects PEFT's layers into the model it is called on (here: into every device's shard), then
names, selects and loads the adapter's tensors by the model's module names. The split model adopts what was
injected as soon as transformers returns (late_adapters.py; refused and taken out again
if it cannot follow the split), and PEFT's own loading and saving functions look at the first device's
shard, whose module names are the unsplit model's: loaded tensors go to the split model, which gives each
device its slices, and saved ones are gathered from every device (only the adapter's). What this shares with
PEFT's own API on a split model (the saved files, gathering, the stand-in) is in adapter_io.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

try:  # optional (tensorshard[peft]); this module is loaded with transformers, which PEFT builds on
    import peft
except ImportError:  # pragma: no cover - without PEFT these methods say how to install it
    peft = None

from ...checkpoint.atomic import write_into_folder
from ...checkpoint.gather import save_pretrained_options
from ...logs import get_logger
from .adapter_io import (
    ADAPTER_FILES,
    PEFT_PREFIX,
    check_save_folder,
    gathered_adapter,
    hub_options,
    refuse_restructuring,
    standing_in_for,
)
from .late_in_process import adopt_in_process

logger = get_logger(__name__)


class SplitAdapters:
    """transformers' adapter methods (PeftAdapterMixin) on a split transformers model (see the module docstring).
    They do what transformers' do, through PEFT's functions (transformers' own require peft >= 0.22)."""

    def add_adapter(self, adapter_config, adapter_name: str | None = None) -> None:
        """transformers' ``add_adapter``: PEFT's layers in every device's shard, then adopted (or refused, leaving
        the model as it was); the new adapter becomes the active one."""
        _require_peft()
        name = adapter_name or "default"
        if not isinstance(adapter_config, peft.PeftConfig):
            raise TypeError(f"adapter_config should be an instance of PeftConfig. Got {type(adapter_config)} instead.")
        if getattr(self, "_hf_peft_config_loaded", False) and name in self.peft_config:
            raise ValueError(f"Adapter with name {name} already exists. Please use a different name.")
        had = dict(getattr(self, "peft_config", {}) or {})
        adapter_config.base_model_name_or_path = self.__dict__.get("name_or_path", None)
        peft.inject_adapter_in_model(adapter_config, self, name)  # PEFT keeps the configs in self.peft_config
        try:
            adopt_in_process(self)
        except NotImplementedError:
            if had:
                self.peft_config = had
            else:
                self.__dict__.pop("peft_config", None)
            raise
        self._hf_peft_config_loaded = True
        for module in self.modules():
            if hasattr(module, "active_adapters") and hasattr(module, "base_layer") and hasattr(module, "set_adapter"):
                module.set_adapter(name)

    def delete_adapter(self, *args: Any, **kwargs: Any) -> None:
        """transformers' ``delete_adapter``: refused (the split's layout, ZeRO-3 and splits hold the adapter's tensors)."""
        refuse_restructuring("delete_adapter", "a split model")

    def load_adapter(self, peft_model_id: str | os.PathLike | None = None, adapter_name: str | None = None, *,
                     is_trainable: bool = False, adapter_state_dict: dict | None = None, peft_config=None, **kwargs: Any):
        """transformers' ``load_adapter``: a PEFT adapter (a folder in PEFT's format, or `adapter_state_dict` with
        `peft_config`) into the split model, each device taking its slices. Hub options pass to PEFT's config
        and weight loaders; ``hotswap`` and ``device_map`` are not supported on a split model."""
        for unsupported in ("hotswap", "device_map", "max_memory", "offload_folder", "offload_index"):
            if kwargs.get(unsupported):
                raise NotImplementedError(f"load_adapter({unsupported}=...) on a split model; leave it out")
        _require_peft()
        name = adapter_name or "default"
        if peft_model_id is None and (adapter_state_dict is None or peft_config is None):
            raise ValueError("load_adapter needs a folder (peft_model_id) or both adapter_state_dict and peft_config")
        hub = hub_options(kwargs)
        config = peft_config if peft_config is not None else peft.PeftConfig.from_pretrained(str(peft_model_id), **hub)
        config.inference_mode = not is_trainable
        weights = adapter_state_dict if adapter_state_dict is not None else peft.utils.load_peft_weights(
            str(peft_model_id), device="cpu", **hub)
        weights = {k.removeprefix(PEFT_PREFIX): v for k, v in weights.items()}  # PEFT's format: the PeftModel's names
        self.add_adapter(config, name)
        with self._first_shard_as_model() as view:
            result = peft.set_peft_model_state_dict(view, weights, adapter_name=name)
        if config.inference_mode:
            self.eval()
            for module in self.modules():
                if hasattr(module, "active_adapters") and hasattr(module, "base_layer"):
                    module.requires_grad_(False)
        logger.info("loaded adapter %r from %s into the split %s", name, peft_model_id or "a state dict", type(self).__name__)
        return result

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """With adapters added through ``load_adapter`` / ``add_adapter``, the active adapter in PEFT's format
        (adapter_config.json, adapter_model.safetensors; unsplit names and shapes), as transformers writes it
        for such a model; else the unsplit model."""
        if not getattr(self, "_hf_peft_config_loaded", False):
            return super().save_pretrained(save_directory, **kwargs)
        _require_peft()
        adopt_in_process(self)
        kwargs, given = save_pretrained_options(kwargs)
        target = Path(save_directory)
        check_save_folder(target)
        state = given if given is not None else gathered_adapter(self)
        with self._first_shard_as_model() as view:
            active = [a for m in view.modules() if hasattr(m, "active_adapters") and hasattr(m, "base_layer")
                      for a in m.active_adapters][:1] or list(self.peft_config)[:1]
            adapter = {PEFT_PREFIX + k: v.contiguous()
                       for k, v in peft.get_peft_model_state_dict(view, state_dict=state, adapter_name=active[0]).items()}
        config = self.peft_config[active[0]]

        def write(folder: Path) -> None:
            save_file(adapter, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
            config.save_pretrained(str(folder))

        write_into_folder(target, write, replaces=ADAPTER_FILES)
        logger.info("saved adapter %r of the split %s to %s (%d tensors)", active[0], type(self).__name__, target, len(adapter))

    def _first_shard_as_model(self):
        """The first device's shard, standing for the split model in transformers' and PEFT's adapter code: it has
        the unsplit module names; it carries the split model's adapter configs, and what is loaded into it goes
        to the split model (each device its slices)."""
        return standing_in_for(self, self.module_shards[0], peft_config=self.peft_config)


def _require_peft():
    if peft is None:
        raise ImportError("loading or adding adapters needs PEFT: pip install 'tensorshard[peft]'")
    return peft
