"""A split model is one model: configuration changed after splitting reaches every device, in one process.

Every shard, the split model's `config` and every view of a submodule hold the same configuration objects
(sub-configs and generation config included), so a field set through any of them changes what every device
computes: the unsplit model's outputs, with the same change made to it (fp32, 1e-5 relative). Fields that
size the split are refused when set; attributes set on submodules through views reach every device's copy,
or are refused when the split depends on them. (tests/engines/torchrun/test_torchrun_config.py: the same
under torchrun.)"""

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import transformers as T

import tensorshard as tp
from support.classifiers import NAMES, PAD, classifier, padded_batch
from support.helpers import rel_err, split_copy
from support.hf_configs import VOCAB, tiny_model
from tensorshard.engines.shared_config import FrozenBySplitError

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [2, 3])
def test_pad_token_id_set_after_splitting_gives_the_unsplit_logits(name, n, gen):
    ref = classifier(name)
    split = split_copy(ref, n)
    assert split.config.pad_token_id is None
    batch = padded_batch(gen)
    split.config.pad_token_id = PAD  # what every classification tutorial does for a model without one
    ref.config.pad_token_id = PAD
    with torch.no_grad():
        expected = ref(**batch).logits
        assert rel_err(split(**batch).logits, expected) < 1e-5
        if name != "bert":  # a decoder pools the last token before the padding: the pad id decides which
            base = getattr(split, split.base_model_prefix)  # split.model, split.transformer: a view
            ref.config.pad_token_id = base.config.pad_token_id = 1  # in no sequence: pools the last token
            assert rel_err(split(**batch).logits, ref(**batch).logits) < 1e-5
            assert rel_err(split(**batch).logits, expected) > 1e-3


@pytest.mark.parametrize("n", [2, 3])
def test_output_hidden_states_from_the_config(n, gen):
    ref = tiny_model("llama")
    split = split_copy(ref, n)
    ids = torch.randint(1, VOCAB, (2, 6), generator=gen)
    assert split(ids).hidden_states is None
    split.model.config.output_hidden_states = True  # through a view of a submodule: the same object
    assert ref.config.output_hidden_states is False  # (ref is a copy: its own config)
    ref.config.output_hidden_states = True
    with torch.no_grad():
        got, expected = split(ids).hidden_states, ref(ids).hidden_states
        assert len(got) == len(expected) == 3
        for a, b in zip(got, expected):
            assert rel_err(a, b) < 1e-5
        split.config.output_hidden_states = False  # through the split model
        assert split(ids).hidden_states is None


def test_every_shard_holds_the_same_configuration_objects():
    ref = tiny_model("llama")
    split = split_copy(ref, 3)
    config = split.config
    assert split.model.config is config and split.model.layers[1].self_attn.config is config
    for shard in split.module_shards:
        assert shard.config is config and shard.model.config is config
        assert all(layer.self_attn.config is config for layer in shard.model.layers)
        assert shard.generation_config is split.generation_config
    assert isinstance(config, T.LlamaConfig) and type(config).__name__ == "LlamaConfig"
    assert config == ref.config  # compares as a LlamaConfig (dataclass equality)
    plain = copy.deepcopy(config)  # a copy is a plain LlamaConfig: a new model may change anything in it
    assert type(plain) is T.LlamaConfig and plain == config
    plain.hidden_size = 64


