"""Measuring tools shared by every job (plain PyTorch; the tensor_parallel peer's environment uses them too).

- `timed(fn, repeats, sync)`: one warm-up call, then `repeats` timed calls; returns the seconds.
- Memory of one device (a CPU slot of an in-process engine, or one process): `TensorBytes` adds up the
  bytes of the parameters, gradients and optimizer state it holds (the local shards of DTensors), and
  `SavedActivations` the bytes of the activations autograd saves for backward during its forward
  (unique storages, parameters excluded), recorded with `torch.autograd.graph.saved_tensors_hooks` in the
  thread that runs that device's forward. `Rss` reads the process's resident set (VmRSS) and its
  high-water mark (VmHWM, reset through /proc/self/clear_refs).
- `CommCounter`: torch's `CommDebugMode`, plus the bytes of each collective's result.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Callable, Iterable

import torch

# --- timing -------------------------------------------------------------------------------------------------


def sync_device(device: str) -> None:
    """Wait for every GPU of this process (an in-process engine drives several)."""
    if device.startswith("cuda"):
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def timed(fn: Callable[[], object], repeats: int, *, device: str = "cpu", warmup: int = 1,
          before: Callable[[], None] | None = None, cpu: list[float] | None = None) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` untimed calls; `before()` runs untimed
    ahead of every call (a barrier between processes, say). `cpu` receives the CPU seconds this process
    (all its threads) spent in each call."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    times = []
    for _ in range(repeats):
        if before:
            before()
        sync_device(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        sync_device(device)
        times.append(time.perf_counter() - start)
        if cpu is not None:
            cpu.append(time.process_time() - start_cpu)
    return times


def summary(times: list[float]) -> dict:
    """Median, quartiles, min and max of a list of seconds."""
    xs = sorted(times)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": xs[0], "max": xs[-1], "n": len(xs), "all": times}


def one_thread() -> None:
    """One intra-op thread: this process (or each shard thread of an in-process engine) is one device."""
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set, or parallel work already started


# --- memory -------------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return _local(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class SavedActivations:
    """Bytes of the distinct storages autograd saves for backward while the hooks are on (in this thread).
    Storages of `exclude` (parameters) are not activations and are skipped."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.exclude = {_storage_ptr(t) for t in exclude}
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        if local.device.type != "meta":
            storage = local.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self.exclude:
                self.storages[ptr] = max(self.storages.get(ptr, 0), storage.nbytes())
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def hook_slots(modules, activations: list[SavedActivations]) -> None:
    """Record each device's saved activations during its own module's forward (the thread that runs it)."""
    for module, act in zip(modules, activations):
        entered = []

        def pre(mod, inputs, act=act, entered=entered):
            ctx = act.hooks()
            ctx.__enter__()
            entered.append(ctx)

        def post(mod, inputs, output, entered=entered):
            entered.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def state_bytes(params: list[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer | None,
                select: Callable[[str], bool] = lambda name: True) -> dict:
    """Bytes of parameters, their gradients and their optimizer state, for the named parameters selected."""
    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "optim": 0}
    for name, p in params:
        if id(p) in seen or not select(name):
            continue
        seen.add(id(p))
        out["params"] += _nbytes(p)
        if p.grad is not None:
            out["grads"] += _nbytes(p.grad)
        if optimizer is not None:
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:  # skip the scalar step counters
                    out["optim"] += _nbytes(v)
    return out


def device_memory(params: list[tuple[str, torch.Tensor]], optimizer, activations: int, split: Callable[[str], bool]) -> dict:
    """The memory record of one device: all its state, its split weights' state, and activations."""
    everything = state_bytes(params, optimizer)
    split_state = state_bytes(params, optimizer, split)
    return {
        **everything,
        "activations": activations,
        "total": everything["params"] + everything["grads"] + everything["optim"] + activations,
        "split_state": split_state["params"] + split_state["grads"] + split_state["optim"],
    }


class Rss:
    """This process's resident memory: `baseline()` now, `reset_peak()`, `peak()` since the reset (Linux)."""

    @staticmethod
    def _read(field: str) -> int:
        try:
            with open("/proc/self/status") as f:
                m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
            return int(m.group(1)) * 1024 if m else 0
        except OSError:
            return 0

    def now(self) -> int:
        return self._read("VmRSS")

    def reset_peak(self) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def peak(self) -> int:
        return self._read("VmHWM")


# --- communication ------------------------------------------------------------------------------------------


def comm_counter():
    """A CommDebugMode that also adds up the bytes of each collective's largest tensor (its result for an
    all-gather, its input = output for an all-reduce): `.counts` {op: n}, `.bytes` {op: bytes}."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
    from torch.utils._pytree import tree_leaves

    class CommCounter(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.nbytes: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            packet = getattr(func, "_overloadpacket", None)
            if out is not NotImplemented and packet is not None and (packet in self.comm_registry or packet in c10d_collective_ops):
                name = _op_name(NATIVE_TO_PY_MAPPING.get(packet, packet))
                tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
                size = max((t.numel() * t.element_size() for t in tensors), default=0)
                self.nbytes[name] = self.nbytes.get(name, 0) + size
            return out

        @property
        def counts(self) -> dict[str, int]:
            return {_op_name(op): n for op, n in self.get_comm_counts().items() if n}

    return CommCounter()


def _op_name(op) -> str:
    """'all_reduce', 'all_gather', 'reduce_scatter', 'broadcast', ... for a c10d or functional op."""
    name = str(getattr(op, "__name__", op)).split(".")[-1].strip("_")
    name = name.replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    name = name.replace("_into_tensor", "").replace("_base", "").replace("_tensor", "").replace("_coalesced", "")
    return name.replace("reduce_scatter_", "reduce_scatter")
