"""In one process, a causal LM's logits are made once, from the devices' vocabulary slices, at the end of the call.

    split = tp.tensor_parallel(AutoModelForCausalLM.from_pretrained(...), ["cpu"] * 2)
    out = split(input_ids=ids)          # out.logits: (batch, seq, vocab), the same values as before

The default plans split the output head by vocabulary and gather its logits (`ColwiseParallel(gather_output=
True)`): every device then built its own copy of the whole (batch x seq x vocab) logits, and all copies but one
were thrown away at the end of the call. On CPU slots, for a transformers causal LM called without ``labels=``,
this wrapper instead leaves the head's output split while the model's forward runs (`ThreadComm.leave_split`)
and, once it has returned, assembles the logits into one tensor that every device writes its slice of, at the
same time (`ThreadComm.assemble`): the same values (the same collective count), a fraction of the copying, and
no (batch x seq x vocab) tensor per device. Backward hands each device the gradient of its slice.

Only where it is provably the same computation: the model must apply nothing but elementwise operations to
its logits between the head and its return (logits_audit.py); a call with ``labels=`` keeps the gathered
logits (the model's own loss reads them); GPUs keep their gather (the output is moved to `output_device`).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

from ...comm.threads import ThreadComm
from ...layers import is_transformers_model
from ...styles import ColwiseParallel
from ...styles.base import original_forward, wrap_forward
from ..elementwise_logits import why_not_elementwise

logger = logging.getLogger(__name__)


def assemble_logits_once(split: nn.Module) -> None:
    """Wrap the causal LM's forward in every shard of the in-process model `split` (see module doc)."""
    shards = list(getattr(split, "module_shards", ()))
    group = getattr(split, "_group", None)
    if len(shards) < 2 or group is None or not group.own_graphs or any(d.type != "cpu" for d in group.devices):
        return
    found = _head_of(split, shards[0])
    if found is None:
        return
    lm_name, head, part = found
    for rank, shard in enumerate(shards):
        lm = shard.get_submodule(lm_name)
        wrap_forward(lm, _forward(lm, head, part, ThreadComm(group, rank)))
    logger.debug("%s: logits assembled once from the vocabulary slices of %s", type(shards[0].get_submodule(lm_name)).__name__, head)


def _head_of(split: nn.Module, shard: nn.Module) -> tuple[str, str, Any] | None:
    """(the causal LM's name in the shard, its head's name, the head's vocabulary Partition), or None when the
    shard holds no causal LM whose head is a plain gathering column split over contiguous vocabulary slices."""
    try:
        styles = {n: a.style for n, a in split.plan.assign(shard).items()}
    except (ValueError, AttributeError):
        return None
    names = {id(m): n for n, m in shard.named_modules()}
    for lm in shard.modules():  # outermost first: a multimodal model before the language model inside it
        if not (is_transformers_model(lm) and hasattr(type(lm), "loss_function")):
            continue
        head = names.get(id(lm.get_output_embeddings()))
        style = styles.get(head)
        placement = split.splits.get(f"{head}.weight")
        if type(style) is not ColwiseParallel or not style.gather_output or placement is None:
            return None
        part = placement[1]
        if part.overlapping or any(len(r) != 1 for r in part.ranges):
            return None
        prefix = f"{names[id(lm)]}." if names[id(lm)] else ""
        why = why_not_elementwise(lm, head.removeprefix(prefix))
        if why is None:
            return names[id(lm)], head, part
        logger.debug("%s keeps its gathered logits: %s", type(lm).__name__, why)  # an inner model may qualify
    return None


def _forward(lm: nn.Module, head: str, part, comm: ThreadComm):
    inner = lm.forward
    signature = inspect.signature(original_forward(lm))
    local_vocab = part.local_size(comm.rank)

    def forward(*args, **kwargs):
        try:
            labels = signature.bind_partial(*args, **kwargs).arguments.get("labels")
        except TypeError:
            labels = None  # the model's own forward reports the bad call
        if labels is not None:
            return inner(*args, **kwargs)
        with comm.leave_split(head):
            out = inner(*args, **kwargs)
        if isinstance(out, tuple):  # return_dict=False: (logits, past_key_values, ...) without a loss
            return (_whole(out[0], comm, head, part, local_vocab), *out[1:]) if out else out
        logits = getattr(out, "logits", None)
        if logits is not None:
            out.logits = _whole(logits, comm, head, part, local_vocab)
        return out

    return forward


def _whole(logits: Any, comm: ThreadComm, head: str, part, local_vocab: int) -> Any:
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or logits.shape[-1] != local_vocab:
        raise RuntimeError(
            f"the logits left split at {head} came back with shape {tuple(getattr(logits, 'shape', ()))}, not "
            f"(..., {local_vocab}): the model reshaped them after its head. Please report this model; as a "
            "workaround split it with a plan whose head is not gathered (gather_output=False) and gather yourself"
        )
    return comm.assemble(logits, -1, part, where=head)
