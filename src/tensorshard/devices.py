"""Device lists: what users may pass as `device_ids`, checked before anything happens.

Accepted: a list (a tuple, any ordered sequence, a generator) of `torch.device`, strings ("cuda:1", "cpu") or
GPU indices (1 -> "cuda:1"); the order is the order of the shards. Refused: a dict (``{"cpu": 2}`` would
silently mean its keys, one device), a set (no order) and anything else that is not such a list. "cpu" may
repeat: each occurrence is one simulated device (a slot with its own worker thread), which is how the
in-process engine is tested without GPUs ("cpu:1" is the same as "cpu"). A GPU may appear only once and
must be visible; other device types (xpu, mps, ...) must be available in this PyTorch build.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, MappingView, Sequence, Set

import torch

from .logs import get_logger

logger = get_logger(__name__)


def default_devices() -> list[torch.device]:
    """All visible GPUs, else one CPU slot."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def as_device(value, *, what: str = "device") -> torch.device:
    """One device, checked: it must exist here (a GPU index below the number of visible GPUs)."""
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
    if device.type == "cpu":
        return torch.device("cpu")  # "cpu:1" is the same memory as "cpu": one more CPU slot
    if device.type == "meta":
        raise ValueError(f"{what} {value!r}: shards cannot live on the meta device; name real devices")
    backend = getattr(torch, device.type, None)
    if not (callable(getattr(backend, "is_available", None)) and backend.is_available()):
        kind = "a GPU, but CUDA" if device.type == "cuda" else f"a device of type {device.type!r}, but that type"
        raise ValueError(f"{what} {value!r} names {kind} is not available here; use 'cpu' or a device type that is")
    count = backend.device_count() if callable(getattr(backend, "device_count", None)) else None
    index = device.index
    if index is None and callable(getattr(backend, "current_device", None)):
        index = backend.current_device()
    if count is not None and index is not None and index >= count:
        raise ValueError(
            f"{what} {value!r} does not exist: {count} {device.type} device(s) are visible "
            f"({device.type}:0..{device.type}:{count - 1}). Check CUDA_VISIBLE_DEVICES, or list fewer devices."
        )
    return torch.device(device.type, index) if index is not None else device


def resolve_devices(device_ids: Sequence | None) -> list[torch.device]:
    """Check and normalise a device list (None: all visible GPUs, else one CPU slot)."""
    if device_ids is None:
        devices = default_devices()
        if len(devices) == 1 and devices[0].type == "cpu":
            logger.warning(
                "no device list given and no GPU is visible: using one CPU device, so nothing is split. Pass the "
                "devices, e.g. tp.tensor_parallel(model, ['cpu', 'cpu']) to simulate two on this machine."
            )
        return devices
    items = device_list(device_ids)
    if not items:
        raise ValueError("device_ids is empty; give at least one device, e.g. ['cuda:0', 'cuda:1'] or ['cpu']")
    devices = [as_device(d, what=f"device_ids[{i}]") for i, d in enumerate(items)]
    repeated = [str(d) for d, n in Counter(devices).items() if n > 1 and d.type != "cpu"]
    if repeated:
        positions = {r: [i for i, d in enumerate(devices) if str(d) == r] for r in repeated}
        where = "; ".join(f"{r} at positions {p}" for r, p in positions.items())
        raise ValueError(
            f"device_ids {items!r} lists a device more than once ({where}); a GPU holds only one shard. List "
            "each GPU once (only 'cpu' may repeat, to simulate several devices on one machine)."
        )
    return devices


def device_list(device_ids) -> list:
    """The items of a device list, in order, once it is checked to be one (see the module docstring); the items
    themselves are checked by `as_device`. Called before anything changes, so a refusal leaves the model as it was."""
    example = "e.g. ['cuda:0', 'cuda:1'] or ['cpu'] * 2"
    if isinstance(device_ids, (str, bytes, int, torch.device)):
        raise TypeError(f"device_ids must be a list of devices, {example}; got {device_ids!r}")
    if isinstance(device_ids, (Mapping, MappingView)):
        raise TypeError(
            f"device_ids must be a list of devices, {example}; got a {type(device_ids).__name__} ({device_ids!r}), "
            "whose keys would be taken as the devices. To give a device several shards, repeat it in the list: "
            "['cpu'] * 2 for two CPU slots"
        )
    if isinstance(device_ids, Set):
        raise TypeError(
            f"device_ids must be a list of devices, {example}; got a {type(device_ids).__name__} ({device_ids!r}), "
            "which has no order (device i holds shard i) and cannot repeat 'cpu'. Pass a list"
        )
    if not isinstance(device_ids, (Sequence, Iterator)):
        raise TypeError(f"device_ids must be a list of devices, {example}; got {type(device_ids).__name__}. Pass a list")
    return list(device_ids)


def device_labels(devices: Sequence[torch.device]) -> list[str]:
    """One unique label per slot: 'cuda:0', 'cuda:1'; repeated CPUs become 'cpu[0]', 'cpu[1]'."""
    counts = Counter(devices)
    return [str(d) if counts[d] == 1 else f"{d}[{r}]" for r, d in enumerate(devices)]
