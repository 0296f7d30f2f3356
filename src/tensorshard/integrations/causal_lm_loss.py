"""Under torchrun, a transformers causal LM called with ``labels=`` computes its loss from vocabulary slices.

    model = tp.parallelize(AutoModelForCausalLM.from_pretrained(...), mesh)   # the preset: lm_head gathers
    out = model(input_ids=ids, labels=ids)      # out.loss: from each rank's vocabulary slice of the logits
    out.loss.backward()                         # no (batch, seq, vocab) gradient anywhere
    out.logits                                  # (batch, seq, vocab), gathered: the same values as before

The default plans split the output head by vocabulary and all-gather its logits (`ColwiseParallel(
gather_output=True)`), so the model's own loss (transformers' `ForCausalLMLoss`) runs unchanged, on the whole
(batch x seq x vocab) logits, on every rank: the log-softmax over the vocabulary, forward and backward, is
repeated N times. When the model is called with labels and its loss is that plain causal-LM cross-entropy,
this wrapper instead

1. leaves the head's output split for this call (`DistComm.leave_split`): the model's forward sees
   (batch, seq, vocab / N) logits;
2. swaps in, for this call, a loss function with `ForCausalLMLoss`'s contract (labels shifted left and padded
   with `ignore_index`, or `shift_labels=`; mean over counted tokens, or sum / `num_items_in_batch`) that
   computes the cross-entropy from the slices (loss_parallel.py: two all-reduces of per-token numbers, no
   communication in backward);
3. gathers the logits for the output when they are first read (lazy_logits.py; the all-gather the head did
   before, differentiable: backward through ``out.logits`` still reaches the head), so users get the same
   `.loss` and `.logits` as from the plain model, and a training step that reads only the loss gathers nothing.
   The loss's backward does not go through the gathered logits: their (batch, seq, vocab) gradient is never made.
   Reading the logits is then a collective: on every rank, or on none.

Only where that is exact: the model's forward must treat its logits elementwise between the head and the
loss (softcapping, a scale, ``.float()``), which elementwise_logits.py proves from the forward's source; a
forward that masks, slices or gathers vocabulary entries, or one it cannot read, keeps the model's own path
(logged at debug level with the reason). So does anything else: no labels, a custom ``loss_function``, another
loss type (sequence classification, ...), a head that is not a plain gathering column split, one rank.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import is_transformers_model
from ..logs import get_logger
from ..loss_parallel import GroupReductions, sliced_cross_entropy
from .elementwise_logits import why_not_elementwise
from .lazy_logits import gather_logits_on_read
from ..partition import Partition
from ..plans.slices import after_split, split_layout
from ..styles import ColwiseParallel
from ..styles.style import original_forward, wrap_forward

logger = get_logger(__name__)


@after_split
def _install(root: nn.Module) -> None:
    """Wrap the forward of the causal LM inside `root` (root itself, or the model inside a PEFT wrapper)."""
    layout = split_layout(root)
    if layout is None or layout.engine != "torchrun" or layout.state.comm.world_size == 1:
        return
    state = layout.state
    found = sliced_head(root, {n: a.style for n, a in state.plan.assign(root).items()}, state.splits)
    if found is None:
        return
    lm, name, part = found
    wrap_forward(lm, _sliced_loss_forward(lm, name, part, state.comm))
    logger.debug("%s: labels= computes the loss from vocabulary slices of %s", type(lm).__name__, name)


def sliced_head(root: nn.Module, styles: dict, splits: dict) -> tuple[nn.Module, str, Partition] | None:
    """The transformers causal LM inside `root` whose logits may stay split by vocabulary, its head's name and
    the head's Partition; None if there is none. The head must be a gathering column split of one contiguous
    vocabulary slice per device, and the model's forward must treat its logits elementwise after the head
    (elementwise_logits.py). `styles`: module name -> its plan style; `splits`: tensor name -> placement."""
    names = {id(m): n for n, m in root.named_modules()}
    for lm in root.modules():  # outermost first: a multimodal model, then the language model inside it
        if not (is_transformers_model(lm) and hasattr(type(lm), "loss_function")):
            continue
        name = names.get(id(lm.get_output_embeddings()))
        style = styles.get(name)
        split = splits.get(f"{name}.weight")
        if type(style) is not ColwiseParallel or not style.gather_output or split is None:
            return None
        part = split[1]
        if part.overlapping or any(len(r) != 1 for r in part.ranges):
            return None  # a vocabulary that is not one contiguous slice per device: keep the gathered logits
        lm_name = names[id(lm)]
        reason = why_not_elementwise(lm, name[len(lm_name) + 1:] if lm_name else name)
        if reason is None:
            return lm, name, part
        # the forward may edit its logits by vocabulary index: a slice would be wrong. A model inside may qualify.
        logger.debug("%s keeps its own loss on gathered logits: %s", type(lm).__name__, reason)
    return None


def sliced_loss_function(lm: nn.Module, head: str, part: Partition, rank: int, reductions) -> Any:
    """A loss function with `ForCausalLMLoss`'s contract computed from device `rank`'s vocabulary slice of the
    logits; `reductions` sums (and maxes) over the devices: `GroupReductions` of a process group, or an
    in-process ThreadComm."""
    start = part.ranges[rank][0][0]
    local_vocab = part.local_size(rank)

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **_):
        if logits.shape[-1] != local_vocab:
            raise RuntimeError(
                f"{type(lm).__name__}'s loss got logits of width {logits.shape[-1]}, not {head}'s vocabulary slice "
                f"({local_vocab}); this model changes its logits after {head}. Pass the loss yourself: call the model "
                "without labels= and compute the loss from out.logits"
            )
        if shift_labels is None:  # as ForCausalLMLoss: tokens < n predict n, the last position predicts nothing
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = shift_labels.to(logits.device)
        if num_items_in_batch is None:
            return sliced_cross_entropy(logits, target, start, reductions, vocab=part.size, ignore_index=ignore_index)
        loss = sliced_cross_entropy(
            logits, target, start, reductions, vocab=part.size, ignore_index=ignore_index, reduction="sum"
        )
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch

    return loss_function


def _sliced_loss_forward(lm: nn.Module, head: str, part: Partition, comm) -> Any:
    inner = lm.forward
    signature = inspect.signature(original_forward(lm))
    local_vocab = part.local_size(comm.rank)
    loss_function = sliced_loss_function(lm, head, part, comm.rank, GroupReductions(comm.group))

    def forward(*args, **kwargs):
        if call_labels(signature, args, kwargs) is None or not plain_causal_lm_loss(lm):
            return inner(*args, **kwargs)
        comm.begin_call()
        try:
            lm._loss_function = loss_function  # read by PreTrainedModel.loss_function for this call
            with comm.leave_split(head):
                out = inner(*args, **kwargs)
            return _with_gathered_logits(out, comm, head, part, local_vocab)
        except BaseException as e:
            comm.guard.report(e, f"the forward of {type(lm).__name__}")
            raise
        finally:
            lm.__dict__.pop("_loss_function", None)  # plain_causal_lm_loss: the user had set none
            comm.end_call()

    return forward


def call_labels(signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    """The ``labels`` of a call of a forward with this signature (None when absent, or when the call does not fit
    the signature: the model's own forward then reports the bad call)."""
    try:
        return signature.bind_partial(*args, **kwargs).arguments.get("labels")
    except TypeError:
        return None


def plain_causal_lm_loss(lm: nn.Module) -> bool:
    """The model's loss is transformers' ForCausalLMLoss, not one the user or the model class replaced."""
    losses = sys.modules.get("transformers.loss.loss_utils")
    return "_loss_function" not in lm.__dict__ and lm.loss_function is getattr(losses, "ForCausalLMLoss", None)


def _with_gathered_logits(out: Any, comm, head: str, part: Partition, local_vocab: int) -> Any:
    """`out` with its vocabulary-sliced logits replaced by the whole ones (an autograd all-gather): on first read
    for a model output (lazy_logits.py), at once for a tuple (``return_dict=False``)."""
    if isinstance(out, tuple):  # (loss, logits, ...)
        return tuple(_gathered(x, comm, head, part, local_vocab) for x in out)
    logits = getattr(out, "logits", None)
    read = f"{head} for out.logits (a collective: read the logits on every rank or on none)"  # errors say it
    if _is_slice(logits, local_vocab):
        return gather_logits_on_read(out, lambda x: comm.all_gather(x, x.dim() - 1, part, where=read))
    return out


def _is_slice(x: Any, local_vocab: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] == local_vocab


def _gathered(x: Any, comm, head: str, part: Partition, local_vocab: int) -> Any:
    return comm.all_gather(x, x.dim() - 1, part, where=head) if _is_slice(x, local_vocab) else x
