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

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .layout import Box
from .sources import Source, Target


def _libraries():
    """The gguf reader and transformers (its GGUF helpers), imported on first use: only GGUF loads need them."""
    import gguf  # deferred: optional heavy dependency (the [hf] extra)
    import transformers.modeling_gguf_pytorch_utils  # deferred: optional heavy dependency (the [hf] extra)

    return gguf, transformers


def gguf_config(path: Path):
    """A transformers config built from the GGUF metadata (what from_pretrained(gguf_file=...) uses)."""
    _, transformers = _libraries()
    config = dict(transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    model_type = config.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **config)


class GGUFSource(Source):
    """The tensors of a GGUF file under the state-dict names of `hf_model` (a transformers model, may be
    on the meta device)."""

    def __init__(self, path: Path, hf_model) -> None:
        gguf, transformers = _libraries()
        hf_gguf = transformers.modeling_gguf_pytorch_utils
        self.path = Path(path)
        self.description = f"GGUF file {self.path}"
        self.reader = gguf.GGUFReader(str(self.path))
        arch = hf_gguf.read_field(self.reader, "general.architecture")[0]
        self.config = hf_model.config.to_dict()
        self.processor = hf_gguf.TENSOR_PROCESSORS.get(arch, hf_gguf.TensorProcessor)(config=self.config)
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
        gguf, _ = _libraries()
        t = self.tensors[name]
        weights = gguf.dequantize(t.data, t.tensor_type)
        parsed = {"tensors": {}, "config": self.config}
        result = self.processor.process(weights=weights, name=t.name, tensor_key_mapping=self.mapping, parsed_parameters=parsed)
        # F32 tensors come back as read-only views of the mapped file; copy those (quantized ones are new arrays)
        full = torch.from_numpy(np.require(result.weights, requirements=["C", "W"]))
        shape = self.info(name)[0]
        if tuple(full.shape) != shape:
            full = full.reshape(shape)
        whole = Box.whole(shape)
        for box, out in targets:
            out.copy_(full[box.within(whole)] if box.sizes else full)
        del full, weights
