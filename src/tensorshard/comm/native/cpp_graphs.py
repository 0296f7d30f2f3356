"""Captured FX graphs compiled by inductor outside dynamo: cached on disk, and (C++ wrapper) run without the GIL.

    from tensorshard.comm.native import cpp_graphs
    run = cpp_graphs.compile_graph(gm, example_inputs)       # inductor, cpp_wrapper=True; nothing runs
    outputs = run(*inputs)                                    # on any thread: other threads' Python runs meanwhile
    step = cpp_graphs.inductor_compile(gm, example_inputs)   # inductor's default (Python) wrapper, cached the same way
    held = cpp_graphs.Held(); held.hold(inputs)               # (or: the inputs held across calls, hold=False)

Both compile with inductor's compile cache on: called outside dynamo, inductor finds no shape environment and
skips its FX-graph and AOT-autograd caches ("Bypassing FX Graph Cache because 'No shape env'"), so every process
compiled every graph again (SmolLM2-135M's shape at 2 devices: a minute per process). A tracing context with a
fresh shape environment is what dynamo would have given it, and the inputs go in as fake tensors of static shapes
(as dynamo's would be for `dynamic=False`): given the real tensors, AOT autograd made every size a symbol, and
inductor compiled kernels for symbolic sizes.

`compile_graph`: inductor's C++-wrapper entry releases the GIL for the whole graph (`gil_scoped_release_simple` in
its generated `inductor_entry_impl`), but then frees each input after its last use; where Python owns the tensor's
only other reference, dropping that one reaches the Python object (PyObject preservation), which takes the GIL
back, and a thread running its graph waits for every other thread's Python at each such input. `run` holds one
more C++ reference to every input for the call (`native_hold`, released after it), so no input's last C++
reference drops inside the graph. Operators the graph calls must not need Python either: the native collectives
do not (dispatcher operators); a Python `custom_op` would take the GIL. The wrapper (a long function of calls:
~4000 lines for SmolLM2's shape) is built apart from the kernels, at -O1 (`cpp_wrapper_build_separate`): built with
them at -O3 it took minutes of compiler time per graph. It needs the native library (ops.available()).

Both engines can use these; the in-process engine runs one C++-wrapper graph per shard on the shards' threads
(engines/inprocess/parallel_step.py).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

PATCHES = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}  # inductor's config for GIL-free graphs


def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], config_patches: dict | None = None) -> Callable[..., Any]:
    """`gm` compiled by inductor for inputs like `example_inputs` (real tensors: static shapes), through its
    compile caches (a later process loads the result); the compiled function takes the inputs as arguments."""
    inductor = torch._dynamo.lookup_backend("inductor")
    mode = FakeTensorMode(shape_env=ShapeEnv())
    # Fake copies of the inputs with static shapes: given real tensors, AOT autograd would make each of their sizes a
    # symbol (SmolLM2's shape at 2 devices: 4.2 s for 732 inputs, and kernels compiled for a symbolic hidden size).
    fake = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with tracing(TracingContext(mode)):
        return inductor(gm, fake, config_patches=config_patches or None)


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], config_patches: dict | None = None, *,
                  hold: bool = True) -> Callable[..., Any]:
    """`gm` compiled with inductor's C++ wrapper (the caller's `config_patches` on top of `PATCHES`): a function of
    the graph's inputs that holds them while the graph runs, so that it runs without the GIL. `hold=False`: the
    compiled function itself, for a caller that holds the inputs (`Held`)."""
    compiled = inductor_compile(gm, example_inputs, {**PATCHES, **(config_patches or {})})
    if not hold:
        return compiled

    def run(*inputs: Any) -> Any:
        hold = torch.ops.tensorshard.native_hold([x for x in inputs if isinstance(x, torch.Tensor)])
        try:
            return compiled(*inputs)
        finally:
            torch.ops.tensorshard.native_release(hold)

    return run


class Held:
    """One more C++ reference to each tensor of a graph's inputs, kept from one call to the next while the inputs
    are the same tensors (a decode step's weights, and its cache within a `generate`): per call, `hold(inputs)`
    costs a comparison of identities instead of a `native_hold` / `native_release` of every input. The tensors of
    the latest call stay referenced until inputs that differ come, or `release()`."""

    def __init__(self) -> None:
        self.inputs: list = []
        self.handle: int | None = None

    def hold(self, inputs: Sequence[Any]) -> None:
        kept = self.inputs
        if len(kept) == len(inputs) and all(a is b for a, b in zip(kept, inputs)):
            return
        self.release()
        self.handle = int(torch.ops.tensorshard.native_hold([x for x in inputs if isinstance(x, torch.Tensor)]))
        self.inputs = list(inputs)

    def release(self) -> None:
        if self.handle is not None:
            torch.ops.tensorshard.native_release(self.handle)
        self.handle, self.inputs = None, []
