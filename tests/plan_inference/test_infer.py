"""Plans inferred for models no preset knows: the hand-written communication (1 + 1 all-reduces per
column -> row pair, 2 + 2 per transformer block) and parity with the unsplit model (fp32: forward 1e-5,
after 3 AdamW steps 1e-4, as in the core tests)."""

import copy
import logging

import pytest
import torch

import tensorshard as tp
from support.helpers import check_training_parity, rel_err, split_copy
from support.custom_models import FusedGPT, MLPMixer, QKNormAttention, TemperatureAttention
from support.models import FeedForward, Transformer

pytestmark = pytest.mark.timeout(90)


def counts(model, x):
    with tp.count_collectives() as fwd:
        y = model(x)
    with tp.count_collectives() as bwd:
        y.float().square().mean().backward()
    return fwd.counts, bwd.counts


@pytest.mark.parametrize("n", [2, 3])
def test_mlp_mixer(n, gen):
    ref = MLPMixer()
    model = split_copy(ref, n)
    styles = {k: v.describe() for k, v in model.plan.items()}
    assert styles == {
        "blocks.*.token_fc1": "ColwiseParallel()", "blocks.*.token_fc2": "RowwiseParallel()",
        "blocks.*.channel_fc1": "ColwiseParallel()", "blocks.*.channel_fc2": "RowwiseParallel()",
    }
    x = lambda: torch.randn(3, 10, 12, generator=gen)  # noqa: E731
    fwd, bwd = counts(model, x())
    assert fwd == {"all_reduce": 2 * 2} and bwd == {"all_reduce": 2 * 2}  # 2 blocks x (token + channel MLP)
    check_training_parity(ref, split_copy(ref, n), x)


@pytest.mark.parametrize("layout, n", [("blocks", 2), ("blocks", 3), ("interleaved", 2), ("interleaved", 4)])
def test_fused_qkv_attention(layout, n, gen):
    ref = FusedGPT(layout=layout)  # 6 heads: 3 + 3, 2 + 2 + 2, 2 + 2 + 1 + 1
    model = split_copy(ref, n)
    plan = model.plan
    if layout == "blocks":  # [q | k | v], every query head with its own key/value head
        assert plan["blocks.*.attn"] == tp.Heads(num_heads=6, num_kv_heads=6, attrs={"heads": "heads"})
        assert plan["blocks.*.attn.qkv"] == tp.ColwiseParallel(blocks=("q", "kv", "kv"))
    else:  # q, k, v of each head side by side
        assert plan["blocks.*.attn"] == tp.Heads(num_heads=6, attrs={"heads": "heads"})
        assert plan["blocks.*.attn.qkv"] == tp.ColwiseParallel(blocks=("q*3",))
    assert plan["blocks.*.attn.proj"] == tp.RowwiseParallel(blocks=("q",))
    assert plan["wte"] == tp.EmbeddingParallel() and plan["lm_head"] == tp.ColwiseParallel(gather_output=True)
    fwd, bwd = counts(model, torch.randint(0, 80, (2, 7), generator=gen))
    # vocabulary-split embedding + 2 per block; the tied head gathers its logits and reduces its input gradient
    assert fwd == {"all_reduce": 1 + 2 * 2, "all_gather": 1} and bwd == {"all_reduce": 2 * 2 + 1}
    check_training_parity(ref, split_copy(ref, n), lambda: torch.randint(0, 80, (2, 7), generator=gen))


def test_per_head_norm_weights_get_whole_gradients(gen):
    ref = QKNormAttention()
    model = split_copy(ref, 2)
    assert model.plan["q_norm"] == tp.SumGradients() and model.plan["k_norm"] == tp.SumGradients()
    check_training_parity(ref, model, lambda: torch.randn(2, 5, 32, generator=gen))
    a, b = (s.q_norm.weight for s in model.module_shards)
    assert torch.equal(a, b) and not torch.equal(a, torch.ones_like(a))  # trained, and identical copies


def test_transformers_architecture_without_a_preset(gen):
    from transformers import BioGptConfig, BioGptForCausalLM

    from tensorshard.plans.presets import preset_for

    cfg = BioGptConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = BioGptForCausalLM(cfg).eval()
    assert preset_for(ref) is None, "this test is about inference: use an architecture without a preset"
    model = split_copy(ref, 2)
    model.eval()
    ids = torch.randint(0, 128, (2, 9), generator=gen)
    with tp.count_collectives() as fwd:
        logits = model(input_ids=ids).logits
    assert rel_err(logits, ref(input_ids=ids).logits) < 1e-5
    assert fwd.counts == {"all_reduce": 1 + 2 * 2, "all_gather": 1}  # embedding, 2 per block, gathered head
    loss = model(input_ids=ids).logits.square().mean()
    with tp.count_collectives() as bwd:
        loss.backward()
    assert bwd.counts == {"all_reduce": 2 * 2 + 1}
    assert max(tp.memory_per_device(model).values()) < sum(p.numel() * 4 for p in ref.parameters())


