"""One forward pass on a tiny input that records where split features could flow: the evidence for plans.

`trace_model(model, inputs)` runs the model once, in eval mode and without gradients, and returns a `Trace`
(evidence.py). Three ideas meet in that pass, each in its own file:

- intercepting torch functions (tracer.py): a `TorchFunctionMode` sees every torch function and tensor method,
  and moves each tensor's *shadow* (the ids of the split features it carries) by the op's rule (oprules.py);
- choosing layer roles (layer_roles.py): module hooks decide, from its input, whether each supported layer is a
  column, row, through, embedding or channel-wise candidate, and capture each module's inputs for the self-check;
- gradient sources (gradient_sources.py): which whole tensors would carry gradients, so that split features
  meeting one either sum a parameter's gradient (a `Sync`) or stay whole.

Anything that reads split features in a way a split model cannot reproduce *poisons* them (with a reason
and the module where it happened): the model's outputs, host reads, ops without a rule, a layer kept whole.
The parameters of a layer used outside its own forward (a tied head computed with ``F.linear``) pin it
whole.

Models on the meta device are traced too (for `tensorshard plan` on a 7B config): tensors that do not
depend on parameters (position ids, masks) are computed for real on the CPU, so data-dependent checks in
the model's code still work; only parameter-derived values stay on meta. Memory: activations of the tiny
input plus int64 shadows of the same size; captured module inputs (small) when `capture=True`.
"""

from __future__ import annotations

import torch
from torch import nn

from .evidence import Trace
from .inputs import synthetic_inputs
from .layer_roles import output_tensors
from .tracer import Tracer


def trace_model(
    model: nn.Module,
    inputs: tuple[tuple, dict] | None = None,
    *,
    fixed: set[str] = frozenset(),
    capture: bool = True,
    columns: set[str] | None = None,
    log: bool = False,
) -> Trace:
    """Run `model` once on `inputs` (default: `inputs.synthetic_inputs(model)`) and record the evidence.

    `fixed` names layers already decided to stay whole (or gathered): they are not candidates. `columns`,
    when given, are the only layers that may be columns (a given plan's; plan_inference/plancheck.py); `log`
    keeps which op joined which features (`FeatureSet.log`). The model
    runs in eval mode without gradients; its train/eval flags are restored afterwards and nothing else of
    it changes.
    """
    meta = any(p.is_meta for p in model.parameters())
    if inputs is None:
        inputs = synthetic_inputs(model)
    args, kwargs = inputs
    modes = {m: m.training for m in model.modules()}
    tracer = Tracer(model, set(fixed), capture=capture and not meta, meta=meta, columns=columns, log=log)
    roles = tracer.roles
    tracer.mark_inputs((args, kwargs))
    threads = torch.get_num_threads()
    try:
        model.eval()
        torch.set_num_threads(1)  # the bookkeeping is many tiny ops: threads only add overhead
        with torch.no_grad(), tracer:
            out = model(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)
        roles.remove_hooks()
        for m, flag in modes.items():
            m.training = flag
    tracer.collapses.finish()
    for t in output_tensors(out):
        s = tracer.shadow(t)
        if s is not None:
            tracer.poison(s, "reaches the model's output", kind="output")
    return Trace(
        tracer.fs, roles.layers, tracer.poisons, roles.captures, roles.call_order, (args, kwargs), tracer.syncs,
        roles.split_outputs, roles.channels, tracer.fixed_counts,
    )
