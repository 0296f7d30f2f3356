"""While dynamo traces a split model's decode step: the split model as dynamo traces it cheaply, graphs unchanged.

    from tensorshard.engines.cheap_tracing import cheap_tracing
    with cheap_tracing(shards):
        out = compiled_capture(**kwargs)

A process that traces (no kept captures) spends its first fast call mostly in dynamo, ~0.075 ms per bytecode it
interprets. A split model traces what the unsplit model does plus the styles' and collectives' Python; inside this
context it traces less than the unsplit model (SmolLM2's shape, warm: 70,893 -> 42,260 bytecodes per shard in one
process, 76,631 -> 43,312 per torchrun rank; the unsplit model traces 51,769):

- `class_forwards` (class_forwards.py): each split layer called through its class's forward, not nn.Module's call
  machinery (12,600), or straight through its style's shorter no-gradient forward (a column layer: its class
  forward; a row layer: the matmul and the collective's compiling branch, comm/interface.py
  `compiling_all_reduce`; under torchrun a local-views wrapper whose views are in place for the call passes to
  them); forwards wrapped by transformers (`deprecate_kwarg`, gradient checkpointing) called past the wrappers
  (~4,000); a ModuleList's whole slice taken as itself (~3,500);
- `plain_configs` (config_snapshots.py): `module.config` a snapshot whose attributes dynamo reads directly, not
  through transformers' `__getattribute__` (~9,400).

Each changes which Python runs, never what it computes: the same operators with the same arguments, so the graphs
are the same (tests/engines/test_cheap_tracing.py compares them). What changes per call is read per call.

Only for calls whose dynamo guards are never evaluated outside it: dynamo guards the classes and objects it traced,
so a frame traced inside and called outside would compile again (under torchrun's guard-skipping stance it stops).
The two users: the in-process engine's capturing calls (engines/inprocess/stitched_decode.py `_capture`: the
stitched or parallel step built from them runs no dynamo frame; the context holds the model's call lock from before
the first change to after the last restore, so no other thread's call sees the modules changing, or changed: a
column layer's no-gradient forward skips what a call with gradients needs) and the torchrun engine's compiled step on CPU ranks with the direct step
(engines/torchrun/decoding.py: every call dynamo runs is inside, later tokens call the graph directly). Everything is
put back on exit, also after an error.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterable, Iterator

from torch import nn

from .class_forwards import class_forwards
from .config_snapshots import plain_configs


@contextmanager
def cheap_tracing(roots: Iterable[nn.Module], lock: Any = None) -> Iterator[None]:
    """For the duration: the modules under `roots` as dynamo traces them cheaply (see the module doc). `lock`: held
    for the whole duration, changes and restores included (the in-process engine's re-entrant `call_lock`, which
    its call inside takes again), so that no other thread's call sees the modules while they change."""
    roots = list(roots)
    with ExitStack() as stack:
        if lock is not None:
            stack.enter_context(lock)
        stack.enter_context(plain_configs(roots))
        stack.enter_context(class_forwards(roots))
        yield
