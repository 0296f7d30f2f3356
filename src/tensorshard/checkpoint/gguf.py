"""GGUF files (llama.cpp) as a `Source`: one tensor dequantized at a time, named as transformers names it.

The file is memory-mapped by the `gguf` package's `GGUFReader`; reading a tensor dequantizes it (float32
for quantized types) with `gguf.dequantize`, applies transformers' per-architecture fix-ups (the reverse
of llama.cpp's q/k row permutation, ...) from `transformers.modeling_gguf_pytorch_utils`, and copies the
requested boxes out. Host memory beyond the destination: one dequantized tensor.

The configuration comes from the file's metadata the way transformers reads it, so
``tp.from_pretrained("model.gguf", devices)`` needs nothing else. Mixture-of-experts GGUFs, whose experts
transformers restacks across tensors, are not supported here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .layout import Box
from .sources import Source, Target


def _libraries():
    """The gguf reader, transformers and its GGUF helpers, imported on first use: only GGUF loads need them.
    The helpers module is taken from the import system: as an attribute of transformers' lazy top-level module
    it is missing in a fresh process."""
    import gguf  # deferred: optional heavy dependency (the [hf] extra)
    import transformers  # deferred: optional heavy dependency (the [hf] extra)

    return gguf, transformers, importlib.import_module("transformers.modeling_gguf_pytorch_utils")


def read_gguf(path: Path, *, progress: bool = True):
    """Parse the file's header once (its metadata and tensor list: seconds for a tokenizer of 50k tokens),
    with a progress bar from the start. Returns the `gguf.GGUFReader`, for `gguf_config` and `GGUFSource`."""
    gguf, _, _ = _libraries()
    with tqdm(total=1, desc=f"reading the GGUF header of {Path(path).name}", disable=not progress, leave=False) as bar:
        reader = gguf.GGUFReader(str(path))
        bar.update(1)
    return reader


_READER_LOCK = threading.Lock()


@contextlib.contextmanager
def name_maps_made_once():
    """Inside, gguf's `get_tensor_name_map(arch, blocks)` is made once per architecture and depth. transformers'
    `get_gguf_hf_weights_map` asks for it again at every module it walks (397 times for SmolLM2-135M's 30 layers:
    5 s of CPU, growing with the square of the depth), and the map is the same every time. Put back on exit."""
    gguf, _, _ = _libraries()
    with _READER_LOCK:
        own = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(own)
        try:
            yield
        finally:
            gguf.get_tensor_name_map = own


def gguf_config(path: Path, reader=None):
    """A transformers config built from the GGUF metadata (what from_pretrained(gguf_file=...) uses).

    transformers' `load_gguf_checkpoint` opens the file with its own `GGUFReader`; given `reader` (from
    `read_gguf`), that call gets this one instead of parsing the header a second time."""
    gguf, transformers, hf_gguf = _libraries()
    load = hf_gguf.load_gguf_checkpoint
    if reader is None:
        parsed = load(str(path), return_tensors=False)
    else:
        with _READER_LOCK:  # transformers looks gguf.GGUFReader up when called: hand it the parsed file
            own = gguf.GGUFReader
            gguf.GGUFReader = lambda p, *a, **k: reader if Path(p) == Path(path) else own(p, *a, **k)
            try:
                parsed = load(str(path), return_tensors=False)
            finally:
                gguf.GGUFReader = own
    config = dict(parsed["config"])
    model_type = config.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **config)


class GGUFSource(Source):
    """The tensors of a GGUF file under the state-dict names of `hf_model` (a transformers model, may be
    on the meta device)."""

    def __init__(self, path: Path, hf_model, reader=None) -> None:
        gguf, _, hf_gguf = _libraries()
        self.path = Path(path)
        self.description = f"GGUF file {self.path}"
        self.reader = reader if reader is not None else gguf.GGUFReader(str(self.path))
        arch = hf_gguf.read_field(self.reader, "general.architecture")[0]
        self.config = hf_model.config.to_dict()
        self.processor = hf_gguf.TENSOR_PROCESSORS.get(arch, hf_gguf.TensorProcessor)(config=self.config)
        with name_maps_made_once():
            self.mapping = hf_gguf.get_gguf_hf_weights_map(hf_model, self.processor)
        self.tensors = {}
        for t in self.reader.tensors:
            name = self.mapping.get(t.name)
            if name is not None:
                # GGUF lists dimensions innermost first; the dequantized array is in PyTorch order.
                self.tensors[name] = t
        if not self.tensors:
            raise NotImplementedError(f"{self.path}: none of its tensors map onto {type(hf_model).__name__}'s names")

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = self.tensors[name]
        return tuple(int(n) for n in reversed(t.shape)), torch.float32

    def read(self, name: str, targets: Sequence[Target]) -> None:
        gguf, _, _ = _libraries()
        t = self.tensors[name]
        weights = gguf.dequantize(t.data, t.tensor_type)
        parsed = {"tensors": {}, "config": self.config}
        result = self.processor.process(weights=weights, name=t.name, tensor_key_mapping=self.mapping, parsed_parameters=parsed)
        # F32 tensors come back as read-only views of the mapped file; copy those (quantized ones are new arrays).
        # Through the array's own methods: numpy is the gguf package's dependency, not tensorshard's.
        array = result.weights
        if not (array.flags.c_contiguous and array.flags.writeable):
            array = array.copy(order="C")
        full = torch.from_numpy(array)
        shape = self.info(name)[0]
        if tuple(full.shape) != shape:
            full = full.reshape(shape)
        whole = Box.whole(shape)
        for box, out in targets:
            out.copy_(full[box.within(whole)] if box.sizes else full)
        del full, weights
