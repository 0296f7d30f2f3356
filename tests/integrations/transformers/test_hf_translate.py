"""Plans translated from a config's base_model_tp_plan, for architectures without a hand-written preset."""

import copy
import logging

import pytest
import torch
import transformers as T

import tensorshard as tp
from tensorshard.plans.presets.hf_tp_plan import translate_tp_plan
from tensorshard.styles import SumGradients
from support.helpers import rel_err

pytestmark = pytest.mark.timeout(120)

SIZES = dict(vocab_size=96, num_hidden_layers=2, max_position_embeddings=64, hidden_size=72, intermediate_size=88)
CONFIGS = {
    # q/k/v "colwise": split on heads (9 over 2 and 3, in 3 KV groups); the MLP has other names (c_fc, c_proj)
    "starcoder2": lambda: T.Starcoder2Config(**SIZES, num_attention_heads=9, num_key_value_heads=3),
    # q/k/v "colwise_gather_output" (a norm over all heads follows): attention whole on every device
    "olmo2": lambda: T.Olmo2Config(**SIZES, num_attention_heads=9, num_key_value_heads=3),
    # experts as 3-D parameters under "moe_tp_experts"
    "qwen2_moe": lambda: T.Qwen2MoeConfig(**{**SIZES, "hidden_size": 64}, moe_intermediate_size=24,
                                          shared_expert_intermediate_size=40, num_attention_heads=8,
                                          num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
}


def _model(name):
    config = CONFIGS[name]()
    config.pad_token_id = config.bos_token_id = config.eos_token_id = 0
    return T.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_translated_plan_matches_unsplit(name, n, gen, caplog):
    ref = _model(name)
    with caplog.at_level(logging.WARNING, logger="tensorshard"):
        model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n)
    assert "translated from its config's base_model_tp_plan" in caplog.text
    ids = torch.randint(1, 96, (2, 7), generator=gen)
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-4
    generate = dict(max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    assert torch.equal(model.generate(ids[:, :3], **generate), ref.generate(ids[:, :3], **generate))


def test_translation_of_each_layout():
    starcoder = translate_tp_plan(dict(CONFIGS["starcoder2"]().base_model_tp_plan), CONFIGS["starcoder2"](), _model("starcoder2").model)
    assert starcoder["layers.*.self_attn"] == tp.Heads(num_heads=9, num_kv_heads=3, attrs={"num_key_value_groups": "groups"})
    assert starcoder["layers.*.self_attn.k_proj"] == tp.ColwiseParallel(blocks=("kv",))
    assert starcoder["layers.*.self_attn.o_proj"] == tp.RowwiseParallel(blocks=("q",))
    assert starcoder["layers.*.mlp.c_fc"] == tp.ColwiseParallel()

    olmo = translate_tp_plan(dict(CONFIGS["olmo2"]().base_model_tp_plan), CONFIGS["olmo2"](), _model("olmo2").model)
    assert "layers.*.self_attn" not in olmo  # gathered q/k/v: no head split, no head counts to change
    assert olmo["layers.*.self_attn.q_proj"] == tp.ColwiseParallel(gather_output=True)

    # qwen2_moe's experts as transformers writes them from 5.1 on (5.0's plan leaves them out)
    experts = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
               "layers.*.mlp.experts": "moe_tp_experts"}
    moe = translate_tp_plan(experts, CONFIGS["qwen2_moe"](), _model("qwen2_moe").model)
    assert moe["layers.*.mlp.experts"] == tp.ShardParams(params={"gate_up_proj": {"dim": 1, "blocks": [24, 24]}, "down_proj": 2})


