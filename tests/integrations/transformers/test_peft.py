"""PEFT LoRA on split models, in the in-process engine: LoRA then split, split then LoRA, saved adapters.

Each path is compared with the unsplit PeftModel holding the same adapter: logits within 1e-5 relative, and
losses after three AdamW steps within 1e-4 relative (fp32). Collectives are counted: an adapter adds none
per layer, only one reduction of partial gradients per backward pass.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoHaConfig, LoraConfig, PeftModel, PromptTuningConfig, TaskType, get_peft_model
from transformers import AutoModelForCausalLM

import tensorshard as tp
from support.hf_configs import FAMILIES
from support.helpers import rel_err, split_copy, train_both_causal_lm

pytestmark = pytest.mark.timeout(120)

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(family: str = "llama"):
    torch.manual_seed(0)
    config = FAMILIES[family][0]()
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):  # gpt2: dropout off (masks differ between shards)
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return AutoModelForCausalLM.from_config(config)


def lora(model, targets=LLAMA_TARGETS, **options):
    torch.manual_seed(1)  # init_lora_weights=False: B is random too, so the adapter matters from the first step
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **options))


def ids(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(seed))


def train_both(model, ref, steps: int = 3) -> list[tuple[float, float]]:
    """AdamW steps on both; the losses of each step (split, unsplit)."""
    return train_both_causal_lm(model, ref, [ids(10 + step) for step in range(steps)])


def assert_same_training(model, ref) -> None:
    with torch.no_grad():
        assert rel_err(model(input_ids=ids()).logits, ref(input_ids=ids()).logits) < 1e-5
    for got, want in train_both(model, ref):
        assert abs(got - want) <= 1e-4 * abs(want)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_lora_then_split_trains_like_unsplit(n):
    ref = lora(tiny(), modules_to_save=["lm_head"])
    model = split_copy(ref, n)
    assert isinstance(model, PeftModel)
    if n > 1:
        with tp.count_collectives() as c:
            model(input_ids=ids(), labels=ids()).loss.backward()
        # As the bare model: forward, the embedding 1 + 2 per block + the head's gather; backward, one all-reduce per
        # column-layer input needing a gradient (not the first block's attention, which reads the frozen embedding's
        # output) and the head's, + ONE reduction of the whole LoRA factors' partial gradients, for all layers.
        assert dict(c.forward) == {"all_reduce": 5, "all_gather": 1}
        assert dict(c.backward) == {"all_reduce": 4 + 1}
        assert sum("partial gradients" in where for _, _, _, where in c.log) == 1
        model.zero_grad()
    assert_same_training(model, ref)


def test_peft_model_is_split_as_fully_as_the_bare_model():
    bare = split_copy(tiny(), 2)
    model = split_copy(lora(tiny(), modules_to_save=["lm_head"]), 2)
    bare_split = {n for n, s in bare.splits.items() if s is not None}
    prefix = "base_model.model."
    peft_split = {n.removeprefix(prefix).replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
                  for n, s in model.splits.items() if s is not None and "lora_" not in n}
    assert bare_split <= peft_split  # every tensor the bare model splits, the PeftModel splits too (prefixed)
    assert model.splits[prefix + "model.layers.1.self_attn.q_proj.lora_B.default.weight"][0] == 0  # with the output
    assert model.splits[prefix + "model.layers.1.self_attn.o_proj.lora_A.default.weight"][0] == 1  # with the input
    assert model.splits[prefix + "model.layers.1.self_attn.q_proj.lora_A.default.weight"] is None  # shared


def test_saved_adapter_loads_into_an_unsplit_model_with_plain_peft(tmp_path):
    ref = lora(tiny(), modules_to_save=["lm_head"])
    model = split_copy(ref, 3)
    train_both(model, ref, steps=2)
    model.save_pretrained(tmp_path / "split", state_dict=None, safe_serialization=True, is_main_process=True)
    ref.save_pretrained(tmp_path / "unsplit")
    from safetensors.torch import load_file

    saved, expected = load_file(tmp_path / "split" / "adapter_model.safetensors"), load_file(tmp_path / "unsplit" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in expected.items()}
    loaded = PeftModel.from_pretrained(tiny(), tmp_path / "split").eval()
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids()).logits, ref.eval()(input_ids=ids()).logits) < 1e-5


@pytest.mark.parametrize("n", [1, 2, 3])
def test_lora_after_split_trains_like_unsplit(tmp_path, n):
    split = tp.tensor_parallel(tiny(), ["cpu"] * n, sharded=False)
    model = lora(split)  # PEFT wraps every device's layers; the split model adopts the adapters
    model.save_pretrained(tmp_path / "adapter")  # PEFT's own save: its format, unsplit names
    ref = PeftModel.from_pretrained(tiny(), tmp_path / "adapter", is_trainable=True)
    if n > 1:
        with tp.count_collectives() as c:
            model(input_ids=ids(), labels=ids()).loss.backward()
        assert sum("partial gradients" in where for _, _, _, where in c.log) == 1
        # + the loss's 2 all-reduces: the head is the split model's own here, so the loss comes from its slices;
        # + one all-gather: the adapter's whole factors are partitioned ZeRO-3 style (gathered once per call)
        assert dict(c.forward) == {"all_reduce": 5 + 2, "all_gather": 1 + 1}
        model.zero_grad()
    assert_same_training(model, ref)


@pytest.mark.parametrize("family, targets", [("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]), ("gpt2", ["c_attn", "c_proj", "c_fc"])])
def test_lora_on_fused_projections(family, targets):
    ref = lora(tiny(family), targets, fan_in_fan_out=family == "gpt2")
    model = split_copy(ref, 3)
    assert_same_training(model, ref)


def test_generate_and_incremental_decoding(tmp_path):
    from transformers import DynamicCache

    ref = lora(tiny()).eval()
    model = split_copy(ref, 2)
    prompt = ids()[:1]
    assert torch.equal(model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False),
                       ref.generate(input_ids=prompt, max_new_tokens=6, do_sample=False))
    caches, tokens, logits = (DynamicCache(), DynamicCache()), [prompt, prompt], []
    with torch.no_grad():
        for _ in range(3):  # the wrapped model's cache is per device: the second and third steps stay exact
            outs = [m(input_ids=t, past_key_values=c).logits for m, t, c in zip((model, ref), tokens, caches)]
            assert rel_err(outs[0], outs[1]) < 1e-5
            tokens = [o[:, -1:].argmax(-1) for o in outs]
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == 9


REFUSED = [  # (config, what the error names): refused in both orders, in the words of docs/finetuning.md's table
    (lambda: LoraConfig(r=4, target_modules=["embed_tokens"]), "embedding"),
    (lambda: LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True), "lora_bias"),
    (lambda: LoHaConfig(r=4, target_modules=["q_proj"]), "LoHa|not a LoRA or IA3 layer"),
    (lambda: PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4), "prompt-learning"),
]


@pytest.mark.parametrize("config, named", REFUSED)
def test_unsupported_adapters_are_refused_before_anything_changes(config, named):
    # adapter, then split: refused when splitting; the PeftModel is untouched and still usable
    model = get_peft_model(tiny(), config())
    with pytest.raises(NotImplementedError, match=named):
        tp.tensor_parallel(model, ["cpu"] * 2)
    assert not any(p.is_meta for p in model.parameters())
    model(input_ids=ids())
    # split, then adapter: refused when PEFT adds it (before any training step); PEFT's layers are taken out again
    split = tp.tensor_parallel(tiny(), ["cpu"] * 2, sharded=False)
    before, names = logits(split), [n for n, _ in split.named_modules()]
    with pytest.raises(NotImplementedError, match=named):
        get_peft_model(split, config())
    assert [n for n, _ in split.named_modules()] == names and "peft_config" not in vars(split)
    assert torch.equal(logits(split), before)


# --- switching and merging adapters: each device does PEFT's own operation on its slices; the split model then
# gives the unsplit PeftModel's logits after the same operation (1e-5), and after set_adapter trains like it.
# Operations that rebuild the module tree are refused before anything changes.


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids()).logits


def two_adapters():
    model = lora(tiny())
    torch.manual_seed(3)
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS, init_lora_weights=False))
    return model


@pytest.mark.parametrize("n, sharded", [(2, True), (3, True), (3, False)])
def test_merge_adapter_merges_every_device_slice(n, sharded):
    ref = lora(tiny()).eval()
    model = split_copy(ref, n, sharded=sharded).eval()
    with_adapter = logits(ref)
    for step in ("merge_adapter", "unmerge_adapter", "merge_adapter", "disable_adapter_layers", "enable_adapter_layers"):
        for m in (model, ref):
            getattr(m, step)()
        assert rel_err(logits(model), logits(ref)) < 1e-5, step
    assert rel_err(logits(model), with_adapter) < 1e-5


@pytest.mark.parametrize("family, targets", [("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
                                             ("gpt2", ["c_attn", "c_proj", "c_fc"])])
def test_merge_adapter_on_fused_projections(family, targets):
    ref = lora(tiny(family), targets, fan_in_fan_out=family == "gpt2").eval()
    model = split_copy(ref, 3, sharded=True).eval()
    model.merge_adapter()
    ref.merge_adapter()
    assert rel_err(logits(model), logits(ref)) < 1e-5


def test_disable_adapter_runs_the_base_model():
    base = tiny().eval()
    ref = lora(copy.deepcopy(base)).eval()
    model = split_copy(ref, 2, sharded=True).eval()
    with model.disable_adapter():
        assert rel_err(logits(model), logits(base)) < 1e-5
    assert rel_err(logits(model), logits(ref)) < 1e-5  # on again after the block


@pytest.mark.parametrize("n, sharded", [(2, False), (3, True)])
def test_set_adapter_trains_the_newly_active_adapter(n, sharded):
    ref = two_adapters()
    model = split_copy(ref, n, sharded=sharded)
    for m in (model, ref):
        m.set_adapter("b")
    assert model.active_adapter == "b"
    assert rel_err(logits(model), logits(ref)) < 1e-5
    # the factors of "b" were frozen when the model was split; their partial gradients must still be summed
    for m in (model, ref):
        m(input_ids=ids(), labels=ids()).loss.backward()
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.b.weight"  # whole: partial gradients per device
    want = dict(ref.named_parameters())[name].grad
    held = [dict(shard.named_parameters())[name].grad for shard in model.module_shards]
    # frozen when split, so ZeRO-3 left them replicated: every device holds the whole, summed gradient
    assert all(g.shape == want.shape and torch.equal(g, held[0]) for g in held)
    assert rel_err(held[0], want) < 1e-5
    model.zero_grad()
    ref.zero_grad()
    for got, want in train_both(model, ref):
        assert abs(got - want) <= 1e-4 * abs(want)


@pytest.mark.parametrize("method", ["merge_and_unload", "unload", "delete_adapter", "add_weighted_adapter"])
def test_restructuring_methods_are_refused_before_anything_changes(method):
    ref = lora(tiny()).eval()
    model = split_copy(ref, 2).eval()
    before = logits(model)
    with pytest.raises(NotImplementedError, match="merge_adapter"):
        getattr(model, method)("default") if method == "delete_adapter" else getattr(model, method)()
    assert torch.equal(logits(model), before)


def test_set_adapter_names_a_missing_adapter():
    model = split_copy(lora(tiny()), 2)
    with pytest.raises(ValueError, match="default"):
        model.set_adapter("missing")


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_initialisations_that_read_the_base_weight_are_refused_after_splitting(init):
    # each device would compute its factors from its slice and rewrite that slice: refused before PEFT touches it
    split = tp.tensor_parallel(tiny(), ["cpu"] * 2, sharded=False)
    before, names = logits(split), [n for n, _ in split.named_modules()]
    with pytest.raises(NotImplementedError, match=f"init_lora_weights='{init}'.*unsplit model first"):
        get_peft_model(split, LoraConfig(r=4, target_modules=LLAMA_TARGETS, init_lora_weights=init))
    assert [n for n, _ in split.named_modules()] == names
    assert torch.equal(logits(split), before)  # the base weights were not rewritten


def test_delete_adapter_is_refused_in_the_split_then_adapter_order_too():
    split = tp.tensor_parallel(tiny(), ["cpu"] * 2, sharded=False)
    model = get_peft_model(split, LoraConfig(r=4, target_modules=LLAMA_TARGETS, init_lora_weights=False))
    before = logits(model)
    with pytest.raises(NotImplementedError, match="delete_adapter.*rebuilds the module tree"):
        model.delete_adapter("default")
    assert torch.equal(logits(model), before)
