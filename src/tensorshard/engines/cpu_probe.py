"""Inductor's once-per-process question before it loads a CPU graph, asked early: which vector instruction sets
the CPU has.

    cpu_probe.start()      # a daemon thread asks it now (once per process); a no-op once asked
    cpu_probe.probe()      # or ask it here

Inductor answers it by compiling and running a small C++ program per instruction set, the first time a process
loads or compiles a CPU graph, and keeps the answer for the rest of the process. Most of that is waiting on the
compiler's processes: a profile of a torchrun rank's first fast call on SmolLM2's shape found 1.16 s of
`subprocess` waits there, all of it inside inductor's load of the rank's cached graph, after dynamo's trace. Asked
while dynamo traces (torchrun, engines/torchrun/decoding.py) or while forked children trace (one process,
engines/inprocess/forked_traces.py), the answer is there when inductor needs it. A failure is left for inductor to
meet and report itself.
"""

from __future__ import annotations

import threading

from torch._inductor.cpu_vec_isa import pick_vec_isa

from ..logs import get_logger

logger = get_logger(__name__)

_started = threading.Event()


def probe() -> None:
    """Ask inductor now (it keeps the answer: later asks are free)."""
    try:
        pick_vec_isa()
    except Exception as error:  # (inductor asks again when it needs the answer, and says what fails)
        logger.debug("probing the CPU's vector instruction sets failed: %s", error)


def start() -> None:
    """`probe` on a daemon thread of its own, the first time this is called in the process."""
    if not _started.is_set():
        _started.set()
        threading.Thread(target=probe, name="tensorshard-cpu-probe", daemon=True).start()