def test_a_changed_use_cache_reaches_every_device(gen):
    ref = tiny_model("llama")
    split = split_copy(ref, 2)
    ids = torch.randint(1, VOCAB, (1, 4), generator=gen)
    split.model.config.use_cache = False
    seen = []
    hooks = [shard.model.register_forward_hook(lambda m, a, kw, out: seen.append(out.past_key_values), with_kwargs=True)
             for shard in split.module_shards]
    assert split(ids).past_key_values is None
    assert seen == [None, None]  # each device's model ran without building a cache
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("name, field, value", [
    ("llama", "num_attention_heads", 8), ("llama", "num_key_value_heads", 1), ("llama", "hidden_size", 64),
    ("llama", "intermediate_size", 64), ("llama", "vocab_size", 128), ("llama", "head_dim", 4),
    ("llama", "num_hidden_layers", 3), ("gpt2", "n_head", 8), ("gpt2", "num_attention_heads", 8),  # its alias
    ("gpt2", "n_embd", 64), ("t5", "d_kv", 4), ("t5", "num_heads", 8), ("t5", "d_ff", 64),
    ("mixtral", "num_local_experts", 2),
])
def test_a_field_that_sizes_the_split_is_refused_when_set(name, field, value):
    ref = tiny_model(name)
    split = split_copy(ref, 2)
    before = getattr(split.config, field)
    for config in (split.config, split.module_shards[1].config):  # (views reach the same object)
        with pytest.raises(FrozenBySplitError, match=rf"{field}.*split over 2 device.*before splitting"):
            setattr(config, field, value)
        with pytest.raises(AttributeError):  # it is both a ValueError and an AttributeError
            config.update({field: value})
    assert getattr(split.config, field) == before
    setattr(split.config, field, before)  # the same value: nothing changes, nothing to refuse
    split.config.pad_token_id = 1  # other fields stay settable
    split.config.use_cache = False


def test_phi3_per_device_head_count_and_set_attn_implementation(gen):
    """Phi-3 reads config.num_attention_heads to slice its fused q|k|v: each attention module sees a view
    of the shared config holding its device's head count; every other field is the shared one's, so
    set_attn_implementation after splitting reaches them."""
    ref = tiny_model("phi3")  # 8 heads, 2 KV heads
    split = split_copy(ref, 3)
    views = [shard.model.layers[0].self_attn.config for shard in split.module_shards]
    assert [v.num_attention_heads for v in views] == [2, 2, 4] and split.config.num_attention_heads == 8
    assert all(isinstance(v, T.Phi3Config) for v in views)
    split.set_attn_implementation("eager")
    ref.set_attn_implementation("eager")
    assert [v._attn_implementation for v in views] == ["eager"] * 3
    ids = torch.randint(1, VOCAB, (2, 6), generator=gen)
    with torch.no_grad():
        assert rel_err(split(ids).logits, ref(ids).logits) < 1e-5
    split.model.layers[0].self_attn.config.output_hidden_states = True  # not a local field: the shared one
    assert split.config.output_hidden_states is True
    with pytest.raises(AttributeError, match="its device's own value"):
        split.model.layers[0].self_attn.config.num_attention_heads = 4
    with pytest.raises(FrozenBySplitError, match="the plan gives every device its own value"):
        split.config.num_attention_heads = 4


