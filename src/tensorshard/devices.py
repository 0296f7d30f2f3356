"""Device lists: what users may pass as `device_ids`, checked before anything happens.

Accepted: a list of `torch.device`, strings ("cuda:1", "cpu") or GPU indices (1 -> "cuda:1"). "cpu" may
repeat: each occurrence is one simulated device (a slot with its own worker thread), which is how the
in-process engine is tested without GPUs. A GPU may appear only once.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

DeviceLike = "torch.device | str | int"


def default_devices() -> list[torch.device]:
    """All visible GPUs, else one CPU slot."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def as_device(value, *, what: str = "device") -> torch.device:
    if isinstance(value, bool):
        raise TypeError(f"{what} {value!r} is a bool; use 'cuda:0', 0 or 'cpu'")
    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} {value} is negative; GPU indices start at 0")
        device = torch.device("cuda", value)
    elif isinstance(value, str):
        try:
            device = torch.device(value)
        except RuntimeError as e:
            raise ValueError(f"{what} {value!r} is not a device name; use e.g. 'cuda:0' or 'cpu' ({e})") from None
    else:
        raise TypeError(f"{what} {value!r} has type {type(value).__name__}; use a torch.device, a string or an int")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what} {value!r} names a GPU, but CUDA is not available here; use 'cpu'")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"{what} {value!r} does not exist: {torch.cuda.device_count()} GPU(s) are visible "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1})"
            )
        device = torch.device("cuda", index)
    elif device.type == "meta":
        raise ValueError(f"{what} {value!r}: shards cannot live on the meta device; name real devices")
    return device


def resolve_devices(device_ids: Sequence | None) -> list[torch.device]:
    """Check and normalise a device list (None: all visible GPUs, else one CPU slot)."""
    if device_ids is None:
        return default_devices()
    if isinstance(device_ids, (str, int, torch.device)):
        raise TypeError(
            f"device_ids must be a list of devices, e.g. ['cuda:0', 'cuda:1'] or ['cpu'] * 2; got {device_ids!r}"
        )
    try:
        items = list(device_ids)
    except TypeError:
        raise TypeError(f"device_ids must be a list of devices; got {type(device_ids).__name__}") from None
    if not items:
        raise ValueError("device_ids is empty; give at least one device, e.g. ['cuda:0', 'cuda:1'] or ['cpu']")
    devices = [as_device(d, what=f"device_ids[{i}]") for i, d in enumerate(items)]
    repeated = [str(d) for d, n in Counter(devices).items() if n > 1 and d.type != "cpu"]
    if repeated:
        raise ValueError(
            f"device_ids lists {', '.join(repeated)} more than once; a GPU can hold only one shard "
            "(only 'cpu' may repeat, to simulate several devices)"
        )
    return devices


def device_labels(devices: Sequence[torch.device]) -> list[str]:
    """One unique label per slot: 'cuda:0', 'cuda:1'; repeated CPUs become 'cpu[0]', 'cpu[1]'."""
    counts = Counter(devices)
    return [str(d) if counts[d] == 1 else f"{d}[{r}]" for r, d in enumerate(devices)]
