"""Restoring a torchrun group's native collectives after a failure that its ranks went through together.

    restore(guard)    # on every rank: at the start of every compiled decode call (transport.connect_native),
                      # and in parallelize (a new split model of the group)

A failure reported on any rank marks the group's native region failed (comm/dist_guard.py, `GroupGuard.report`:
a rank waiting in a native collective stops at once), and the mark stays in the shared segment. Whether the ranks
may go on is the guard's rule: ranks that failed together (each after the same guarded collective: the same bad
input raised everywhere) stayed in step; after a rank failed alone, the others stopped waiting for it (or stop at
their next collective), and the group is out of step for good.

`restore` reads the mark (a word of the shared segment: all it costs a call while the group is well) and, when it
is set, meets the other ranks through the group's store. Only for failures in the part of the run this rank has been
through: the points where `restore` runs cut each rank's run into segments, numbered alike on every rank, and a
failure report names its segment. A mark set in the segment this rank is about to start (a faster rank failed there
first) waits for the next point: this rank goes through that segment first, and fails there too (its own error, or
its first native collective, which sees the mark). Then:

1. Each rank writes where it stands: the guarded collectives it entered and finished, and why it is out of step
   when it knows: the guard stopped it, or a peer's report names a failure this rank did not go through.
2. The ranks are in step when every one finished as many collectives as every other, none is inside one and none
   knows itself out of step. Every rank decides from the same entries, so all take the same branch; an entry that
   shows the ranks out of step ends the wait at once (a rank writes its own before it raises).
3. In step: each rank restarts its own round counts, rank 0 also clears the shared words and the mark (no rank is
   inside a native collective: all are here), and after a second meeting the group serves collectives again under
   the same handle (compiled graphs that name it stay valid). Out of step: `GroupOutOfStep` on every rank, saying
   which rank did what: end the job.

Both meetings wait at most the guard's limit, naming the ranks that did not come, and stop at once when one of
those ranks' processes has ended. A rank that read no mark and went on into the compiled step while another found
one is not left waiting there: the mark stays until every rank has met (only the reset clears it), and a rank
waiting in a native collective stops as soon as the mark is set.
"""

from __future__ import annotations

import json
import time

from ..logs import get_logger
from .dist_guard import POLL_FIRST, POLL_MAX, GroupGuard
from .native import ops as native_ops
from .rendezvous import CollectiveAborted
from .shm import process_alive

logger = get_logger(__name__)

WHAT = "the check of the native collectives after a failure"  # (at a compiled decode call, or parallelize)


class GroupOutOfStep(CollectiveAborted):
    """A failure left the ranks of a tensor-parallel group out of step (one failed alone, the others stopped
    waiting for it): no collective of the group can run again in this job."""


def restore(guard: GroupGuard) -> None:
    """`guard`'s native group (connected) ready for collectives: at once while it is not marked failed; else restored
    on every rank, the ranks in step; else GroupOutOfStep on every rank. Collective: every rank calls it at the same
    point."""
    guard.segment += 1  # (this rank has gone through every segment before this one)
    if guard.native is None or native_ops.broken(guard.shm) == 0:
        return
    if guard.failed_in(guard.segment):
        # A faster rank failed in the segment this rank is about to run (say, every rank raises in this decode call
        # and it raised first): this rank goes through that segment too (its own error, or its first native
        # collective raises at once, the mark being set), and the ranks meet at the next point.
        return
    call = guard.add(f"recover/calls/{guard.rank}", 1)  # equal on every rank: they restore in the same order
    if call is None:
        raise guard.stop(_out_of_step(guard, "the group's store is gone, so the ranks cannot tell"))
    key = f"recover/{call}/"
    mine = {"entered": guard.entered, "completed": guard.completed, "out": _why_out(guard)}
    _meet(guard, key, mine)
    native_ops.reset(guard.native)  # (every rank is here, outside the group's collectives)
    _meet(guard, f"{key}reset/", mine)  # no rank starts a round before every rank has reset
    guard.recoveries += 1
    logger.info("%s: the native collectives serve the group again (the ranks went through the failure together "
                "and are in step, each after its collective #%d)", guard.label, guard.completed)


def _why_out(guard: GroupGuard) -> str:
    """Why this rank knows the group is out of step ('' when it does not)."""
    if guard.stopped:
        return f"was stopped while it waited for another rank ({guard.stopped})"
    first = guard.unshared_failure()
    if first is not None:
        return f"went on where rank {first['rank']} failed alone (rank {first['rank']} {first['what']})"
    return ""


def _meet(guard: GroupGuard, key: str, mine: dict) -> None:
    """Write this rank's entry; return once every rank's is there and they are in step. Raises GroupOutOfStep as soon
    as the entries present show the ranks out of step, TimeoutError past the limit, CollectiveAborted when a rank
    that has not come has ended."""
    guard.put(f"{key}{guard.rank}", json.dumps(mine))
    began, interval = time.monotonic(), POLL_FIRST
    pids = dict(zip(guard.ranks, guard.shm.pids))
    while True:
        entries = {}
        for r in guard.ranks:
            raw = guard.get(f"{key}{r}")
            if raw is not None:
                entries[r] = json.loads(raw)
        if guard.store is None:
            raise guard.stop(_out_of_step(guard, "the group's store failed while the ranks met, so they cannot tell"))
        if why := _apart(entries):
            raise guard.stop(_out_of_step(guard, why))
        missing = [r for r in guard.ranks if r not in entries]
        if not missing:
            return
        if gone := [r for r in missing if not process_alive(pids[r])]:
            raise guard.stop(CollectiveAborted(
                f"{WHAT} on rank {guard.rank} of {guard.label}: "
                + "; ".join(f"rank {r} is gone: its process {pids[r]} ended" for r in gone)
                + ". End the job (torchrun --max-restarts=N restarts it)."
            ))
        if time.monotonic() - began > guard.timeout:
            raise guard.stop(TimeoutError(
                f"{WHAT} on rank {guard.rank} of {guard.label}: the native collectives failed before, and rank(s) "
                f"{missing} did not come to restore them within {guard.timeout:g} s of this rank. Every rank calls "
                "the compiled decode step again after a failure they went through together; a rank that ended or "
                "went elsewhere leaves the group unusable: end the job (torchrun --max-restarts=N restarts it)."
            ))
        time.sleep(interval)
        interval = min(2 * interval, POLL_MAX)


def _apart(entries: dict[int, dict]) -> str:
    """What shows the ranks of `entries` out of step ('' when nothing does)."""
    for r, entry in entries.items():
        if entry["out"]:
            return f"rank {r} {entry['out']}"
    stands = {r: (entry["entered"], entry["completed"]) for r, entry in entries.items()}
    if len(set(stands.values())) > 1 or any(entered != completed for entered, completed in stands.values()):
        return "the ranks stand at different collectives: " + ", ".join(
            f"rank {r} after its collective #{completed}" + (f" (inside #{entered})" if entered != completed else "")
            for r, (entered, completed) in stands.items()
        )
    return ""


def _out_of_step(guard: GroupGuard, why: str) -> GroupOutOfStep:
    return GroupOutOfStep(
        f"{WHAT} on rank {guard.rank} of {guard.label}: the ranks are out of step: {why}. A failure that some ranks "
        "went through and others did not (one rank raised alone, and the others stopped waiting for it) leaves the "
        "group's collectives unfinished on some ranks, so none can run again: end the job and start it again "
        "(torchrun --max-restarts=N restarts it, from your last checkpoint). Ranks that raise together (the same "
        "error after the same collective on every rank) stay in step and go on. docs/errors.md lists the failures."
    )
