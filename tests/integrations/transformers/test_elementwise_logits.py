"""elementwise_logits: the gate of the sliced causal-LM loss reads a forward's source and accepts only elementwise
steps on the logits (unit tests, no process group; tests/engines/torchrun/test_torchrun_causal_lm_loss.py runs
the gate in the real path).

First on small forwards written here, one pattern each; then over the installed transformers' causal LMs and
image-text-to-text models (the audit: which of them get the sliced loss).
"""

import functools
import re

import pytest
import torch

from tensorshard.integrations.elementwise_logits import classify, why_not_elementwise

transformers = pytest.importorskip("transformers")


class Base:
    """Stands in for a causal LM: the attributes the forwards below read (config scalars, a scale)."""

    class config:
        final_logit_softcapping = 30.0
        logits_scaling = 8.0
        vocab_size = 128
        text_vocab_size = 100

    logit_scale = 0.5

    def lm_head(self, x):
        return x

    def loss_function(self, logits, labels, vocab_size=None, **kwargs):
        return logits.sum()


# -- accepted: every step on the logits acts on each vocabulary entry alone ----------------------------------

class Softcapped(Base):  # Gemma2
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return dict(loss=loss, logits=logits)


class Scaled(Base):  # Cohere, Granite: a scale, a cast, an in-place divide; the tuple output of return_dict=False
    def forward(self, h, labels=None, return_dict=True):
        logits = self.lm_head(h).float() * self.logit_scale
        logits /= self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        logits = torch.nn.functional.tanh(logits / cap) * cap
        loss = self.loss_function(logits.float(), labels, self.config.vocab_size)
        if not return_dict:
            output = (logits,) + (h,)
            return (loss,) + output if loss is not None else output
        return dict(loss=loss, logits=logits)


