"""Every preset on a tiny random model, split over 2 and 3 CPU slots, against the unsplit model (fp32):
logits within 1e-4 relative, 12 greedy tokens identical, seeded sampling identical, loss and every
parameter's gradient after backward() within 1e-4 relative."""

import copy

import pytest
import torch

import tensorshard as tp
from tensorshard.plans.plan import match_pattern
from tensorshard.plans.presets import PRESETS, base_model
from support.helpers import rel_err
from support.hf_configs import FAMILIES, VOCAB, extra_inputs, tiny_config, tiny_model
from support.hf_parity import gathered_grads

pytestmark = pytest.mark.timeout(120)

GENERATE = dict(max_new_tokens=12, min_new_tokens=12, pad_token_id=0)


def test_every_issue_architecture_has_a_preset():
    wanted = "llama mistral mixtral qwen2 qwen3 qwen3_moe gemma gemma2 phi3 gpt2 gpt_neox gptj opt bloom falcon t5 bert"
    assert set(wanted.split()) <= set(PRESETS)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_preset_entries_all_match_the_model(name):
    """preset_for drops entries a model class lacks; for these classes every entry must hit something
    (qwen3_moe: layer 0 has experts, layer 1 a dense MLP)."""
    model = tiny_model(name)
    prefix, _ = base_model(model)
    names = [n for n, _ in model.named_modules()]
    plan = PRESETS[model.config.model_type](model.config)
    unmatched = [p for p in plan if not any(match_pattern(prefix + p, n) for n in names)]
    assert unmatched == [], unmatched


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_split_model_matches_unsplit(name, n, gen):
    ref = tiny_model(name)
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n)
    assert isinstance(model, type(ref)) and model.config is not ref.config

    ids = torch.randint(1, VOCAB, (2, 7), generator=gen)
    extra = extra_inputs(name, 2, gen)
    with torch.no_grad():
        logits = model(input_ids=ids, labels=ids, **extra).logits
        assert rel_err(logits, ref(input_ids=ids, labels=ids, **extra).logits) < 1e-4

    prompt, context = ids[:, :4], extra_inputs(name, 2, gen, generate=True)
    assert torch.equal(model.generate(prompt, **GENERATE, **context), ref.generate(prompt, **GENERATE, **context))
    sampled = []
    for m in (model, ref):
        torch.manual_seed(7)
        sampled.append(m.generate(prompt, do_sample=True, top_k=0, max_new_tokens=6, pad_token_id=0, **context))
    assert torch.equal(*sampled)

    model.train(), ref.train()  # dropout is 0 in these configs
    loss = model(input_ids=ids, labels=ids, **extra).loss
    ref_loss = ref(input_ids=ids, labels=ids, **extra).loss
    loss.backward(), ref_loss.backward()
    assert rel_err(loss, ref_loss) < 1e-5
    grads = gathered_grads(model)
    expected = {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
    assert set(grads) == set(expected)
    for key in expected:
        # 1e-4 relative; the absolute floor is for gradients that are zero up to rounding (a key bias does
        # not change the softmax: its gradient is ~1e-12 noise in both models)
        assert (grads[key] - expected[key]).norm() <= 1e-4 * expected[key].norm() + 1e-8, key


def test_llama_collectives_per_block(gen):
    """Two all-reduces per block each way, plus the vocabulary-split embedding, the head's logits assembled once
    and the loss computed from their vocabulary slices (two all-reduces of per-token numbers, none in backward)."""
    model = tp.tensor_parallel(tiny_model("llama"), ["cpu"] * 2)  # 3 KV heads over 2: none replicated
    ids = torch.randint(1, VOCAB, (1, 5), generator=gen)
    with tp.count_collectives() as c:
        model(input_ids=ids, labels=ids).loss.backward()
    layers = model.config.num_hidden_layers
    assert c.forward == {"all_reduce": 2 * layers + 1 + 2, "all_gather": 1}
    assert c.backward == {"all_reduce": 2 * layers + 1}  # q|k|v and gate|up inputs, and the head's input


def test_falcon_new_architecture_refuses_more_devices_than_kv_groups():
    config = tiny_config("falcon_new")  # 3 KV groups
    with pytest.raises(ValueError, match="at most 3 devices"):
        tp.tensor_parallel(tiny_model("falcon_new", config), ["cpu"] * 4)


class ScaledHead(torch.nn.Linear):
    """An output head with a forward of its own and a per-token parameter (as Dory's): not a plain column split."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__(hidden, vocab, bias=False)
        self.logit_scale = torch.nn.Parameter(torch.rand(vocab) + 0.5)

    def forward(self, x):
        return super().forward(x) * self.logit_scale


@pytest.mark.parametrize("n", [2, 3])
def test_a_head_with_a_forward_of_its_own_stays_whole(n, gen):
    model = tiny_model("llama")
    model.lm_head = ScaledHead(model.config.hidden_size, model.config.vocab_size)
    ids = torch.randint(1, VOCAB, (2, 5), generator=gen)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    assert "lm_head" not in tp.preset_for(model)  # the preset leaves it to the plan's default: whole
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * n)
    with torch.no_grad():
        assert rel_err(split(input_ids=ids).logits, ref) < 1e-5
    assert split.splits["lm_head.weight"] is None and split.splits["lm_head.logit_scale"] is None
