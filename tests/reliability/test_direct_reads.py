"""Silently wrong, class 2: a module that reads a split child's weights without calling the child
(nn.TransformerEncoderLayer's fast path, nn.MultiheadAttention's out_proj) is refused, never wrong."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorshard as tp
from support.helpers import rel_err
from tensorshard.plans.direct_reads import direct_reads

pytestmark = pytest.mark.timeout(60)


def encoder_layer() -> nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(16, 4, 64, dropout=0.0, batch_first=True).eval()


class ReadsChildWeight(nn.Module):
    """A head tied by hand: the forward uses fc's weight without calling fc."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        return self.out(F.linear(x, self.fc.weight, self.fc.bias).relu())


class ChecksChildDtype(ReadsChildWeight):
    """Looks at the child's weight only for metadata: calling the child is what computes."""

    def forward(self, x):
        if self.fc.weight.dtype != x.dtype or self.fc.bias is None:
            x = x.to(self.fc.weight.dtype)
        return self.out(self.fc(x).relu())


def test_encoder_layer_hand_plan_is_refused_before_anything_changes():
    layer = encoder_layer()
    before = {n: p for n, p in layer.named_parameters()}
    plan = {"linear1": tp.ColwiseParallel(), "linear2": tp.RowwiseParallel()}
    with pytest.raises(ValueError, match=r"TransformerEncoderLayer\) reads linear1\.\w+ .*itself in its forward instead of calling linear1"):
        tp.tensor_parallel(layer, ["cpu"] * 2, plan=plan)
    assert {n: p for n, p in layer.named_parameters()} == before and not any(p.is_meta for p in before.values())


def test_encoder_inferred_plan_matches_on_the_fast_path(gen):
    torch.manual_seed(0)
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 64, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False).eval()
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2)
    assert not any(".linear" in key for key in split.plan)  # what the fast path reads stays whole
    x = torch.randn(2, 5, 16, generator=gen)
    with torch.no_grad():  # the fused fast path: it reads linear1.weight etc. itself
        assert rel_err(split(x), ref(x)) < 1e-5  # before the fix: 0.1-0.5 off


def test_multihead_attention_out_proj_split_is_refused():
    model = nn.MultiheadAttention(16, 4, batch_first=True)
    with pytest.raises(ValueError, match=r"<root> \(MultiheadAttention\) reads out_proj\.\w+ .*instead of calling out_proj"):
        tp.tensor_parallel(model, ["cpu"] * 2, plan={"out_proj": tp.RowwiseParallel()})


def test_any_module_reading_a_split_child_weight_is_refused():
    with pytest.raises(ValueError, match=r"reads fc\.\w+ .*Leave fc whole"):
        tp.tensor_parallel(ReadsChildWeight(), ["cpu"] * 2, plan={"fc": tp.ColwiseParallel(), "out": tp.RowwiseParallel()})


def test_metadata_reads_are_not_direct_reads(gen):
    ref = ChecksChildDtype()
    assert direct_reads(ref) == {}
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan={"fc": tp.ColwiseParallel(), "out": tp.RowwiseParallel()})
    x = torch.randn(3, 8, generator=gen)
    assert rel_err(split(x), ref(x)) < 1e-5


def test_what_is_found():
    assert direct_reads(ReadsChildWeight()) == {"": ["fc.bias", "fc.weight"]}
    reads = direct_reads(encoder_layer())
    assert {"linear1.weight", "linear2.weight", "self_attn.in_proj_weight", "self_attn.out_proj.weight"} <= set(reads[""])
    assert reads["self_attn"] == ["self_attn.out_proj.bias", "self_attn.out_proj.weight"]


def test_transformers_models_have_no_direct_reads():
    transformers = pytest.importorskip("transformers")
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=50)
    )
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=50
    ))
    assert direct_reads(t5) == {} and direct_reads(llama) == {}  # T5 reads wo.weight.dtype: metadata only


class ReadsWhenExact(ReadsChildWeight):
    """Bloom's pattern: a direct read under a branch that a plain attribute of the module decides."""

    def __init__(self, exact: bool):
        super().__init__()
        self.exact = exact

    def forward(self, x):
        if self.exact and self.fc.in_features > 4:
            h = F.linear(x, self.fc.weight, self.fc.bias)
        else:
            h = self.fc(x)
        return self.out(h.relu())


def test_a_branch_the_module_never_takes_does_not_count(gen):
    plan = {"fc": tp.ColwiseParallel(), "out": tp.RowwiseParallel()}
    with pytest.raises(ValueError, match="reads fc"):
        tp.tensor_parallel(ReadsWhenExact(exact=True), ["cpu"] * 2, plan=plan)
    ref = ReadsWhenExact(exact=False)
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plan)
    x = torch.randn(3, 8, generator=gen)
    assert rel_err(split(x), ref(x)) < 1e-5


class ReadsInEval(ReadsChildWeight):
    """An inference-only fast path: the branch depends on the mode, which changes after splitting."""

    def forward(self, x):
        h = F.linear(x, self.fc.weight, self.fc.bias) if not self.training else self.fc(x)
        return self.out(h.relu())


def test_a_branch_on_the_train_mode_counts_whatever_the_mode_at_split_time():
    plan = {"fc": tp.ColwiseParallel(), "out": tp.RowwiseParallel()}
    with pytest.raises(ValueError, match="reads fc"):
        tp.tensor_parallel(ReadsInEval().train(), ["cpu"] * 2, plan=plan)
