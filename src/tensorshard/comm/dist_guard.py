"""Bounded waits for the torchrun engine's collectives, and errors that name the rank and the operation.

Every collective tensorshard runs on a process group goes through that group's `GroupGuard`:

- **Bounded.** The guard sets the group's own timeout (torch's process-group timeout: gloo applies it to
  each operation, NCCL's watchdog to each collective) to tensorshard's limit: `parallelize(...,
  timeout=S)`, else TENSORSHARD_TIMEOUT, else 300 s (comm/timeout.py). A gloo operation that times out
  fails by itself, so nothing stays pending and the process can exit. Shared-memory collectives
  (comm/shm.py) take the same limit and fail with "timed out" past it.
- **Failures travel.** A rank whose forward raises writes a report to the group's store (the rendezvous
  key-value store torch already has). On CPU a rank waiting at a collective wakes every 50-500 ms to read
  the reports, so the others stop within a second with `CollectiveAborted` naming the failed rank, even
  when that rank's process stays alive.
- **Errors say who and what.** gloo's "Connection closed by peer" becomes "rank 1 is gone: its process
  4242 ended": each rank writes its host and process id to the store once, and after a lost connection
  the peers on this host are checked. A timeout names the ranks that did not arrive: a rank that waits
  longer than a second writes the number of the collective it waits at.

Reports and the collective count. Ranks run the same code, so they enter the guard's collectives in the
same order and agree on their numbers (#1, #2, ... per group and process). A report says "rank r failed
after its collective #n". A rank waiting at collective #m > n stops: rank r will never bring #m. A
rank that itself failed after #n (the same bad input raised everywhere, say InputMismatchError) ignores
the report: the ranks failed together and stayed in step. After any other failure the group is out of
step for good (some ranks left a collective unfinished): end the job. A rank the guard stopped remembers it
(`stopped`).

A report also marks the group's native collectives failed (comm/native/: those of compiled graphs, which read
no report), so that a rank waiting in one stops at once. comm/recovery.py restores them at the next compiled
decode call or parallelize once every rank shows it went through the failure with the others, and says "out
of step" at once otherwise.

On GPUs (NCCL) a collective is only queued; waiting for it here would stall the CPU, so the guard does not
poll: NCCL's watchdog ends a stuck collective after the timeout and reports it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..logs import get_logger
from .rendezvous import CollectiveAborted
from .native import ops as native_ops
from .shm import CollectivesDiffer, process_alive
from .timeout import resolve_timeout

logger = get_logger(__name__)

POLL_FIRST, POLL_MAX = 0.05, 0.5  # seconds between looks at the store while a collective waits
ANNOUNCE_AFTER = 1.0  # a rank waiting this long (or a quarter of the limit) writes where it waits
GONE_WAIT = 2.0  # after a lost connection, how long to look for the peer's report or its ended process
SLACK = 2.0  # our own deadline, after the process group's (which normally fires first)
PREFIX = "tensorshard/"

_guards: dict[str, "GroupGuard"] = {}


def guard_for(group, timeout: float | None = None) -> "GroupGuard":
    """The guard of `group`, created on first use; `timeout` (seconds) replaces its limit when given."""
    name = group.group_name
    guard = _guards.get(name)
    if guard is None or guard.group is not group:  # first use, or a new group after destroy_process_group
        guard = _guards[name] = GroupGuard(group, resolve_timeout(timeout))
    elif timeout is not None:
        guard.set_timeout(timeout)
    return guard


def guard_named(name: str) -> "GroupGuard":
    """The guard of the group called `name` (its `group_name`): how code that torch.compile traces, which can
    hold a group's name but not the group, finds it (comm/dist_ops.py)."""
    guard = _guards.get(name)
    if guard is None:
        raise RuntimeError(f"no tensor-parallel group named {name!r} in this process: parallelize() sets one up")
    return guard


def collective(fn: Callable, tensor: torch.Tensor, *args: Any, group, what: str, **kwargs: Any) -> None:
    """`fn(*args, group=group, **kwargs)` (a torch.distributed collective on `tensor`), guarded."""
    guard_for(group).run(what, tensor.device, lambda async_op: fn(*args, group=group, async_op=async_op, **kwargs))