def _passing(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class Decorated(Base):  # transformers' @can_return_tuple and friends: read through functools.wraps
    @_passing
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        return self.loss_function(logits, labels)


class Inherited(Softcapped):  # the forward is read where it is defined
    pass


# -- rejected: the logits' vocabulary entries are picked, masked, sliced or mixed -----------------------------

class MaskedByIndex(Base):  # Chameleon: logits[:, :, image_tokens] = min
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        logits[..., 3] = float("-inf")
        return self.loss_function(logits, labels)


class MaskedFill(Base):
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        logits = logits.masked_fill(self.banned, float("-inf"))
        return self.loss_function(logits, labels)


class Truncated(Base):  # Inkling: logits[..., :unpadded_vocab_size]
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        logits = logits[..., : self.config.text_vocab_size]
        return self.loss_function(logits, labels)


class SlicedInTheCall(Base):
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        return self.loss_function(logits[..., :100], labels)


class Normalised(Base):
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        logits = torch.log_softmax(logits, dim=-1)
        return self.loss_function(logits, labels)


class AliasEdited(Base):  # an edit through another name
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        view = logits
        view[..., 0] = 0
        return self.loss_function(logits, labels)


class EditedAfterTheLoss(Base):  # out.logits would be wrong: every step after the head counts, not only before the loss
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        loss = self.loss_function(logits, labels)
        logits = logits.softmax(-1)
        return dict(loss=loss, logits=logits)


class ZLoss(Base):  # Bamba: a log-sum-exp over the vocabulary, added to the loss
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        loss = self.loss_function(logits, labels)
        loss = loss + logits.logsumexp(dim=-1).pow(2).mean()
        return loss


class Helper(Base):  # a method the check cannot see into
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        logits = self.adjust(logits)
        return self.loss_function(logits, labels)


class WidthCondition(Base):  # a condition on the logits' shape reads differently on a slice
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        if logits.shape[-1] > self.config.text_vocab_size:
            logits = logits * 2
        return self.loss_function(logits, labels)


class HeadInALoop(Base):
    def forward(self, h, labels=None):
        for x in h:
            logits = self.lm_head(x)
        return self.loss_function(logits, labels)


class OwnLoss(Base):  # no self.loss_function: the model computes its loss another way
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        return torch.nn.functional.cross_entropy(logits.view(-1, self.config.vocab_size), labels.view(-1))


class VocabularyScale(Base):  # passes the source check; the instance's scale is a (vocab,) tensor
    logit_scale = torch.ones(128)

    def forward(self, h, labels=None):
        logits = self.lm_head(h) * self.logit_scale
        return self.loss_function(logits, labels)


Unreadable = type("Unreadable", (Base,), {"forward": eval("lambda self, h, labels=None: self.loss_function(self.lm_head(h), labels)")})


@pytest.mark.parametrize("cls", [Softcapped, Scaled, Decorated, Inherited])
def test_elementwise_steps_are_accepted(cls):
    assert why_not_elementwise(cls(), "lm_head") is None


@pytest.mark.parametrize("cls, why", [
    (MaskedByIndex, "`logits[..., 3] = float('-inf')` is not a recognised elementwise step"),
    (MaskedFill, "logits.masked_fill"),
    (Truncated, "logits[..., :self.config.text_vocab_size]"),
    (SlicedInTheCall, "the logits passed to self.loss_function are not an elementwise form"),
    (Normalised, "torch.log_softmax"),
    (AliasEdited, "`view = logits`"),
    (EditedAfterTheLoss, "logits.softmax(-1)"),
    (ZLoss, "logsumexp"),
    (Helper, "self.adjust(logits)"),
    (WidthCondition, "a condition or loop reads the logits"),
    (HeadInALoop, "inside a loop"),
    (OwnLoss, "calls self.loss_function 0 times"),
    (VocabularyScale, "self.logit_scale (a Tensor) is not a scalar"),
    (Unreadable, "the source of"),
])
def test_anything_else_is_rejected_with_a_reason(cls, why):
    reason = why_not_elementwise(cls(), "lm_head")
    assert reason is not None and why in reason, reason


# -- the audit: the installed transformers' causal LMs ---------------------------------------------------------

def _audited() -> dict[str, tuple[type, str]]:
    """Causal-LM and image-text-to-text classes whose forward calls self.loss_function, with their vocabulary head's
    path (from get_output_embeddings' source: ``return self.lm_head.decoder``; else lm_head)."""
    import inspect

    from transformers.models.auto import modeling_auto as auto

    names = {*auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values(), *auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values()}
    out = {}
    for name in sorted(n for v in names for n in ([v] if isinstance(v, str) else v)):
        try:
            cls = getattr(transformers, name)
            source = inspect.getsource(inspect.unwrap(cls.forward))
            getter = inspect.getsource(cls.get_output_embeddings)
        except (ImportError, AttributeError, OSError, TypeError):
            continue  # an optional dependency missing (torchaudio, ...)
        if "self.loss_function(" in source:
            head = re.search(r"return self\.([\w.]+)\s*$", getter, re.M)
            out[name] = (cls, head.group(1) if head else "lm_head")
    return out


def test_the_installed_transformers_models():
    audited = _audited()
    reasons = {name: classify(cls, head) for name, (cls, head) in audited.items()}
    accepted = sorted(n for n, r in reasons.items() if r is None)
    # Measured with transformers 5.24: 248 classes call self.loss_function, 216 accepted. Of the 32 refused, 4 edit
    # their logits by vocabulary index or over the whole vocabulary (Chameleon masks its image tokens, Inkling x2
    # cut to the unpadded vocabulary, Bamba adds a z-loss: a log-sum-exp over it); 6 are elementwise in fact but
    # beyond the check (a softcap module: Inkling2 x4; xLSTM's chunked in-place softcap; Git slices the sequence);
    # 22 call their vocabulary projection inside another module (a BERT-style prediction head, an inner LM).
    # With transformers 5.0: 158 classes call self.loss_function (the others compute their loss inline), 135 accepted.
    assert len(audited) >= 150 and len(accepted) >= 0.8 * len(audited), (len(accepted), len(audited))
    for name in ["LlamaForCausalLM", "Gemma2ForCausalLM", "CohereForCausalLM", "GraniteForCausalLM",
                 "RecurrentGemmaForCausalLM", "PaliGemmaForConditionalGeneration", "MllamaForCausalLM",
                 "BloomForCausalLM", "FalconH1ForCausalLM", "Qwen2ForCausalLM"]:
        assert name in accepted, (name, reasons.get(name))
    if "Gemma3nForConditionalGeneration" in audited:  # transformers 5.0's computes its loss inline: not audited
        assert "Gemma3nForConditionalGeneration" in accepted, reasons["Gemma3nForConditionalGeneration"]
    for name, why in {
        "ChameleonForConditionalGeneration": "logits[:, :, image_tokens] = torch.finfo(logits.dtype).min",
        "InklingForCausalLM": "a condition or loop reads the logits",  # then logits[..., :unpadded_vocab_size]
        "BambaForCausalLM": "logits.logsumexp(dim=-1)",
        "RobertaForCausalLM": "calls self.lm_head.decoder 0 times",
    }.items():
        if name in reasons:
            assert reasons[name] is not None and why in reasons[name], (name, reasons[name])


class PostProcessed(Base):  # a function, not an output class, gets the logits on the way out
    def forward(self, h, labels=None):
        logits = self.lm_head(h)
        loss = self.loss_function(logits, labels)
        return postprocess(loss=loss, logits=logits)


def test_logits_handed_to_a_function_are_rejected():
    assert "postprocess(loss=loss, logits=logits)" in why_not_elementwise(PostProcessed(), "lm_head")


class ScaledByArgument(Base):  # the scale comes from the caller: not provably a scalar
    def forward(self, h, labels=None, scale=None):
        scale = self.config.logits_scaling
        logits = self.lm_head(h) * scale
        return self.loss_function(logits, labels)


def test_a_parameter_is_not_a_scalar_from_self():
    assert "is not assigned, elementwise, to one name" in why_not_elementwise(ScaledByArgument(), "lm_head")


class Closure(Base):  # an edit defined before the head call, run after it
    def forward(self, h, labels=None):
        def forbid():
            logits[..., 0] = 0
        logits = self.lm_head(h)
        forbid()
        return self.loss_function(logits, labels)


def test_a_closure_over_the_logits_is_rejected():
    assert "a nested function or lambda reads the logits" in why_not_elementwise(Closure(), "lm_head")
