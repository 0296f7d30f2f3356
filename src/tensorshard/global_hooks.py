"""Every process-wide hook and patch tensorshard installs, held in one place: none at import, each one while a
split model that needs it lives.

Importing tensorshard changes nothing outside it. A few features must see what happens outside any split
model's own methods (a torch.optim step, PEFT registering its layers on a split model), and torch offers only
process-wide hooks for that. Each such hook is a `GlobalHook`, defined (not installed) where it is used:

    STEP_HOOKS = GlobalHook("torch.optim step pre/post hooks", install_step_hooks)
    STEP_HOOKS.hold(model)       # installs it, if no live model holds it yet
    del model; gc.collect()      # the last holder gone: removed again (a weakref finalizer)

`install` returns the handles (anything with ``remove()``: torch's RemovableHandle, or `Patch` for a function
of another library replaced in place); they are removed, last installed first, when the last holder is
collected, at a safe point: the finalizer runs wherever the garbage collector does, which may be inside torch
while it loops over the very dict of hooks being removed (a hook allocating inside `Optimizer.step`'s loop over
its global pre-hooks, say: "OrderedDict mutated during iteration"). So while any thread is inside torch's own
code, the removal waits (`_sweep`): for the end of a later garbage collection outside torch (a gc callback,
armed only while a removal waits), or for the next `hold` or `installed()`, whichever comes first. A hook held
again before then simply stays installed. A hook that split models need from the moment they are made says which (``needed_by=``, a test
on the model); the engines call `split_model_made(model)` on every model they make, which holds those. `installed()` lists
what is installed now (docs/inprocess.md, "What tensorshard installs in the process", lists every hook).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from typing import Any, Callable, Protocol

import torch

from .logs import get_logger

logger = get_logger(__name__)


class Handle(Protocol):
    def remove(self) -> None: ...


class Patch:
    """`owner.name` replaced by `replacement` until `remove()`, which puts the original back (unless someone
    replaced it again since: then theirs stays, and ours is left inside it)."""

    def __init__(self, owner: Any, name: str, replacement: Callable) -> None:
        self.owner, self.name, self.replacement = owner, name, replacement
        self.original = getattr(owner, name)
        setattr(owner, name, replacement)

    def remove(self) -> None:
        if getattr(self.owner, self.name, None) is self.replacement:
            setattr(self.owner, self.name, self.original)


_lock = threading.RLock()  # finalizers run wherever the garbage collector runs
_defined: list["GlobalHook"] = []
_waiting: list["GlobalHook"] = []  # hooks whose last holder is gone, to remove at the next safe point
_TORCH = os.path.dirname(torch.__file__) + os.sep


class GlobalHook:
    """One process-wide hook (or a few installed together), installed while at least one holder lives."""

    def __init__(self, what: str, install: Callable[[], list[Handle]], *,
                 needed_by: Callable[[Any], bool] | None = None) -> None:
        self.what = what  # for `installed()` and the logs
        self.needed_by = needed_by  # which split models hold it from the moment they are made (None: held elsewhere)
        self._install = install
        self._handles: list[Handle] | None = None
        self._holders: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._count = 0  # live holders (the finalizers count down; a WeakSet may drop an entry before they run)
        _defined.append(self)

    @property
    def installed(self) -> bool:
        return self._handles is not None

    def hold(self, owner: Any) -> None:
        """Keep this hook installed while `owner` lives (installing it now if nothing holds it yet, or keeping it
        if its removal still waits for a safe point)."""
        with _lock:
            if owner in self._holders:
                return
            if self._handles is None:
                self._handles = list(self._install())
                logger.debug("installed %s", self.what)
            self._holders.add(owner)
            self._count += 1
            weakref.finalize(owner, self._release)
        _sweep()

    def handles(self) -> list[Handle] | None:
        """What `install` returned, while installed; None otherwise."""
        return self._handles

    def holders(self) -> list[Any]:
        """The live objects holding this hook."""
        return list(self._holders)

    def _release(self) -> None:
        """A holder's finalizer: the last one gone, the hook is removed at the next safe point (`_sweep`)."""
        with _lock:
            self._count -= 1
            if self._count > 0 or self._handles is None:
                return
            if self not in _waiting:
                _waiting.append(self)
        _sweep()

    def _remove(self) -> None:
        handles, self._handles = self._handles, None
        for handle in reversed(handles or []):
            handle.remove()
        logger.debug("removed %s (no split model holds it any more)", self.what)


def _inside_torch() -> bool:
    """Some thread is running torch's Python code now (it may be looping over one of torch's hook dicts)."""
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_filename.startswith(_TORCH):
                return True
            frame = frame.f_back
    return False


def _sweep(*_gc_phase_and_info: Any) -> None:
    """Remove the hooks whose last holder is gone, unless a thread is inside torch: then wait for the end of a later
    garbage collection (this function as a gc callback, armed only while something waits) or the next `hold` /
    `installed()`."""
    with _lock:
        if _gc_phase_and_info and _gc_phase_and_info[0] != "stop":
            return
        if not _waiting or _inside_torch():
            _arm(bool(_waiting))
            return
        due = [hook for hook in _waiting if hook._count == 0 and hook._handles is not None]
        _waiting.clear()
        _arm(False)
        for hook in due:
            hook._remove()


def _arm(waiting: bool) -> None:
    if waiting and _sweep not in gc.callbacks:
        gc.callbacks.append(_sweep)
    elif not waiting and _sweep in gc.callbacks:
        gc.callbacks.remove(_sweep)


def split_model_made(model: Any) -> None:
    """An engine has made `model`: hold every hook a split model needs while it lives."""
    for hook in list(_defined):
        if hook.needed_by is not None and hook.needed_by(model):
            hook.hold(model)


def installed() -> list[str]:
    """What tensorshard has installed in the process now (empty after import, and again once every split model
    holding a hook is gone; a removal still waiting for a safe point is made first, if this is one)."""
    _sweep()
    return [hook.what for hook in _defined if hook.installed]
