"""A split transformers model stays a transformers model: class, config, generate, the sharded KV cache,
embedding and encoder views, save_pretrained, training, and clear errors for what it does not support."""

import copy
import inspect
import os

import pytest
import torch
import transformers as T
from transformers import DynamicCache, StaticCache

import tensorshard as tp
from tensorshard.integrations.transformers import rank_caches
from support.helpers import rel_err
from support.hf_configs import VOCAB, tiny_config, tiny_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def llama():
    """9 query heads in 3 KV groups (SmolLM2's layout), and its split over 2 CPU slots (6 + 3 heads)."""
    ref = tiny_model("llama")
    return ref, tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2)


def test_split_model_is_an_instance_of_its_class(llama):
    ref, model = llama
    assert isinstance(model, T.LlamaForCausalLM) and isinstance(model, tp.TensorParallel)
    assert type(model).__name__ == "TensorParallelLlamaForCausalLM"
    assert model.config.num_attention_heads == 9  # the caller's config, untouched
    assert model.generation_config.pad_token_id == ref.generation_config.pad_token_id
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.can_generate() and not model.training
    assert list(inspect.signature(model.forward).parameters)[:2] == ["input_ids", "attention_mask"]
    # a submodule is a view running that part of every shard (transformers' own code reaches into
    # self.model: Whisper's generate, a VLM's base_model.get_image_features); plain attributes come from shard 0
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert rel_err(model.model(input_ids=ids).last_hidden_state, ref.model(input_ids=ids).last_hidden_state) < 1e-5
    assert isinstance(model.model.norm, tp.TensorParallel) and model.model.norm.variance_epsilon == ref.model.norm.variance_epsilon


def test_positional_arguments_and_inputs_embeds(llama, gen):
    ref, model = llama
    ids = torch.randint(1, VOCAB, (2, 6), generator=gen)
    expected = ref(ids).logits
    assert rel_err(model(ids).logits, expected) < 1e-5
    embeds = model.get_input_embeddings()(ids)  # runs the vocabulary-split embedding on both devices
    assert rel_err(embeds, ref.get_input_embeddings()(ids)) < 1e-6
    assert rel_err(model(inputs_embeds=embeds).logits, expected) < 1e-5


def test_each_device_caches_only_its_heads(llama, gen):
    ref, model = llama
    ids = torch.randint(1, VOCAB, (1, 5), generator=gen)
    out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, pad_token_id=0, return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 8
    kv_heads = [layer.keys.shape[1] for c in rank_caches(cache) for layer in c.layers[:1]]
    assert kv_heads == [2, 1]  # 3 KV heads: 2 on the first device, 1 on the second


def test_manual_decoding_loop(llama, gen):
    """The cache a call returns, or an empty DynamicCache passed in, carries over to the next call."""
    ref, model = llama
    ids = torch.randint(1, VOCAB, (2, 5), generator=gen)
    step = torch.randint(1, VOCAB, (2, 1), generator=gen)
    ref_out = ref(ids, use_cache=True)
    expected = ref(step, past_key_values=ref_out.past_key_values).logits

    out = model(ids, use_cache=True)
    assert rel_err(model(step, past_key_values=out.past_key_values).logits, expected) < 1e-5

    cache = DynamicCache()
    model(ids, past_key_values=cache)
    assert cache.get_seq_length() == 5  # the caller's object now holds the split model's state
    assert rel_err(model(step, past_key_values=cache).logits, expected) < 1e-5


def test_caches_it_cannot_use_are_refused_and_others_used(llama, gen):
    ref, model = llama
    ids = torch.randint(1, VOCAB, (1, 4), generator=gen)
    foreign = ref(ids, use_cache=True).past_key_values  # keys of all 3 KV heads: divided by heads, not refused
    model(ids, past_key_values=foreign)  # (test_unsplit_cache.py checks the numbers and refusals)
    assert foreign.get_seq_length() == 8
    # a static cache is used, each device's copy allocated with its own heads (test_static_cache.py: generate)
    static = model(ids, past_key_values=StaticCache(config=ref.config, max_cache_len=16)).logits
    assert torch.allclose(static, ref(ids, past_key_values=StaticCache(config=ref.config, max_cache_len=16)).logits, atol=1e-5)
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(ids, output_attentions=True)
    with pytest.raises(NotImplementedError, match="resize the unsplit model"):
        model.resize_token_embeddings(128)


def test_use_cache_from_the_callers_config(llama, gen):
    _, model = llama
    ids = torch.randint(1, VOCAB, (1, 4), generator=gen)
    assert model(ids).past_key_values is not None
    model.config.use_cache = False  # the shards hold copies of the config; the wrapper passes it on
    assert model(ids).past_key_values is None


