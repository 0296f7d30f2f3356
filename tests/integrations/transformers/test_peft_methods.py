"""The PEFT methods people pick (LoRA, rsLoRA, DoRA, IA3, LoRA with modules_to_save) in the in-process engine,
in both orders and loaded onto a split base, through PEFT's own API only (get_peft_model, save_pretrained,
PeftModel.from_pretrained, load_adapter), at 2 and 3 devices.

Each split model is compared with the unsplit PeftModel holding the same adapter: logits within 1e-5 relative,
losses after three AdamW steps within 1e-4 relative (fp32); every adapter the split model saves loads into an
unsplit base with plain PEFT and gives the split model's logits. docs/finetuning.md's table cites these tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import tensorshard as tp
from support.hf_configs import FAMILIES
from support.helpers import rel_err, split_copy, train_causal_lms

pytestmark = pytest.mark.timeout(120)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
METHODS = {  # random init where PEFT allows it: the adapter changes the output from the first step
    "lora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False),
    "rslora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, use_rslora=True),
    "dora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, use_dora=True),
    # up_proj scaled by its inputs (whole beside a column layer), down_proj too (split beside a row layer), the
    # others by their outputs (split beside column layers, whole beside o_proj)
    "ia3": lambda: IA3Config(target_modules=TARGETS, feedforward_modules=["up_proj", "down_proj"], init_ia3_weights=False),
    "lora+lm_head": lambda: LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False, modules_to_save=["lm_head"]),
}


def tiny():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES["llama"][0]())


def split(n: int):
    return tp.tensor_parallel(tiny(), ["cpu"] * n)  # train mode: ZeRO-3 for the whole parameters, as by default


def ids(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(seed))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids()).logits


def train(models) -> list[list[float]]:
    """Three AdamW steps on each model; each step's losses, in the models' order."""
    return train_causal_lms(models, [ids(10 + step) for step in range(3)])


def assert_trains_like(model, ref) -> None:
    assert rel_err(logits(model), logits(ref)) < 1e-5
    for got, want in train([model, ref]):
        assert abs(got - want) <= 1e-4 * abs(want)


def assert_saved_adapter_loads_unsplit(model, folder) -> None:
    """PEFT's own save_pretrained of the split model; plain PEFT loads it into an unsplit base: same logits."""
    model.save_pretrained(folder)
    plain = PeftModel.from_pretrained(tiny(), folder)
    assert rel_err(logits(plain.eval()), logits(model.eval())) < 1e-5
    model.train()


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("method", METHODS)
def test_adapter_then_split(method, n, tmp_path):
    torch.manual_seed(1)
    ref = get_peft_model(tiny(), METHODS[method]())
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n)  # train mode: ZeRO-3 on, as by default
    assert_trains_like(model, ref)
    assert_saved_adapter_loads_unsplit(model, tmp_path / "adapter")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("method", METHODS)
def test_split_then_adapter(method, n, tmp_path):
    torch.manual_seed(1)
    model = get_peft_model(split(n), METHODS[method]())  # PEFT's own call on the split model
    assert isinstance(model, PeftModel)
    model.save_pretrained(tmp_path / "start")  # the adapter the split model adopted, for the unsplit reference
    ref = PeftModel.from_pretrained(tiny(), tmp_path / "start", is_trainable=True)
    assert_trains_like(model, ref)
    assert_saved_adapter_loads_unsplit(model, tmp_path / "trained")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("method", METHODS)
def test_adapter_made_unsplit_loads_onto_a_split_base(method, n, tmp_path):
    torch.manual_seed(1)
    made = get_peft_model(tiny(), METHODS[method]())
    made.save_pretrained(tmp_path / "made")
    ref = PeftModel.from_pretrained(tiny(), tmp_path / "made", is_trainable=True)
    model = PeftModel.from_pretrained(split(n), tmp_path / "made", is_trainable=True)  # each device its slices
    assert_trains_like(model, ref)
    # PeftModel.load_adapter: a second adapter, made unsplit, into the split model, then switched to
    model.load_adapter(tmp_path / "made", adapter_name="second")
    ref.load_adapter(tmp_path / "made", adapter_name="second")
    for m in (model, ref):
        m.set_adapter("second")
    assert rel_err(logits(model), logits(ref)) < 1e-5