def _load_sweep():
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "coverage.py"
    spec = importlib.util.spec_from_file_location("coverage_sweep", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["coverage_sweep"] = module
    spec.loader.exec_module(module)
    return module


def test_multimodal_sub_configs_are_shared_and_guarded():
    """LLaVA: text_config and vision_config are the very objects every device's language model and vision
    tower read; set_attn_implementation reaches both on every device; their sizes are refused."""
    ref, _, inputs = _load_sweep().build("llava", "image-text-to-text")
    split = split_copy(ref, 2)
    text, vision = split.config.text_config, split.config.vision_config
    for shard in split.module_shards:
        assert shard.model.language_model.config is text and shard.model.vision_tower.config is vision
    split.set_attn_implementation("eager")
    ref.set_attn_implementation("eager")
    assert all(s.model.language_model.config._attn_implementation == "eager" for s in split.module_shards)
    with torch.no_grad():
        assert rel_err(split(**inputs).logits, ref(**inputs).logits) < 1e-5
    for config in (text, vision, split.model.vision_tower.config):
        with pytest.raises(FrozenBySplitError, match="hidden_size"):
            config.hidden_size = 2 * config.hidden_size


# --- attributes of submodules -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_attributes_set_through_a_view_reach_every_device(n, gen):
    ref = tiny_model("llama")
    split = split_copy(ref, n)
    ids = torch.randint(1, VOCAB, (2, 6), generator=gen)
    layers = split.model.layers
    assert len(layers) == 2 and [type(v) for v in layers] == [type(layers[0])] * 2 and bool(layers)
    assert layers[-1] is layers[1] and layers[:1] == [layers[0]]
    # a flag, a scaling factor, an epsilon: each device's copy gets it
    layers[1].self_attn.scaling = ref.model.layers[1].self_attn.scaling = 0.05
    split.model.norm.variance_epsilon = ref.model.norm.variance_epsilon = 0.5
    layers[0].self_attn.is_causal = ref.model.layers[0].self_attn.is_causal = True
    assert [s.model.layers[1].self_attn.scaling for s in split.module_shards] == [0.05] * n
    # a buffer replaced by assignment: each device its own copy
    inv_freq = ref.model.rotary_emb.inv_freq * 0.5
    split.model.rotary_emb.inv_freq = inv_freq
    ref.model.rotary_emb.inv_freq = inv_freq.clone()
    held = [s.model.rotary_emb.inv_freq for s in split.module_shards]
    assert all(torch.equal(t, inv_freq) for t in held) and len({t.data_ptr() for t in held}) == n
    assert "inv_freq" in split.module_shards[0].model.rotary_emb._buffers
    with torch.no_grad():
        assert rel_err(split(ids).logits, ref(ids).logits) < 1e-5
        assert rel_err(split(ids).logits, tiny_model("llama")(ids).logits) > 1e-3  # the changes mattered


def test_what_a_view_cannot_set_is_refused():
    ref = tiny_model("llama")
    split = split_copy(ref, 2)
    attn = split.model.layers[0].self_attn
    with pytest.raises(AttributeError, match=r"q_proj.out_features holds each device's own value.*\(48, 24\)"):
        attn.q_proj.out_features = 72  # the plan set 48 and 24
    with pytest.raises(AttributeError, match="own value"):
        attn.q_proj.out_features = 48  # device 0's value, but not device 1's
    with pytest.raises(AttributeError, match="forward"):
        attn.o_proj.forward = lambda x: x  # the plan's forward (its all-reduce)
    with pytest.raises(NotImplementedError, match=r"load_state_dict\(\{'model.norm.weight'"):
        split.model.norm.weight = torch.nn.Parameter(torch.ones(72))
    with pytest.raises(NotImplementedError, match="submodules cannot be replaced"):
        split.model.layers[0].mlp = torch.nn.Identity()
    with pytest.raises(AttributeError, match="set its fields"):
        split.model.config = copy.deepcopy(split.config)
    with pytest.raises(AttributeError, match="set its fields"):
        split.config = copy.deepcopy(split.config)
    assert all(s.model.layers[0].self_attn.q_proj.out_features == f for s, f in zip(split.module_shards, (48, 24)))


def test_model_attributes_and_generation_config_reach_every_device(gen):
    ref = tiny_model("llama")
    split = split_copy(ref, 2)
    wanted = T.GenerationConfig(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    split.generation_config = wanted
    ref.generation_config = copy.deepcopy(wanted)
    assert all(s.generation_config is wanted for s in split.module_shards)
    ids = torch.randint(1, VOCAB, (1, 4), generator=gen)
    assert torch.equal(split.generate(ids), ref.generate(ids)) and split.generate(ids).shape[1] == 7
    split.loss_type = "ForCausalLM"
    assert all(s.loss_type == "ForCausalLM" for s in split.module_shards)


def test_a_split_buffer_replaced_by_assignment_gives_each_device_its_slice():
    """(A plan that splits a buffer: the rotary frequencies here, only to check where the slices go.)"""
    ref = tiny_model("llama")
    plan = tp.preset_for(ref) | {"model.rotary_emb": tp.ShardParams(params={"inv_freq": 0}, input="split", output="split")}
    split = split_copy(ref, 3, plan=plan)
    whole = torch.arange(4.0)  # inv_freq has head_dim / 2 = 4 entries: 2 + 1 + 1 over 3 devices
    split.model.rotary_emb.inv_freq = whole
    assert [s.model.rotary_emb.inv_freq.tolist() for s in split.module_shards] == [[0.0, 1.0], [2.0], [3.0]]
    with pytest.raises(ValueError, match=r"unsplit shape \[4\], not \[2\]"):
        split.model.rotary_emb.inv_freq = whole[:2]
    assert [s.model.rotary_emb.inv_freq.tolist() for s in split.module_shards] == [[0.0, 1.0], [2.0], [3.0]]