def test_t5_encoder_view_and_generate(gen):
    ref = tiny_model("t5")
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 3)  # 9 heads: 3 per device
    ids = torch.randint(1, VOCAB, (2, 6), generator=gen)
    encoder = model.get_encoder()
    assert encoder is model.get_encoder()
    assert rel_err(encoder(input_ids=ids).last_hidden_state, ref.get_encoder()(input_ids=ids).last_hidden_state) < 1e-5
    generate = dict(max_new_tokens=8, min_new_tokens=8)
    assert torch.equal(model.generate(ids, **generate), ref.generate(ids, **generate))


@pytest.mark.parametrize("name, n", [("llama", 3), ("gemma", 2)])  # gemma: 1 KV head, replicated on both
def test_save_pretrained_writes_an_unsplit_checkpoint(name, n, gen, tmp_path):
    config = tiny_config(name)
    config.tie_word_embeddings = True
    ref = tiny_model(name, config)
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n)
    ids = torch.randint(1, VOCAB, (2, 6), generator=gen)
    out = tmp_path / "out"

    model.save_pretrained(out)
    plain = T.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(plain) is type(ref) and plain.config.architectures == [type(ref).__name__]
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, ref(ids).logits)  # the same weights, bit for bit

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # the next save must hold the trained weights
    model.eval()
    (out / "model-00001-of-00002.safetensors").write_text("stale")  # as if from an earlier, sharded save
    model.save_pretrained(out)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the temporary folder is gone
    assert not (out / "model-00001-of-00002.safetensors").exists()

    plain = T.AutoModelForCausalLM.from_pretrained(out).eval()
    with tp.save_tensor_parallel(model):
        gathered = model.state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(value, gathered[key]), key
    with torch.no_grad():
        assert rel_err(plain(ids).logits, model(ids).logits) < 1e-5
        assert rel_err(plain(ids).logits, ref(ids).logits) > 1e-3  # the step changed the weights

    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match="a file of that name exists"):
        model.save_pretrained(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "not a folder"


def test_adamw_steps_match_the_unsplit_model(llama, gen):
    ref, model = llama
    ref.train(), model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(3):
        ids = torch.randint(1, VOCAB, (2, 8), generator=gen)
        losses = []
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1])


def test_beam_search_and_several_samples(llama, gen):
    """Beam search reorders the cache on every device; num_return_sequences expands it."""
    ref, model = llama
    ids = torch.randint(1, VOCAB, (2, 5), generator=gen)
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    assert torch.equal(model.generate(ids, **beams), ref.generate(ids, **beams))
    samples = []
    for m in (model, ref):
        torch.manual_seed(3)
        samples.append(m.generate(ids, do_sample=True, num_return_sequences=3, max_new_tokens=6, pad_token_id=0))
    assert torch.equal(*samples)


def test_streamed_load_gives_the_same_kind_of_model(llama, gen, tmp_path):
    """tp.from_pretrained (weights streamed into the shards) goes through tensor_parallel(): the result
    is a transformers model too, with generate()."""
    ref, model = llama
    model.save_pretrained(tmp_path)
    loaded = tp.from_pretrained(tmp_path, ["cpu"] * 3, progress=False)
    assert type(loaded).__name__ == "TensorParallelLlamaForCausalLM" and not loaded.training
    ids = torch.randint(1, VOCAB, (1, 4), generator=gen)
    generate = dict(max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    assert torch.equal(loaded.generate(ids, **generate), ref.generate(ids, **generate))


def _tiny_reformer():
    from transformers import ReformerConfig, ReformerModelWithLMHead

    torch.manual_seed(0)
    config = ReformerConfig(
        attention_head_size=16, attn_layers=["local", "lsh"], axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32],
        feed_forward_size=128, hidden_size=64, is_decoder=True, max_position_embeddings=256, num_attention_heads=4,
        vocab_size=512, num_hidden_layers=2, hidden_dropout_prob=0.0,
    )
    return ReformerModelWithLMHead(config).eval()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_a_cache_class_of_the_models_own_gets_one_copy_per_device(n):
    """Reformer's ReformerDynamicCache is not a transformers Cache. Shared by the devices, each appended its
    own states to it, and greedy decoding went off after a few tokens; now every device keeps its own."""
    model = _tiny_reformer()
    prompt = torch.randint(1, 512, (1, 4), generator=torch.Generator().manual_seed(1))
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * n)
    assert torch.equal(split.generate(prompt, max_new_tokens=8, do_sample=False), expected)
    filled = model(prompt, use_cache=True).past_buckets_states  # filled by the unsplit model
    with pytest.raises(ValueError, match="already holds state"):
        split(prompt[:, -1:], past_buckets_states=filled, use_cache=True)