def test_the_layout_names_of_transformers_5_0(caplog):
    """5.0 called gathered q/k/v "colwise_rep" and o_proj "rowwise_rep" (olmo2), and marked fused experts
    "gather" with local_colwise / local_rowwise weights that do not say which dim to split: those stay whole."""
    olmo_5_0 = {"layers.*.self_attn.q_proj": "colwise_rep", "layers.*.self_attn.k_proj": "colwise_rep",
                "layers.*.self_attn.v_proj": "colwise_rep", "layers.*.self_attn.o_proj": "rowwise_rep"}
    olmo = translate_tp_plan(olmo_5_0, CONFIGS["olmo2"](), _model("olmo2").model)
    assert "layers.*.self_attn" not in olmo
    assert olmo["layers.*.self_attn.q_proj"] == tp.ColwiseParallel(gather_output=True)
    assert olmo["layers.*.self_attn.o_proj"] == tp.RowwiseParallel()

    experts_5_0 = {"layers.*.mlp.experts.gate_up_proj": "local_colwise", "layers.*.mlp.experts.down_proj": "local_rowwise",
                   "layers.*.mlp.experts": "gather"}
    with caplog.at_level(logging.WARNING, logger="tensorshard"):
        moe = translate_tp_plan(experts_5_0, CONFIGS["qwen2_moe"](), _model("qwen2_moe").model)
    assert moe["layers.*.mlp.experts"] == tp.Replicate()
    assert "on 3-D experts weights" in caplog.text and "layers.*.mlp.experts stays whole" in caplog.text


def test_qk_norms_sum_their_gradients_when_heads_are_split():
    config = T.Qwen3Config(**SIZES, num_attention_heads=9, num_key_value_heads=3, head_dim=8)
    # qwen3's plan as transformers writes it from 5.1 on (5.0's lists no q_norm / k_norm)
    tp_plan = {**config.base_model_tp_plan, "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
               "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"}
    plan = translate_tp_plan(tp_plan, config, T.Qwen3Model(config))
    assert plan["layers.*.self_attn.q_norm"] == SumGradients()


def test_untranslatable_entry_keeps_its_parent_whole(caplog):
    config = CONFIGS["starcoder2"]()
    tp_plan = {**config.base_model_tp_plan, "layers.*.self_attn.o_proj": "some_future_style"}
    with caplog.at_level(logging.WARNING, logger="tensorshard"):
        plan = translate_tp_plan(tp_plan, config, _model("starcoder2").model)
    assert plan["layers.*.self_attn"] == tp.Replicate()
    assert not any(p.startswith("layers.*.self_attn.") for p in plan)
    assert plan["layers.*.mlp.c_fc"] == tp.ColwiseParallel()  # the rest is still split
    assert "'some_future_style' is not translated; layers.*.self_attn stays whole" in caplog.text


def test_a_translated_plan_that_does_not_fit_falls_back_to_an_inferred_one(gen, caplog):
    """Doge's base_model_tp_plan splits attention heads, but its forward builds a mask over all heads: the
    self-check catches the region, and the model is split by the inferred (self-checked) plan instead."""
    config = T.DogeConfig(**SIZES, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    ref = T.AutoModelForCausalLM.from_config(config).eval()
    translated = tp.preset_for(ref)
    with caplog.at_level(logging.WARNING, logger="tensorshard"):
        model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2)
    assert "does not fit it" in caplog.text and "using an inferred plan instead" in caplog.text
    assert model.plan != translated
    ids = torch.randint(1, 96, (2, 7), generator=gen)
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-4
    generate = dict(max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    assert torch.equal(model.generate(ids[:, :3], **generate), ref.generate(ids[:, :3], **generate))


def test_recurrent_cache_params_are_kept_per_device(gen):
    """Mamba2 passes its recurrent state as `cache_params`: each device needs its own (shared, it would be
    advanced once per device and generation would drift after the first token)."""
    config = T.Mamba2Config(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
                            expand=2, n_groups=1, state_size=16, chunk_size=16, pad_token_id=0)
    torch.manual_seed(0)
    ref = T.AutoModelForCausalLM.from_config(config).eval()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2)
    ids = torch.randint(1, 96, (1, 5), generator=gen)
    generate = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **generate), ref.generate(ids, **generate))