def test_dora_magnitude_after_splitting_is_peft_initial_norm(tmp_path):
    """Adopted after splitting, DoRA's magnitude is ||W + s B A|| per output row of the adapter the devices now
    share (local row norms beside column layers, summed squares beside row layers), as PEFT initialises it."""
    torch.manual_seed(1)
    model = get_peft_model(split(3), METHODS["dora"]())
    model.save_pretrained(tmp_path)
    plain = PeftModel.from_pretrained(tiny(), tmp_path)
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"):  # column, row
        layer = plain.get_base_model().get_submodule(name)
        norm = (layer.base_layer.weight + layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight).norm(dim=1)
        assert rel_err(layer.lora_magnitude_vector["default"].weight, norm) < 1e-6, name


def test_dora_beside_a_row_layer_adds_one_all_reduce_of_row_norms():
    lora = get_peft_model(tiny(), METHODS["lora"]())
    dora = get_peft_model(tiny(), METHODS["dora"]())
    counts = []
    for ref in (lora, dora):
        model = split_copy(ref, 2)
        with tp.count_collectives() as c:
            model(input_ids=ids(), labels=ids()).loss.backward()
        counts.append((dict(c.forward), dict(c.backward), [w for phase, _, _, w in c.log if phase == "forward"]))
    (lora_fwd, lora_bwd, _), (dora_fwd, dora_bwd, where) = counts
    rows = 2 * 2  # o_proj and down_proj in each of 2 blocks: one all-reduce of squared norms each
    assert dora_fwd == {**lora_fwd, "all_reduce": lora_fwd["all_reduce"] + rows} and dora_bwd == lora_bwd
    assert sum("DoRA row norms" in w for w in where) == rows


def test_ia3_adds_no_collective():
    """IA3 on k, v (scaling outputs) and down_proj (scaling its split inputs), PEFT's default for llama: the
    collectives of LoRA on the same layers, less LoRA's one reduction of partial gradients."""
    targets = ["k_proj", "v_proj", "down_proj"]
    lora = split_copy(get_peft_model(tiny(), LoraConfig(r=4, target_modules=targets)), 2)
    ia3 = split_copy(get_peft_model(tiny(), IA3Config(target_modules=targets, feedforward_modules=["down_proj"])), 2)
    counts = []
    for model in (lora, ia3):
        with tp.count_collectives() as c:
            model(input_ids=ids(), labels=ids()).loss.backward()
        counts.append((dict(c.forward), dict(c.backward), sum("partial gradients" in w for _, _, _, w in c.log)))
    (lora_fwd, lora_bwd, lora_partial), (ia3_fwd, ia3_bwd, ia3_partial) = counts
    assert ia3_fwd == lora_fwd and (lora_partial, ia3_partial) == (1, 0)
    assert ia3_bwd == {**lora_bwd, "all_reduce": lora_bwd["all_reduce"] - 1}


def test_merge_adapter_after_splitting_and_dora_row_refusal():
    torch.manual_seed(1)
    model = get_peft_model(split(2), METHODS["lora"]()).eval()
    before = logits(model)
    model.merge_adapter()  # PEFT's own, on every device's slices
    assert rel_err(logits(model), before) < 1e-5
    dora = get_peft_model(split(2), METHODS["dora"]())
    with pytest.raises(NotImplementedError, match="DoRA beside a row-parallel layer"):
        dora.merge_adapter()
    with pytest.raises(NotImplementedError, match="merge_and_unload"):
        dora.merge_and_unload()


def test_transformers_load_adapter_and_save_pretrained_on_a_split_model(tmp_path):
    """transformers' adapter methods on the split model itself: load_adapter (each device its slices) and
    save_pretrained (the adapter, in PEFT's format, as transformers writes it for a model holding adapters)."""
    torch.manual_seed(1)
    made = get_peft_model(tiny(), METHODS["dora"]())
    made.save_pretrained(tmp_path / "made")
    model = tp.tensor_parallel(tiny().eval(), ["cpu"] * 3)
    model.load_adapter(tmp_path / "made")
    assert rel_err(logits(model), logits(made.eval())) < 1e-5
    model.save_pretrained(tmp_path / "again")
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert rel_err(logits(PeftModel.from_pretrained(tiny(), tmp_path / "again")), logits(made)) < 1e-5
    before = logits(model)
    with pytest.raises(NotImplementedError, match="delete_adapter.*rebuilds the module tree"):
        model.delete_adapter("default")  # the split's layout still holds the adapter's tensors
    assert torch.equal(logits(model), before)
