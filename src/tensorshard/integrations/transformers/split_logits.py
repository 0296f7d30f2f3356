"""In one process, a causal LM's logits stay split by vocabulary through its forward: its loss is computed from
the slices, and the logits are made once, at the end of the call.

    split = tp.tensor_parallel(AutoModelForCausalLM.from_pretrained(...), ["cpu"] * 2)
    out = split(input_ids=ids, labels=ids)     # out.loss from each device's vocabulary slice of the logits
    out.logits                                 # (batch, seq, vocab): the same values as before

The default plans split the output head by vocabulary and gather its logits (`ColwiseParallel(gather_output=
True)`): every device then built its own copy of the whole (batch x seq x vocab) logits, computed the model's
loss over all of them (the log-softmax over the vocabulary, forward and backward, once per device), and all
copies but one were thrown away at the end of the call. On CPU slots, for a transformers causal LM, this
wrapper instead leaves the head's output split while the model's forward runs (`ThreadComm.leave_split`);
with ``labels=`` and transformers' own causal-LM loss, that loss is computed from the slices (the torchrun
engine's `sliced_loss_function`: two all-reduces of per-token numbers, no communication in backward); once
the forward has returned, the logits are assembled into one tensor that every device writes its slice of, at
the same time (`ThreadComm.assemble`). Backward through the logits hands each device its slice's gradient.

Only where it is provably the same computation: the model must apply nothing but elementwise operations to
its logits after the head (elementwise_logits.py; `causal_lm_loss.sliced_head` picks the model) and return
them straight to the engine (the split model itself, or the model inside a PeftModel: no code of a module
around it runs once per device on the one shared tensor); a loss the user or the model class replaced keeps
the gathered logits; GPUs keep their gather (the output is moved to `output_device`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ...comm.threads import ThreadComm
from ...logs import get_logger
from ...model_kind import ModelKind
from ...styles.style import original_forward, wrap_forward
from ..causal_lm_loss import call_labels, plain_causal_lm_loss, sliced_head, sliced_loss_function
from ..peft.recognised import PEFT

logger = get_logger(__name__)


def assemble_logits_once(split: nn.Module, kind: ModelKind) -> None:
    """Wrap the causal LM's forward in every shard of the in-process model `split`, whose unsplit model was of `kind`
    (see module doc)."""
    shards = list(getattr(split, "module_shards", ()))
    group = getattr(split, "_group", None)
    if len(shards) < 2 or group is None or not group.own_graphs or any(d.type != "cpu" for d in group.devices):
        return
    try:
        styles = {n: a.style for n, a in split.plan.assign(shards[0]).items()}
    except ValueError:
        return
    found = sliced_head(shards[0], styles, split.splits)
    if found is None:
        return
    lm, head, part = found
    if not _returns_to_the_engine(shards[0], lm, kind):
        logger.debug("%s keeps its gathered logits: code around it would share one logits tensor", type(lm).__name__)
        return
    lm_name = next(n for n, m in shards[0].named_modules() if m is lm)
    for rank, shard in enumerate(shards):
        wrap_forward(shard.get_submodule(lm_name), _forward(shard.get_submodule(lm_name), head, part, ThreadComm(group, rank)))
    logger.debug("%s: logits stay split by vocabulary (%s) until the end of the call", type(lm).__name__, head)


def _returns_to_the_engine(shard: nn.Module, lm: nn.Module, kind: ModelKind) -> bool:
    """`lm`'s output goes straight back to the engine: it is the shard itself, or the model a PeftModel passes
    through. Every device's model returns a view of ONE logits tensor; code of a module around it (a multimodal
    model around its language model, a user's wrapper) runs once per device, and an in-place change there would
    be applied once per device to that one tensor."""
    return lm is shard or (kind.name == PEFT and lm is shard.get_base_model())


def _forward(lm: nn.Module, head: str, part, comm: ThreadComm):
    inner = lm.forward
    signature = inspect.signature(original_forward(lm))
    local_vocab = part.local_size(comm.rank)
    loss_function = sliced_loss_function(lm, head, part, comm.rank, comm)

    def forward(*args, **kwargs):
        labels = call_labels(signature, args, kwargs)
        if labels is not None and not plain_causal_lm_loss(lm):
            return inner(*args, **kwargs)  # a loss of its own reads the gathered logits
        if labels is not None:
            lm._loss_function = loss_function  # read by PreTrainedModel.loss_function for this call
        try:
            with comm.leave_split(head):
                out = inner(*args, **kwargs)
        finally:
            lm.__dict__.pop("_loss_function", None)
        if isinstance(out, tuple):  # return_dict=False: ([loss,] logits, past_key_values, ...)
            at = 1 if labels is not None else 0
            return (*out[:at], _whole(out[at], comm, head, part, local_vocab), *out[at + 1:]) if len(out) > at else out
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
