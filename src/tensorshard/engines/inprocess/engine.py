"""The in-process engine: one Python process, one shard of the model per device, one thread per shard.

    model = TensorParallel(model, ["cuda:0", "cuda:1"])   # or tensor_parallel(...)
    loss = loss_fn(model(x), y); loss.backward(); optimizer.step()

Wrapping builds one shard per device (build.py): a copy of the module tree whose split layers hold only
their slices (as the plan says) and whose other parameters are whole copies. Each call copies the inputs to
every device, runs the shards concurrently (shard 0 in the caller's thread), and returns shard 0's
outputs on `output_device`. Each shard builds its own autograd graph and `backward()` runs the shards'
backward passes concurrently too (shard_backward.py; in debug mode on a GPU, where every shard is on that
GPU, one graph spans the shards instead, comm/threads.py), so `backward()` and an optimizer over `model.parameters()` train
the shards exactly like the unsplit model (a replicated parameter gets its full gradient on every
device), activation checkpointing included.

Failures: a shard that raises, returns early or gets stuck stops the whole call within the timeout,
with an error naming the device and the operation, and the model stays usable (docs/errors.md). Calls
from several threads take turns; building the shards is all-or-nothing.

Memory: the original module is consumed. Its tensors are moved into the shards one by one (so the whole
model never exists twice) and it is left on the meta device; calling it afterwards raises an error.
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ... import quant
from ...comm.dropout import ShardDropout, ThreadPeers, may_drop
from ...comm.threads import ThreadGroup
from ...comm.timeout import resolve_timeout
from ...devices import as_device, device_labels, resolve_devices
from ...global_hooks import split_model_made
from ...logs import get_logger
from ...model_kind import ModelKind
from ...partition import Partition
from ...plans import resolve_plan
from ...plans.balance import check_balance
from ...plans.plan import Plan
from ...plans.sharding import shard_plan
from ...plans.slices import SplitLayout, register_engine
from ...registrations import count_modules_and_tensors
from ..late_modules import adopt_late_modules
from ..resplit import mark_consumed, mark_split, refuse_split_twice
from ..shared_config import guard as guard_configurations
from ..split_report import report_split
from .boundary import gather_outputs, replicate_inputs, to_device
from .build import build_shards, consume
from . import compiled_shards
from .copies import deep_copy, refuse_pickle
from .grad_norm import clip_grad_norm_
from .package_names import PackageNames
from .schedule import Schedule
from .shard_attributes import record_per_device
from .shard_backward import ShardGraphs, join_outputs
from .unsplit_state import is_unsplit, load_unsplit
from .views import follow_root, make_view, root_of
from .workers import ThreadState, WorkerPool
from .zero import choose_params, shard_replicated

logger = get_logger(__name__)

_shard = threading.local()  # .rank: the shard the current thread is running
_live: "weakref.WeakSet[TensorParallel]" = weakref.WeakSet()  # models split over several devices


def live_models() -> list["TensorParallel"]:
    """The models split over several devices of this process that are still referenced (default_step.py)."""
    return list(_live)


def current_rank() -> int | None:
    """The rank of the shard running in this thread, or None outside a TensorParallel call.

    Objects passed to every shard (a KV cache, say) use it to keep per-device state.
    """
    return getattr(_shard, "rank", None)


@contextmanager
def _as_rank(rank: int) -> Iterator[None]:
    """`current_rank()` is `rank` inside."""
    previous, _shard.rank = current_rank(), rank
    try:
        yield
    finally:
        _shard.rank = previous


class TensorParallel(PackageNames, nn.Module):
    """A module split over several devices of this process (also under the tensor_parallel package's names for
    its plan, ZeRO-3 state and wrapper level: package_names.py).

    Args:
        module: the model to split. It is consumed: see the module docstring.
        device_ids: devices, one shard each (default: all visible GPUs, else one CPU slot). "cpu" may
            repeat to simulate several devices.
        output_device: where outputs land (default: the first device).
        plan: a `Plan` (or a ``{pattern: style}`` dict). Default: a preset for known transformers
            architectures, else a plan inferred from the model's structure.
        timeout: seconds any shard may wait at a collective before the call fails with an error naming the
            missing device and the operation (default 300, or the TENSORSHARD_TIMEOUT environment
            variable). See docs/errors.md for what happens when a shard fails.
        debug: run every shard on the first device, one at a time, and check that replicated outputs agree
            (also TENSORSHARD_DEBUG=1): tells a plan bug from an engine bug.
        sharded: ZeRO-3 for the parameters the plan leaves whole (see engines/inprocess/zero.py). Off here;
            `tensor_parallel()` turns it on by default when training.
        sharded_param_names: which of them to partition (default: every trainable one).
        check: self-check the plan before splitting (see `tensor_parallel`).
        balance: even out each device's weights over blocks whose heads split unevenly (see `tensor_parallel`).
        kind: the module's kind (model_kind.py) as `tensor_parallel` decided it; None: decided where the plan is.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence | None = None,
        *,
        output_device: Any = None,
        plan: Plan | dict | None = None,
        timeout: float | None = None,
        debug: bool | None = None,
        sharded: bool = False,
        sharded_param_names: Sequence[str] | None = None,
        check: bool | None = None,
        kind: ModelKind | None = None,
        balance: bool = False,
    ) -> None:
        # nn.Module's own constructor, not super(): a subclass may also inherit the wrapped model's class
        # (integrations/transformers does), whose constructor would build a fresh model.
        nn.Module.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(f"tensor_parallel() splits an nn.Module; got {type(module).__name__}")
        refuse_split_twice(module)  # a split model, or the original an earlier split emptied
        quant.check_quantized_model(module, "inprocess")  # bitsandbytes installed, a method we split
        self.balance = check_balance(balance)
        devices = resolve_devices(device_ids)
        self.debug = _env_flag("TENSORSHARD_DEBUG") if debug is None else bool(debug)
        self.devices = devices
        self.labels = device_labels(devices)
        self.output_device = as_device(output_device, what="output_device") if output_device is not None else devices[0]
        self.timeout = resolve_timeout(timeout)


        world = len(devices)
        self.plan = resolve_plan(module, plan, world, check=check, kind=kind)
        layout = shard_plan(module, self.plan, world, balance=self.balance)  # raises on any plan error; the model is untouched
        only = sorted(
            {f"{ms.name or '<root>'}: {ms.style.describe()}" for ms in layout.modules.values() if getattr(ms.style, "torchrun_only", False)}
        )
        if only:
            raise NotImplementedError(
                f"the plan uses styles only the torchrun engine implements ({'; '.join(only)}): run under torchrun "
                "with tensorshard.parallelize(), or use a plan without SequenceParallel / RowwiseToSequence / "
                "VocabParallelHead in one process"
            )

        placement = [devices[0]] * world if self.debug else devices
        self._group = ThreadGroup(placement, self.timeout, serial=self.debug, labels=self.labels)
        self._dropout = ShardDropout(ThreadPeers(self._group)) if world > 1 and may_drop(module) else None  # comm/dropout.py
        self._pool = WorkerPool()
        # calls without gradients: the shards at the same time, or one at a time where that is faster (schedule.py)
        self._schedule = Schedule() if world > 1 and not self.debug else None
        # Concurrent callers take turns: the shards share one rendezvous. Public: code that runs the shards itself
        # (the fast decode step, stitched_decode.py) holds it while it does. Re-entrant: a capture holds it around
        # its call, while it changes the modules for dynamo (engines/cheap_tracing.py).
        self.call_lock = threading.RLock()
        # How each tensor of the original is split, by its original state-dict name (for gathered saves).
        self.splits: dict[str, tuple[int, Partition] | None] = layout.slice_map(module)
        zero_names = choose_params(module, self.splits, world, sharded_param_names) if sharded else []
        self.module_shards = nn.ModuleList(build_shards(module, layout, placement, self._group))  # atomic
        record_per_device(module, self.module_shards)  # what a view may not set on every device (shard_attributes.py)
        guard_configurations(self.module_shards, f"over {world} device(s)")  # one configuration (shared_config.py)
        self._placement = placement
        self._module_names = {n for n, _ in self.module_shards[0].named_modules()}  # to spot adapters added later
        self._module_count = count_modules_and_tensors(self.module_shards[0])
        self._layout_modules = dict(layout.modules)  # each split module's style and head groups, for those adapters
        self._register_load_state_dict_pre_hook(_load_unsplit, with_module=True)
        # The wrapper takes the module's own mode; every submodule of the shards keeps the mode it had (a
        # train-mode wrapper around an eval-mode model, as get_peft_model returns, keeps its dropout off).
        # train()/eval() on the split model later reach every shard as usual.
        self.training = self.module_shards.training = module.training
        self._loaded = False  # set once no tensor is on the meta device
        self.__dict__["_consumed"] = (module, consume(module, world))  # kept, empty, for deep copies
        mark_consumed(module, self.labels)
        mark_split(self, self.labels)
        shard_replicated(self, zero_names)
        install_partial_grads(self)  # after ZeRO-3's hooks
        if self._dropout is not None:
            self._dropout.install(self.module_shards)
        meta = sum(1 for t in list(self.module_shards[0].parameters()) + list(self.module_shards[0].buffers()) if t.is_meta)
        if meta:
            logger.info("%d tensor(s) are on the meta device: load the weights into the split model before calling it", meta)
        split = {n for n, m in layout.modules.items() if m.splits}
        summary = f"split {type(module).__name__} over {world} device(s) {self.labels}: {len(split)} module(s) split, {len(self.plan)} plan entries"
        report_split(module, self.plan, split, world, summary)
        if self.debug:
            logger.info("debug: the shards run one after another on %s", placement[0])
        if world > 1:
            _live.add(self)
        split_model_made(self)  # the process-wide hooks this model needs, while it lives (global_hooks.py)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def shard_devices(self) -> list[torch.device]:
        """The device each shard runs on, in rank order: `devices`, except under `debug`, where every shard runs on
        the first of them (what a per-shard object, such as each device's KV cache, must be placed on)."""
        return list(self._placement)

    def running_here(self) -> bool:
        """Whether the calling thread is running one of this model's shards (code called from inside its forward or
        backward: a hook, a callback): a call of the model from there would wait for itself. Code that runs the
        shards without the engine's call (the fast decode path, stitched_decode.py) asks before it does."""
        return self._group.running_here()

    def apply_sharding(self, sharded_param_names: Sequence[str] | None = None) -> list[str]:
        """ZeRO-3, after splitting, of the parameters the plan leaves whole (what ``sharded=True`` does at split
        time; call it once the weights of a model split on the meta device are loaded). Names are the unsplit
        model's (default: every trainable one with at least as many rows as devices). Returns those partitioned."""
        if getattr(self, "zero_splits", None):
            raise RuntimeError(
                "ZeRO-3 is already applied to this model (sharded=True when it was split, or an earlier "
                "apply_sharding()); split with sharded=False to choose the parameters later"
            )
        _check_loaded(self)
        return shard_replicated(self, choose_params(self.module_shards[0], self.splits, self.world_size, sharded_param_names))

    # -- running -----------------------------------------------------------------------------------------

    @torch.compiler.disable(recursive=False)  # a frame dynamo skips: the shards are compiled in their threads
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # torch.compile(split), or compiled code calling it: the compiler dynamo set for this thread, taken off
        # here, before any other frame starts (one would be traced); compiled_shards.py runs the shards under it.
        swap = compiled_shards.set_compiler
        compiler = swap(None) if swap is not None else None  # (a builtin: no frame of its own)
        if compiler is None or compiler is False:
            if swap is not None:
                swap(compiler)
            return super().__call__(*args, **kwargs)
        try:
            return compiled_shards.run_compiled(self, compiler, super().__call__, args, kwargs)
        finally:
            swap(compiler)

    @torch.compiler.disable(recursive=False)  # what split.compile() compiles: as __call__ (compiled_shards.py)
    def _compiled_call(self, *args: Any, **kwargs: Any) -> Any:
        swap = compiled_shards.set_compiler
        compiler = swap(None)
        try:
            return compiled_shards.run_compiled(self, compiler, self._call_impl, args, kwargs)
        finally:
            swap(compiler)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """torch.compile every shard's forward (on a view, such as a block: that part of every shard), with
        `torch.compile`'s options; the collectives are inside the graphs (compiled_shards.py)."""
        compiled_shards.compile_split(self, root_of(self), args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.run_modules(args, kwargs)

    def run_modules(
        self, args: tuple, kwargs: dict, module: Callable[[int, tuple, dict], Any] | None = None, *, serial: bool | None = None
    ) -> Any:
        """One call of the split model: `module(rank, args, kwargs)` runs shard `rank` on its copy of the inputs
        (default: the shard module itself; compiled_steps.py gives each shard's compiled forward). `serial`: the
        shards one at a time (True) or together (False); default: as the call schedule chooses (schedule.py)."""
        _check_loaded(self)
        adopt_late_modules("inprocess", self)  # LoRA added after splitting follows the split (late_modules.py)
        shards, devices, group = self.module_shards, self._placement, self._group
        compiler = compiled_shards.compiler_of_the_call() if module is None else None
        call = module if module is not None else (lambda rank, a, kw: shards[rank](*a, **kw))
        if compiler is not None:
            call = compiled_shards.shard_call(self, compiler)  # each shard compiled in its thread
        if compiled_shards.take_warmup(root_of(self)):
            serial = True  # compiling: one shard at a time
        if len(shards) == 1:
            args, kwargs = to_device((args, kwargs), devices[0])
            with _as_rank(0):
                return to_device(call(0, args, kwargs), self.output_device)

        if group.running_here():
            raise RuntimeError(
                "this TensorParallel model was called from inside one of its own shards (a hook or callback "
                "running during its forward). A split model runs one call at a time; call it after the outer "
                "call returns."
            )
        state = ThreadState.capture()
        src = next((r for r, d in enumerate(devices) if d == self.output_device), 0)
        graphs = ShardGraphs(self, src, serial=bool(serial)) if group.own_graphs else None
        per_rank_inputs = replicate_inputs((args, kwargs), devices, graphs.leaf_copies if graphs else None)
        dropout = self._dropout if self.training else None
        if dropout is not None:
            record = dropout.begin_forward()
            if graphs is not None:
                graphs.dropout = record  # its backward recomputes (activation checkpointing) with the same masks

        compiled = compiled_shards.kind_of_call(root_of(self), compiler is not None, module is not None)

        def run(rank: int):
            with state.applied(devices[rank]), dropout.mode(rank) if dropout is not None else nullcontext():
                a, kw = per_rank_inputs(rank)
                group.compiled[rank] = compiled  # its eager collectives meet compiled ones (comm/threads.py)
                try:
                    return call(rank, a, kw)
                finally:
                    group.compiled[rank] = ""

        timing = self._schedule.begin(args, kwargs) if self._schedule is not None and serial is None else None
        outputs = self._run_shards("forward", run, serial=serial if serial is not None else timing is not None and timing.serial)
        if timing is not None:
            self._schedule.end(timing, self._collectives, len(shards))
        if graphs is not None:
            return join_outputs(graphs, outputs, src, self.output_device, self.labels, check_equal=self.debug)
        return gather_outputs(outputs, src, self.output_device, devices, self.labels, check_equal=self.debug)

    def _run_shards(self, kind: str, body: Callable[[int], Any], *, inline: int = 0, serial: bool = False) -> list[Any]:
        """`body(rank)` for every shard at once, one thread each (shard `inline` in this one), as one call of the
        shards' rendezvous ("forward", or "backward": shard_backward.py): a failure or a stall in any shard stops
        them all within the time limit (workers.py, comm/rendezvous.py). Calls take turns. `serial`: the shards
        take turns too, shard `inline` first, handing the turn on at every collective (schedule.py)."""
        group = self._group

        def shard(call, rank: int):
            def run():
                with _as_rank(rank):
                    return body(rank)

            return lambda: group.run_shard(call, rank, run)

        with self.call_lock:
            call = group.begin(kind, serial=serial, first=inline)
            try:
                return self._pool.run(
                    [shard(call, r) for r in range(len(self._placement))],
                    labels=self.labels,
                    on_error=lambda e, rank: group.abort(call, e),
                    timeout=self.timeout + 5.0,
                    first_error=lambda: call.error,
                    grace=min(5.0, self.timeout),
                    inline=inline,
                )
            finally:
                self._collectives = max(call.seq)  # how many this call ran (schedule.py reads it)
                group.end(call)  # drop the call's cached tensors; a straggler fails at its next collective

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients by the unsplit model's norm (each element counted once; grad_norm.py), as FSDP's
        method of that name does; returns the norm before clipping. `torch.nn.utils.clip_grad_norm_` over
        ``model.parameters()`` counts tensors held on several devices once per device."""
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def state_dict(self, *args, **kwargs):
        """The shards' state (keys ``module_shards.N...``; ``tp.save_tensor_parallel(model)`` gives the unsplit
        one). ``load_state_dict`` takes either form (unsplit names: each device keeps its slice), as
        transformers' Trainer uses it to resume. Adapters added since splitting are adopted first (engines/late_modules.py)."""
        adopt_late_modules("inprocess", self)
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads the shards' state (keys ``module_shards.N...``, as `state_dict()` writes it) or the unsplit
        model's state dict (its own names and shapes): each tensor is sliced for every device."""
        adopt_late_modules("inprocess", self)
        if is_unsplit(state_dict):
            return load_unsplit(self, state_dict, strict=strict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def __deepcopy__(self, memo: dict) -> "TensorParallel":
        """A second split model on the same devices with copies of every slice (engines/inprocess/copies.py)."""
        return deep_copy(self, memo)

    def __reduce_ex__(self, protocol):
        refuse_pickle(self)  # torch.save(model): name the savers that work

    def extra_repr(self) -> str:
        return f"devices={self.labels}, output_device={self.output_device}"

    def view(self, path: str) -> "TensorParallel":
        """A TensorParallel that runs submodule `path` of every shard (the encoder of an encoder-decoder, an
        embedding), sharing this model's parameters, devices, workers and collectives. Calls to a view and to
        its model must not overlap. Adapters added later are adopted by the split model the view was made from,
        whichever is called first, and the view follows (views.py)."""
        return make_view(self, path, TensorParallel)

    def memory_per_device(self) -> dict[str, int]:
        """Bytes of parameters and buffers held by each device slot, in order."""
        return {label: _tensor_bytes(shard) for label, shard in zip(self.labels, self.module_shards)}


# --- what the engine tells the rest of the package --------------------------------------------------------


@register_engine
def split_layout(model: object) -> SplitLayout | None:
    """Which slice of which original tensor each device holds (None for anything but a TensorParallel)."""
    if not isinstance(model, TensorParallel):
        return None
    follow_root(model)  # a view: its splits as its split model's are now (views.py)
    zero = getattr(model, "zero_splits", {})
    placements = {name: zero.get(name, split) for name, split in model.splits.items()}
    devices = list(getattr(model, "_placement", model.devices))
    return SplitLayout("inprocess", model.plan, placements, list(model.module_shards), devices, sorted(zero))


def install_partial_grads(model: TensorParallel) -> None:
    """Route the parameters the styles registered as having partial gradients (comm/partial_grads.py)."""
    partial = getattr(model._group, "partial_grads", None)
    if partial is not None:
        partial.install(model.module_shards)


def _check_loaded(model: TensorParallel) -> None:
    if model._loaded:
        return
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    meta = list(dict.fromkeys(re.sub(r"^module_shards\.\d+\.", "", n) for n, t in tensors if t.is_meta))  # original names
    if meta:
        more = f" (and {len(meta) - 1} more)" if len(meta) > 1 else ""
        raise RuntimeError(
            f"{meta[0]}{more} is on the meta device: this model was split without its weights. Load them into "
            "the split model first (tp.load_sharded(model, path), or build and load in one step with "
            "tp.from_pretrained(path, devices, model=...)), or split a model that holds its weights. Buffers computed in __init__ (rotary inv_freq, say) are not in checkpoints: build the "
            "model with them on a real device."
        )
    model._loaded = True


def _load_unsplit(model: TensorParallel, state_dict: dict, prefix: str, *_args) -> None:
    """Load-state-dict pre-hook: entries with the unsplit model's names become each device's slice, under its
    shard's name (both forms may be mixed; shard names load as they are)."""
    adopt_late_modules("inprocess", model)  # a parent loading PEFT adapters it added since splitting: their splits first
    zero = getattr(model, "zero_splits", None) or {}
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "module_shards.")]:
        name = key[len(prefix):]
        if name not in model.splits:
            continue
        value = state_dict.pop(key)
        split = zero.get(name, model.splits[name])
        for rank in range(len(model.module_shards)):
            state_dict[f"{prefix}module_shards.{rank}.{name}"] = value if split is None else split[1].take(value, split[0], rank)


def _tensor_bytes(module: nn.Module) -> int:
    """Parameters and buffers, plus the quantization state (absmax, scales) of quantized weights."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total + sum(quant.module_bytes(m) for m in module.modules())


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
