"""Loading straight into the shards: the model is built empty, each device reads only its slices.

    model = tp.from_pretrained("path/to/checkpoint", ["cuda:0", "cuda:1"])

`from_pretrained` builds the model with its parameters on the meta device (`empty_weights`, like
accelerate's `init_empty_weights`: buffers such as rotary frequencies stay real), splits it with the plan
(which needs only shapes), then reads every tensor's slices from the checkpoint straight to their devices.

Under torchrun, ``tp.from_pretrained(path, mesh=mesh)`` does the same in every process: the model is built
empty, split in place by `parallelize` (``src_data_rank=None``: nothing is broadcast), and each process
reads only its own rank's slices.

**Memory contract.** Host memory beyond the loaded shards stays below one tensor of the checkpoint: a
safetensors slice is read from the mapped file into its device tensor, each file unmapped after each
tensor; a GGUF tensor is dequantized whole, once, then sliced. So peak host memory is at most one device's
share of the model (when the devices are CPU slots the shards *are* host memory) plus the largest single
tensor; under torchrun, per process: its rank's share plus the largest tensor. A tqdm bar shows the bytes
read.

**Hub key layouts.** Checkpoints that transformers converts on load (``save_pretrained`` and the hub still
store Mixtral's experts one by one and ViT under its old names) are read through transformers' own
conversion description (conversions.py): renamed tensors stream as above; a tensor built from several
stored ones (Mixtral's stacked ``experts.gate_up_proj``) is built whole on the host first, so it counts in
place of "the largest tensor" above, up to twice its size while it is built.

For those who load by hand (the `tensor_parallel` package's flow), see dispatch.py.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .. import quant
from ..logs import get_logger
from ..plans.plan import Plan
from .conversions import HubConversions
from .describe import model_layout
from .folders import open_folder
from .gguf import GGUFSource, gguf_config, read_gguf
from .index import read_index
from .loader import fill, match_tensors, still_meta
from .sources import INDEX_NAME, SafetensorsSource, describe_names
from .torchrun import job_of

logger = get_logger(__name__)


# --- loading a pretrained model ---------------------------------------------------------------------------


def load_pretrained(
    path: str | os.PathLike,
    split: Callable[[nn.Module, Any], nn.Module],
    *,
    in_place: bool = False,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    plan: Plan | dict | None = None,
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
    progress: bool = True,
    quantization_config: Any = None,
) -> nn.Module:
    """Build the model empty, ``split(module, plan)`` it, and stream its weights from `path` (what
    `tensorshard.from_pretrained` does; the front door passes the engine as `split`). `in_place`: `split`
    splits the module in place under torchrun (every process calls this; each reads its rank's slices).
    `quantization_config`: a BitsAndBytesConfig (in-process only): the empty model gets bitsandbytes layers
    and each device's slices are quantized on that device as soon as they are read (quant/loading.py)."""
    path = Path(path)
    if not path.exists():  # before anything is built (and before "no config.json" would name its parent)
        raise FileNotFoundError(
            f"from_pretrained({str(path)!r}): no such file or folder; give a checkpoint folder (config.json and "
            "safetensors or .bin files), a weights file, or a folder with gguf_file="
        )
    gguf_path = _gguf_path(path, gguf_file)
    if plan is None and gguf_path is None and (path / INDEX_NAME).exists():
        plan = _stored_plan(path)
    reader = read_gguf(gguf_path, progress=progress) if gguf_path is not None else None  # parsed once
    module = _build(path, model, dtype, gguf_path, reader)
    if quantization_config is not None:
        quant.prepare_empty(module, quantization_config)
    source = None
    if gguf_path is not None:
        source, index = GGUFSource(gguf_path, module, reader), None  # maps names on the unsplit module
    hub = HubConversions.of(module) if gguf_path is None else None  # needs the unsplit module's shapes
    if in_place:
        return _load_torchrun(module, split, plan, path, source, progress, hub)
    wrapped = split(module, plan)  # the split model keeps the module's modes (eval for transformers models)
    if source is None:
        source, index = _open(path, hub)
    layout = model_layout(wrapped)
    pairs = match_tensors(layout, source, aliases=(index or {}).get("aliases", {}), strict=False, exact_dtype=False)
    convert = quant.quantizing_converter(layout) if quantization_config is not None else None
    fill(layout, pairs, source, progress=progress, desc=f"loading {path.name}", convert=convert)
    source.close()
    _refuse_empty(layout, source)
    if quantization_config is not None:
        quant.finish_shards(wrapped.module_shards)
    logger.info("loaded %s into %d device(s): %d tensors", path, layout.world_size, len(pairs))
    return wrapped


def _open(path: Path, hub: HubConversions | None):
    """The folder's source and tensorshard index; a Hugging Face layout (no index) under the model's names,
    converted as transformers converts it on load (conversions.py). tensorshard and DCP checkpoints are
    saved under the model's names already."""
    source, index = open_folder(path)
    if hub is not None and index is None and isinstance(source, SafetensorsSource):
        try:
            source = hub.wrap(source)
        except BaseException:
            source.close()
            raise
    return source, index


def _load_torchrun(module: nn.Module, split, plan, path: Path, source, progress: bool, hub=None) -> nn.Module:
    """Split the empty `module` in place and fill this process's slices (every process)."""
    split(module, plan)
    layout = model_layout(module)
    job = job_of(layout)
    found: dict = {"source": source}

    def check() -> None:
        index = None
        if found["source"] is None:
            found["source"], index = _open(path, hub)
        aliases = (index or {}).get("aliases", {})
        found["pairs"] = match_tensors(layout, found["source"], aliases=aliases, strict=False, exact_dtype=False)

    def read() -> None:
        fill(layout, found["pairs"], found["source"], progress=progress and job.coordinator, desc=f"loading {path.name}")
        _refuse_empty(layout, found["source"])

    try:
        job.agree("checking the checkpoint", check)
        job.agree("reading the checkpoint", read)
    finally:
        if found["source"] is not None:
            found["source"].close()
    if job.coordinator:
        logger.info("loaded %s into %d rank(s): %d tensors", path, layout.world_size, len(found["pairs"]))
    return module


def _refuse_empty(layout, source) -> None:
    empty = still_meta(layout)
    if empty:
        raise RuntimeError(
            f"{len(empty)} tensor(s) were not in {source.description} and are still empty: {describe_names(empty)}. "
            "Check that the checkpoint belongs to this model; buffers the model computes itself must be real when "
            "it is built (tp.checkpoint.empty_weights() and accelerate.init_empty_weights() keep them so; "
            "torch.device('meta') does not)."
        )


def _stored_plan(folder: Path) -> Plan | None:
    """The plan a tensorshard checkpoint was saved with (used when from_pretrained gets no plan)."""
    data = read_index(folder).get("plan")
    if data is None:
        return None
    try:
        plan = Plan.from_dict(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{folder / INDEX_NAME}: the stored plan cannot be read ({e}); pass plan=...") from None
    logger.info("using the plan stored in %s", folder / INDEX_NAME)
    return plan


def _gguf_path(path: Path, gguf_file: str | None) -> Path | None:
    if gguf_file is not None:
        p = path / gguf_file if path.is_dir() else Path(gguf_file)
        if not p.exists():
            raise FileNotFoundError(f"gguf_file={gguf_file!r}: no such file {p}")
        return p
    return path if path.suffix == ".gguf" else None


@contextlib.contextmanager
def empty_weights():
    """Build modules with their parameters on the meta device and their buffers real, like accelerate's
    `init_empty_weights`, except that assigning an existing parameter to another module (tying weights,
    ``model.output.weight = model.embed.weight``) keeps it one parameter (accelerate's makes a copy)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            extra = dict(param.__dict__)
            param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad, **extra)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    if dtype is None or not dtype.is_floating_point:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _build(path: Path, model, dtype: torch.dtype | None, gguf_path: Path | None, reader=None) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    if model is not None:
        if not callable(model):
            raise TypeError(f"model must be an nn.Module or a function that builds one; got {type(model).__name__}")
        with empty_weights(), _default_dtype(dtype):
            built = model()
        if not isinstance(built, nn.Module):
            raise TypeError(f"model() returned {type(built).__name__}, not an nn.Module")
        return built
    return _build_transformers(path, dtype, gguf_path, reader)


def _build_transformers(path: Path, dtype: torch.dtype | None, gguf_path: Path | None, reader=None) -> nn.Module:
    try:
        import transformers  # deferred: optional heavy dependency (the [hf] extra)
    except ImportError as e:
        raise ImportError(
            f"building the model from {path} needs transformers (pip install tensorshard[hf]); or pass model=..."
        ) from e
    if gguf_path is not None:
        config = gguf_config(gguf_path, reader)
        dtype = dtype or torch.float32  # dequantized weights are float32
    else:
        folder = path if path.is_dir() else path.parent
        if not (folder / "config.json").exists():
            raise FileNotFoundError(
                f"{folder} has no config.json to build the model from; pass model=... (a module or a function)"
            )
        config = transformers.AutoConfig.from_pretrained(folder)
        dtype = dtype or getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    build = cls._from_config if cls is not None else transformers.AutoModelForCausalLM.from_config
    with empty_weights():
        module = build(config, dtype=dtype)
    return module.eval()  # as transformers' from_pretrained returns it (and ZeRO-3 stays off by default)
