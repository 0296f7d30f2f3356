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
collected. A hook that split models need from the moment they are made says which (``needed_by=``, a test
on the model); the engines call `split_model_made(model)` on every model they make, which holds those. `installed()` lists
what is installed now (docs/inprocess.md, "What tensorshard installs in the process", lists every hook).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Protocol

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
        """Keep this hook installed while `owner` lives (installing it now if nothing holds it yet)."""
        with _lock:
            if owner in self._holders:
                return
            if self._handles is None:
                self._handles = list(self._install())
                logger.debug("installed %s", self.what)
            self._holders.add(owner)
            self._count += 1
            weakref.finalize(owner, self._release)

    def handles(self) -> list[Handle] | None:
        """What `install` returned, while installed; None otherwise."""
        return self._handles

    def holders(self) -> list[Any]:
        """The live objects holding this hook."""
        return list(self._holders)

    def _release(self) -> None:
        with _lock:
            self._count -= 1
            if self._count > 0 or self._handles is None:
                return
            handles, self._handles = self._handles, None
        for handle in reversed(handles):
            handle.remove()
        logger.debug("removed %s (no split model holds it any more)", self.what)


def split_model_made(model: Any) -> None:
    """An engine has made `model`: hold every hook a split model needs while it lives."""
    for hook in list(_defined):
        if hook.needed_by is not None and hook.needed_by(model):
            hook.hold(model)


def installed() -> list[str]:
    """What tensorshard has installed in the process now (empty after import, and again once every split model
    holding a hook is gone)."""
    return [hook.what for hook in _defined if hook.installed]
