"""`from_pretrained` reads checkpoints in the hub's key layout, which transformers 5 converts on load:
transformers' own ``save_pretrained`` writes Mixtral's experts one by one (``block_sparse_moe.experts.0.w1``,
w2, w3: the model holds them stacked and w1|w3 concatenated in ``mlp.experts.gate_up_proj``) and ViT under
its old names (``encoder.layer.0.attention.attention.query``: the model has ``layers.0.attention.q_proj``).
Before, the converted tensors were reported "still empty". Every family goes through transformers'
description of its conversion (checkpoint/conversions.py), so Dinov2's one-to-many `Chunk` is covered too.

Tolerance: 1e-5 relative against the unsplit model (fp32: the split sums in another order); transformers'
own reload must match the unsplit model exactly.
"""

import copy

import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)


def tiny_mixtral():
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )
    return transformers.MixtralForCausalLM(config)


def tiny_vit():
    config = transformers.ViTConfig(
        hidden_size=48, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=16,
        patch_size=8, num_labels=5,
    )
    return transformers.ViTForImageClassification(config)


def tiny_dinov2():  # SwiGLU: weights_in is stored fused, the model has gate_proj and up_proj (Chunk)
    config = transformers.Dinov2Config(
        hidden_size=48, num_hidden_layers=1, num_attention_heads=4, image_size=16, patch_size=8, use_swiglu_ffn=True,
    )
    return transformers.Dinov2Model(config)


FAMILIES = {"mixtral": tiny_mixtral, "vit": tiny_vit, "dinov2": tiny_dinov2}


def inputs(family: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    if family == "mixtral":
        return {"input_ids": torch.randint(0, 96, (2, 7), generator=gen)}
    return {"pixel_values": torch.randn(2, 3, 16, 16, generator=gen)}


def output(model, family: str) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs(family))
    return out.last_hidden_state if family == "dinov2" else out.logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (unsplit model, {"one": folder, "several": folder}), written by transformers' save_pretrained."""
    out = {}
    for family, build in FAMILIES.items():
        torch.manual_seed(0)
        model = build().eval()
        root = tmp_path_factory.mktemp(family)
        model.save_pretrained(root / "one")
        model.save_pretrained(root / "several", max_shard_size="20KB")
        out[family] = model, {"one": root / "one", "several": root / "several"}
    return out


def test_save_pretrained_writes_the_hub_layout(saved):
    from safetensors import safe_open

    stored = {}
    for family in ("mixtral", "vit"):
        with safe_open(str(saved[family][1]["one"] / "model.safetensors"), "pt") as f:
            stored[family] = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in stored["mixtral"]
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored["mixtral"]
    assert "vit.encoder.layer.0.attention.attention.query.weight" in stored["vit"]
    assert len(list(saved["vit"][1]["several"].glob("*.safetensors"))) > 1
    assert (saved["mixtral"][1]["several"] / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("layout", ["one", "several"])
@pytest.mark.parametrize("family", ["mixtral", "vit"])
def test_hub_layouts_load_split_like_transformers(saved, family, layout):
    model, folders = saved[family]
    ref = output(model, family)
    theirs = output(type(model).from_pretrained(folders[layout]).eval(), family)
    assert torch.equal(theirs, ref)
    for devices in (2, 3):
        split = tp.from_pretrained(folders[layout], ["cpu"] * devices, progress=False)
        got = output(split, family)  # before: RuntimeError "... are still empty: model.layers.0.mlp.gate.weight"
        assert rel_err(got, ref) < 1e-5 and rel_err(got, theirs) < 1e-5, (family, layout, devices)


def test_a_fused_stored_tensor_split_into_several_model_tensors(saved):
    model, folders = saved["dinov2"]
    split = tp.from_pretrained(folders["one"], ["cpu"] * 2, progress=False)
    assert rel_err(output(split, "dinov2"), output(model, "dinov2")) < 1e-5


def test_checkpoints_in_the_models_names_stream_unconverted(saved, tmp_path):
    from tensorshard.checkpoint.conversions import HubConversions
    from tensorshard.checkpoint.sources import SafetensorsSource

    model, _ = saved["mixtral"]
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 2)
    tp.save_gathered(split, tmp_path / "gathered", progress=False)  # the model's own (fused) names
    model.config.save_pretrained(tmp_path / "gathered")
    source = SafetensorsSource.from_hf_folder(tmp_path / "gathered")
    assert HubConversions.of(model).wrap(source) is source  # read box by box, nothing built whole
    loaded = tp.from_pretrained(tmp_path / "gathered", ["cpu"] * 3, progress=False)
    assert rel_err(output(loaded, "mixtral"), output(model, "mixtral")) < 1e-5


def torchrun_task(folders: dict) -> dict:
    from support.harness import world_mesh

    mesh = world_mesh()
    loaded = {family: tp.from_pretrained(folder, mesh=mesh, progress=False) for family, folder in folders.items()}
    return {family: output(model, family) for family, model in loaded.items()}


def test_hub_layouts_load_under_torchrun(saved, pool2):
    folders = {"mixtral": str(saved["mixtral"][1]["several"]), "vit": str(saved["vit"][1]["one"])}
    for result in pool2.run(torchrun_task, folders):  # converted before the in-place split, read per rank
        for family, got in result.items():
            assert rel_err(got, output(saved[family][0], family)) < 1e-5, family


def test_a_conversion_it_cannot_apply_is_refused_before_loading(saved, monkeypatch):
    from transformers.core_model_loading import ConversionOps

    from tensorshard.checkpoint import conversions

    class Dequantize(ConversionOps):  # stands for an operation that is not a function of whole tensors
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            raise AssertionError("must not run")

    real = conversions.HubConversions.of

    def with_unknown_op(module):
        hub = real(module)
        for t in hub.transforms:
            if hasattr(t, "operations"):
                t.operations = [Dequantize()]
        return hub

    monkeypatch.setattr(conversions.HubConversions, "of", staticmethod(with_unknown_op))
    _, folders = saved["mixtral"]
    with pytest.raises(ValueError) as err:
        tp.from_pretrained(folders["one"], ["cpu"] * 2, progress=False)
    message = str(err.value)
    assert "model.layers.0.mlp.experts" in message and "block_sparse_moe.experts.0.w" in message
    assert "Dequantize" in message and "tp.tensor_parallel" in message and "Nothing was loaded" in message