def test_a_model_that_fools_the_structure_falls_back_after_the_self_check(gen, caplog):
    ref = TemperatureAttention()
    x = torch.randn(2, 5, 32, generator=gen)
    with caplog.at_level(logging.INFO, logger="tensorshard.plan_inference.infer"):
        model = split_copy(ref, 2)
    assert "kept whole (self-check): wq, wk, wv, wo" in caplog.text and "differs" in caplog.text
    assert len(model.plan) == 0  # the attention stays whole ...
    assert rel_err(model(x), ref(x)) < 1e-6  # ... and computes the right thing
    unchecked = split_copy(ref, 2, check=False)  # what the self-check prevented: a silently wrong model
    assert "wq" in unchecked.plan and rel_err(unchecked(x), ref(x)) > 1e-2


def test_too_few_units_for_the_devices_fall_back(gen, caplog):
    ref = FeedForward(16, 2)  # 2 hidden features cannot go to 3 devices
    with caplog.at_level(logging.INFO, logger="tensorshard.plan_inference.infer"):
        model = split_copy(ref, 3)
    assert len(model.plan) == 0 and "kept whole (structure): w1, w3, w2" in caplog.text
    x = torch.randn(4, 16, generator=gen)
    assert rel_err(model(x), ref(x)) < 1e-6


def test_example_inputs_for_models_with_several_inputs(gen):
    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ffn = FeedForward(16, 32)

        def forward(self, x, scale):
            return self.ffn(x) * scale

    ref = TwoInputs()
    x, s = torch.randn(3, 16, generator=gen), torch.tensor(2.0)
    with pytest.raises(RuntimeError, match="example_inputs"):
        tp.infer_plan(ref, 2)
    plan = tp.infer_plan(ref, 2, example_inputs=(x, s), check=True)
    model = split_copy(ref, 2, plan=plan)
    assert rel_err(model(x, s), ref(x, s)) < 1e-6


def test_meta_model_gets_the_same_plan():
    with torch.device("meta"):
        meta = Transformer(dim=72, n_heads=9, n_kv_heads=3)
    assert tp.infer_plan(meta, 4) == tp.infer_plan(Transformer(dim=72, n_heads=9, n_kv_heads=3), 4)


def test_plan_saved_as_json_splits_identically(tmp_path, gen):
    ref = Transformer(dim=64, n_heads=8, n_kv_heads=2)
    inferred = split_copy(ref, 3)
    path = tmp_path / "plan.json"
    inferred.plan.save(path)
    loaded = tp.Plan.load(path)
    assert loaded == inferred.plan
    reloaded = split_copy(ref, 3, plan=loaded)
    assert tp.memory_per_device(reloaded) == tp.memory_per_device(inferred)
    tokens = torch.randint(0, 96, (2, 9), generator=gen)
    assert torch.equal(reloaded(tokens), inferred(tokens))


def test_original_model_is_untouched_by_inference(gen):
    ref = Transformer()
    before = copy.deepcopy(ref.state_dict())
    ref.train()
    tp.infer_plan(ref, 2, check=True)
    assert ref.training and all(m.training for m in ref.modules())
    assert all(torch.equal(before[k], v) for k, v in ref.state_dict().items())


def test_no_plan_costs_what_the_hand_written_plan_costs(gen):
    ffn = split_copy(FeedForward(64, 176), 3)
    assert counts(ffn, torch.randn(4, 64, generator=gen, requires_grad=True)) == ({"all_reduce": 1}, {"all_reduce": 1})
    model = split_copy(Transformer(n_layers=3, n_heads=8, n_kv_heads=4), 2)
    fwd, bwd = counts(model, torch.randint(0, 96, (2, 9), generator=gen))
    assert fwd == {"all_reduce": 1 + 2 * 3, "all_gather": 1} and bwd == {"all_reduce": 2 * 3 + 1}


def test_check_true_verifies_a_given_plan(gen, caplog):
    ref = TemperatureAttention()
    plan = tp.Plan({
        "": tp.Heads(num_heads=4, attrs={"n_heads": "heads"}),
        "w[qkv]": tp.ColwiseParallel(blocks=("q",)),
        "wo": tp.RowwiseParallel(blocks=("q",)),
    })
    with caplog.at_level(logging.INFO, logger="tensorshard.plan_inference.selfcheck"):
        model = split_copy(ref, 2, plan=plan, check=True)
    assert "kept whole (self-check)" in caplog.text
    x = torch.randn(2, 5, 32, generator=gen)
    assert rel_err(model(x), ref(x)) < 1e-6


def test_inference_fast_paths_are_checked_too(gen, caplog):
    """nn.TransformerEncoderLayer in eval mode without gradients runs a fused kernel on its layers' weights,
    bypassing their forwards: the traced pass cannot see that; reading the layer's source does
    (plans/direct_reads.py), and the self-check's no-grad run would."""
    ref = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0).eval()
    with caplog.at_level(logging.INFO, logger="tensorshard.plan_inference.infer"):
        model = split_copy(ref, 2)
    assert "<root> reads linear1.weight itself instead of calling linear1" in caplog.text
    x = torch.randn(2, 5, 32, generator=gen)
    with torch.no_grad():
        assert rel_err(model(x), ref(x)) < 1e-6