def mark_reported(error: BaseException) -> BaseException:
    """Flag `error` as known to the other ranks (the guard raised it, or reported it)."""
    try:
        error._tensorshard_reported = True  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an exception type that takes no attributes: reported twice at worst
        pass
    return error


class GroupGuard:
    """Collective count, failure reports and the time limit of one process group, in this process."""

    def __init__(self, group, timeout: float) -> None:
        self.group = group
        self.ranks: list[int] = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank()
        self.entered = 0  # guarded collectives this rank has entered on the group
        self.completed = 0  # ... and finished (one less while it waits in one)
        self.failed_after: set[int] = set()  # collective counts after which this rank failed
        self.reports: list[dict] = []  # every rank's reports read so far
        self.store = _group_store(group)
        self.timeout = timeout
        self.set_timeout(timeout)
        self.shm = None  # the group's shared-memory transport (comm/transport.py), when it has one
        self.native: int | None = None  # its native collectives' group, for compiled graphs (transport.connect_native)
        self.native_asked = False  # connect_native ran (every rank agreed on `native`)
        self.seconds = 0.0  # time this rank spent inside the group's guarded collectives (waiting included)
        self.stopped: str | None = None  # why the guard stopped this rank while it waited for others: out of step
        self.recoveries = 0  # times the ranks restored the group's native collectives (comm/recovery.py)
        self.segment = 0  # ... points where they may have (every report names the segment it was made in)
        self.put(f"pid/{self.rank}", _process_id())

    @property
    def label(self) -> str:
        return f"tensor-parallel group {self.ranks}"

    def set_timeout(self, timeout: float) -> None:
        """Bound every collective on the group (ours and anyone's) by `timeout` seconds."""
        self.timeout = resolve_timeout(timeout)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.timeout), self.group)  # private; torch >= 2.3
        logger.debug("collectives of %s time out after %g s", self.label, self.timeout)

    # -- running a collective ----------------------------------------------------------------------------

    def run(self, what: str, device: torch.device, start: Callable[[bool], Any]) -> None:
        """Run one collective: `start(async_op)` issues it. Raises CollectiveAborted or TimeoutError naming
        this rank, `what` and the rank(s) at fault instead of waiting without end."""
        self.entered += 1
        n = self.entered
        began = time.monotonic()
        try:
            if device.type != "cpu":
                start(False)  # NCCL: queued on the stream; its watchdog enforces the timeout
            else:
                self._wait(start(True), n, what, began)
        except RuntimeError as e:
            if getattr(e, "_tensorshard_reported", False):
                raise
            raise self._broken(e, n, what, began) from e  # gloo fails at once on a connection known closed
        finally:
            self.seconds += time.monotonic() - began
        self.completed = n

    def local_pids(self) -> list[int] | None:
        """Every rank's process id, in group order, when all ranks run on this host (same pid namespace);
        else None. Waits up to the time limit for the ranks' entries (each guard writes its own when created):
        the point where every rank has reached parallelize."""
        if self.store is None:
            return None
        keys = {PREFIX + f"pid/{r}": r for r in self.ranks}
        self.wait_keys(keys, "parallelize")
        try:
            entries = [self.store.get(k).decode() for k in keys]
        except Exception as e:  # noqa: BLE001 - no store to agree through: not shared memory
            logger.debug("%s: no process ids in the store (%s)", self.label, e)
            return None
        here = _process_id().rsplit(" ", 1)[0]
        hosts = [e.rsplit(" ", 1) for e in entries]
        return [int(pid) for _, pid in hosts] if all(host == here for host, _ in hosts) else None

    def wait_keys(self, keys: dict[str, int], what: str) -> None:
        """Wait until the store holds every one of `keys` ({store key: the rank that writes it}), at most the
        time limit; meanwhile stop at once if another rank reports a failure. Past the limit: a TimeoutError
        naming the ranks whose keys are missing (torch's own store wait would say only "wait timeout")."""
        began = time.monotonic()
        interval, n = POLL_FIRST, self.entered + 1
        while True:
            try:
                if self.store.check(list(keys)):
                    return
            except Exception as e:  # noqa: BLE001 - the store itself failed: say so, with what was waited for
                raise RuntimeError(f"{what} on rank {self.rank} of {self.label}: the group's store failed ({e}) "
                                   "while the ranks met; end the job and start it again") from e
            self._stop_if_another_failed(n, what)
            if time.monotonic() - began > self.timeout:
                break
            time.sleep(interval)
            interval = min(2 * interval, POLL_MAX)
        missing = sorted({r for k, r in keys.items() if not self.store.check([k])})
        self._record(n - 1, f"gave up at {what} after {self.timeout:g} s: rank(s) {missing} did not arrive")
        raise self.stop(TimeoutError(
            f"{what} on rank {self.rank} of {self.label}: rank(s) {missing} did not reach it within {self.timeout:g} "
            "s of this rank. Every rank of the group must call it for the same model, at about the same time. If "
            "some ranks legitimately take longer to get there (loading weights, a slow file system), raise the "
            f"limit: parallelize(..., timeout=S) or TENSORSHARD_TIMEOUT=S. {_AFTERWARDS}"
        ))

    def _wait(self, work, n: int, what: str, began: float) -> None:
        interval, announced = POLL_FIRST, False
        deadline = began + self.timeout + SLACK
        announce = began + min(ANNOUNCE_AFTER, self.timeout / 4)
        while True:
            try:
                if work.wait(timedelta(seconds=interval)):
                    return
            except RuntimeError:
                pass  # the slice ran out ("Operation timed out!"), or the collective failed: asked below
            if work.is_completed():  # failed, or finished just after the slice ran out
                try:
                    work.wait()
                    return
                except RuntimeError as failure:
                    raise self._broken(failure, n, what, began) from failure
            if not announced and time.monotonic() > announce:  # for a timeout's roll call of who is here
                self.put(f"doing/{self.rank}", f"{n} {what}")  # before at/: a rank seen at #n has its label
                self.put(f"at/{self.rank}", str(n))
                announced = True
            self._stop_if_another_failed(n, what)
            if time.monotonic() > deadline:
                raise self._timed_out(n, what, began)
            interval = min(2 * interval, POLL_MAX)

    # -- failures ----------------------------------------------------------------------------------------

    def report(self, error: BaseException, where: str) -> None:
        """`error` was raised on this rank in `where` (a forward, parallelize): tell the other ranks, and
        note on the error where it happened. Errors the guard raised itself are already reported."""
        if getattr(error, "_tensorshard_reported", False):
            return
        mark_reported(error)
        if self.native is not None:  # ranks waiting in a native collective stop at once
            native_ops.abort(self.native, self.ranks.index(self.rank), f"rank {self.rank} raised {_short(error)}")
        done = self.completed  # an error while waiting at a collective (Ctrl-C) did not finish it
        text = _short(error)
        self._record(done, f"raised {text} in {where}, after its collective #{done}")
        if hasattr(error, "add_note"):
            error.add_note(
                f"raised on rank {self.rank} of {self.label} in {where}, after its collective #{done} (reported to "
                "the group: a rank waiting for this one at a collective stops)"
            )

    def stop(self, error: BaseException) -> BaseException:
        """`error` stops this rank while it waits for others (a peer failed, is gone, late or elsewhere): the ranks
        left the group out of step, which this rank remembers, and its native collectives are marked failed (the
        next compiled decode call says so at once: comm/recovery.py)."""
        self.stopped = self.stopped or _short(error)
        if self.native is not None:
            native_ops.abort(self.native, self.ranks.index(self.rank), f"rank {self.rank} stopped: {self.stopped}")
        return mark_reported(error)

    def failed_in(self, segment: int) -> bool:
        """Another rank reported a failure in `segment` or later (comm/recovery.py)."""
        self._read_reports()
        return any(r["rank"] != self.rank and r.get("segment", 0) >= segment for r in self.reports)

    def unshared_failure(self) -> dict | None:
        """The first report of another rank's failure that this rank did not go through (the ranks are then out of
        step), or None."""
        return self._first_failure(self.entered + 1)

    def _record(self, done: int, what: str) -> None:
        self.failed_after.add(done)
        index = self.add("failures", 1)
        if index is not None:
            self.put(f"failure/{index}", json.dumps({"rank": self.rank, "done": done, "what": what,
                                                     "segment": self.segment}))

    def _read_reports(self) -> None:
        count = int(self.get("failures") or 0)  # get, not add(0): a FileStore appends on every add
        while len(self.reports) < count:
            raw = self.get(f"failure/{len(self.reports) + 1}")
            if raw is None:
                return  # being written: the next look finds it
            self.reports.append(json.loads(raw))

    def _first_failure(self, n: int) -> dict | None:
        """The first report of another rank that failed before collective #n, where this rank did not."""
        self._read_reports()
        return next(
            (r for r in self.reports if r["rank"] != self.rank and r["done"] < n and r["done"] not in self.failed_after),
            None,
        )

    def _stop_if_another_failed(self, n: int, what: str) -> None:
        first = self._first_failure(n)
        if (differ := self._gave_up_elsewhere(first, n, what)) is not None:
            raise differ
        if first is not None:
            self.failed_after.add(n - 1)
            raise self.stop(CollectiveAborted(
                f"{what} on rank {self.rank} (collective #{n} of {self.label}): rank {first['rank']} {first['what']}. "
                f"This rank stops too. {_AFTERWARDS}"
            ))

    def _broken(self, error: RuntimeError, n: int, what: str, began: float) -> BaseException:
        """The collective failed inside the backend: a timeout, a connection to a peer that closed, or (shared
        memory) peers found at another collective."""
        if isinstance(error, CollectivesDiffer):
            labels = {self.ranks[r]: label for r, label in error.elsewhere.items()}
            return self._differ(n, what, labels, "so none can finish (seen at once through shared memory)")
        if "timed out" in str(error).lower() or "timeout" in str(error).lower():
            return self._timed_out(n, what, began)
        first, gone = self._why_lost(n)
        if (differ := self._gave_up_elsewhere(first, n, what)) is not None:  # and ended before our own limit
            return differ
        if first is not None:
            cause = f"rank {first['rank']} {first['what']}"
        elif gone:
            cause = "; ".join(f"rank {r} is gone: its process {pid} ended (killed, crashed or exited)" for r, pid in gone.items())
        else:
            peers = [r for r in self.ranks if r != self.rank]
            who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {peers}"
            cause = f"the connection to {who} closed (its process ended, or it destroyed its process group)"
        self._record(n - 1, f"lost a peer at {what} (its collective #{n}): {cause}")
        return self.stop(CollectiveAborted(
            f"{what} on rank {self.rank} (collective #{n} of {self.label}): {cause}. This rank stops too. "
            f"{_AFTERWARDS}"
        ))

    def _timed_out(self, n: int, what: str, began: float) -> BaseException:
        waited = time.monotonic() - began
        missing = [r for r in self.ranks if r != self.rank and self.get(f"at/{r}") != str(n)]
        if not missing and (elsewhere := self._elsewhere(n, what)):
            return self._differ(n, what, elsewhere, f"so none finished within {self.timeout:g} s")
        self._record(n - 1, f"gave up at {what} (its collective #{n}) after {waited:.3g} s: rank(s) {missing} did not arrive")
        if missing:
            cause = f"rank(s) {missing} did not arrive within {self.timeout:g} s"
        else:
            cause = f"every rank arrived, but the collective did not finish within {self.timeout:g} s"
        return self.stop(TimeoutError(
            f"{what} on rank {self.rank} (collective #{n} of {self.label}): {cause}. A rank is stuck (in the "
            "model's own code, a data loader, a slow file system) or the ranks ran different code. If a step "
            "legitimately takes longer, raise the limit: parallelize(..., timeout=S) or TENSORSHARD_TIMEOUT=S. "
            + _AFTERWARDS
        ))

    def _gave_up_elsewhere(self, first: dict | None, n: int, what: str) -> BaseException | None:
        """The error of a peer (`first`, its report) that gave up at its collective #n, another one than ours:
        the same one for this rank, not "lost a peer"; None otherwise."""
        if first is None or first["done"] != n - 1:
            return None
        elsewhere = self._elsewhere(n, what)
        return self._differ(n, what, elsewhere, f"so none finished within {self.timeout:g} s") if elsewhere else None

    def _differ(self, n: int, what: str, elsewhere: dict[int, str], why: str) -> BaseException:
        """Every rank is at its collective #n, but not the same one: they ran different code (e.g. one rank read
        out.logits, a collective, and another went on to its next step). Waiting cannot help."""
        at = ", ".join(f"rank {r} at {w}" for r, w in elsewhere.items())
        self._record(n - 1, f"found the ranks at different collectives at {what} (its collective #{n}): {at}")
        return self.stop(TimeoutError(
            f"{what} on rank {self.rank} (collective #{n} of {self.label}): the ranks are at different "
            f"collectives ({at}), {why}. Every rank must run the same collectives in the same order: run the same "
            f"code on every rank of the group. {_AFTERWARDS}"
        ))

    def _elsewhere(self, n: int, what: str) -> dict[int, str]:
        """{rank: its label} of the ranks waiting at their collective #n with another label than `what`."""
        out = {}
        for r in self.ranks:
            entry = self.get(f"doing/{r}") if r != self.rank else None
            count, _, label = (entry or "").partition(" ")
            if count == str(n) and label != what:
                out[r] = label
        return out

    def _why_lost(self, n: int) -> tuple[dict | None, dict[int, int]]:
        """After a lost connection: the first report of a peer that failed before collective #n, or else
        {rank: pid} of the peers on this host whose process has ended. Both are looked for up to GONE_WAIT s:
        the connection closes while the peer is still exiting, and a peer whose own backend timed out closes
        it a moment before writing its report."""
        peers = {}
        for r in self.ranks:
            entry = self.get(f"pid/{r}") if r != self.rank else None
            if entry is not None:
                host, pid = entry.rsplit(" ", 1)
                if host == _process_id().rsplit(" ", 1)[0]:
                    peers[r] = int(pid)
        deadline = time.monotonic() + GONE_WAIT
        while True:
            if (first := self._first_failure(n)) is not None:
                return first, {}
            gone = {r: pid for r, pid in peers.items() if not process_alive(pid)}
            if gone or time.monotonic() > deadline:
                return None, gone
            time.sleep(0.05)

    # -- the store (any failure disables it: the store may have lived in the process that died) ----------
    # Keys are under PREFIX; comm/recovery.py meets the ranks through these too.

    def put(self, key: str, value: str) -> None:
        self._store_op(lambda s: s.set(PREFIX + key, value))

    def get(self, key: str) -> str | None:
        def read(s):
            return s.get(PREFIX + key).decode() if s.check([PREFIX + key]) else None

        return self._store_op(read)

    def add(self, key: str, amount: int) -> int | None:
        return self._store_op(lambda s: s.add(PREFIX + key, amount))

    def _store_op(self, op: Callable) -> Any:
        if self.store is None:
            return None
        try:
            return op(self.store)
        except Exception as e:  # noqa: BLE001 - best effort: errors still name the operation without it
            logger.debug("the store of %s is unusable (%s); failure reports are off", self.label, e)
            self.store = None
            return None


_AFTERWARDS = (
    "A process group cannot be used after one of its ranks failed: end the job (torchrun restarts it with "
    "--max-restarts). docs/errors.md lists the failures and their messages."
)


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _group_store(group):
    getter = getattr(dist.distributed_c10d, "_get_process_group_store", None)
    try:
        return getter(group) if getter is not None else None
    except Exception:  # noqa: BLE001
        return None


def _process_id() -> str:
    """'host pid-namespace pid': a pid means the same process only on the same host and namespace."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}:{namespace} {os.getpid()}"
