"""PEFT under torchrun: a PeftModel parallelized with the inner model's preset, prefixed, every adapter
following its base layer's split; it trains like the unsplit PeftModel (losses after three AdamW steps
within 1e-4 relative) with the bare model's collectives plus one bucketed all-reduce of partial gradients
per backward pass. LoRA, rsLoRA, DoRA, IA3 and LoRA with modules_to_save, added before or after
`parallelize` or loaded onto a parallelized base, all through PEFT's own API; what cannot follow the split
is refused before anything changes."""

import copy

import pytest
import torch

import tensorshard as tp
from support.harness import world_mesh
from support.helpers import train_causal_lms

pytestmark = pytest.mark.timeout(120)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_task() -> dict:
    from support import tiny_llama
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    ref = get_peft_model(tiny_llama.build(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    model = tp.parallelize(copy.deepcopy(ref), world_mesh())
    assert "base_model.model.model.layers.*.self_attn.o_proj.lora_A.*" in model.tensorshard.plan
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    losses, counts = [], None
    for step in range(4):
        with tp.count_collectives() as c:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        counts = counts or (dict(c.forward), dict(c.backward), [w for phase, _, _, w in c.log if phase == "backward"])
        loss_ref = ref(input_ids=ids, labels=ids).loss
        loss_ref.backward()
        losses.append((loss.item(), loss_ref.item()))
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    return {"losses": losses, "counts": counts}


@pytest.mark.parametrize("world", [2, 3])
def test_lora_trains_like_unsplit(pool2, pool3, world):
    pool = pool2 if world == 2 else pool3
    for result in pool.run(lora_task):
        for got, want in result["losses"]:
            assert abs(got - want) <= 1e-4 * abs(want)
        forward, backward, where = result["counts"]
        # As the bare preset, no collective per adapter. Forward: embedding 1 + 2 per block, and for labels= the
        # loss from vocabulary slices (2 all-reduces of per-token numbers; the logits are not gathered unless read).
        # Backward: one per column-layer input that needs a gradient (the first block's attention reads the frozen
        # embedding's output: none there) = 3 + the head's input, and ONE bucket of partial gradients (the whole
        # LoRA factors: A beside column layers, B beside row layers). On 3 ranks the 2 KV heads are replicated: the
        # rows of k_proj's and v_proj's B for a shared head sum their gradient over its holders (tie), 2 per block,
        # as the bare model's k/v weights do when they train.
        ties = 0 if world == 2 else 2 * 2
        assert forward == {"all_reduce": 5 + 2}
        assert backward == {"all_reduce": 4 + 1 + ties}
        assert sum("partial gradients" in w for w in where) == 1


METHODS = ("lora", "rslora", "dora", "ia3", "lora+lm_head")


def peft_config(method: str):
    from peft import IA3Config, LoraConfig

    if method == "ia3":  # up_proj and down_proj scaled by their inputs, the others by their outputs
        return IA3Config(target_modules=TARGETS, feedforward_modules=["up_proj", "down_proj"], init_ia3_weights=False)
    options = {"rslora": {"use_rslora": True}, "dora": {"use_dora": True}, "lora+lm_head": {"modules_to_save": ["lm_head"]}}
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, **options.get(method, {}))


def methods_task(method: str, folder: str) -> dict:
    """One PEFT method in both orders and loaded onto a parallelized base, through PEFT's own API; each against
    the unsplit PeftModel holding the same adapter. Every saved adapter is read back by plain PEFT, unsplit."""
    import torch.distributed as dist
    from peft import PeftModel, get_peft_model
    from support import tiny_llama

    ids = torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    main = dist.get_rank() == 0

    def err(model, ref) -> float:
        with torch.no_grad():
            want = ref(input_ids=ids).logits
            return ((model(input_ids=ids).logits - want).norm() / want.norm()).item()

    def plain(path: str):
        dist.barrier()  # rank 0 wrote it
        return PeftModel.from_pretrained(tiny_llama.build(), path, is_trainable=True)

    out = {}
    torch.manual_seed(1)
    made = get_peft_model(tiny_llama.build(), peft_config(method))  # an adapter made unsplit
    if main:
        made.save_pretrained(f"{folder}/made")
    reference = plain(f"{folder}/made")
    loaded = PeftModel.from_pretrained(tp.parallelize(tiny_llama.build(), world_mesh()), f"{folder}/made", is_trainable=True)
    pairs = {
        "adapter then split": (tp.parallelize(copy.deepcopy(made), world_mesh()), copy.deepcopy(made)),
        "loaded onto a split base": (loaded, reference),
    }
    torch.manual_seed(1)
    late = get_peft_model(tp.parallelize(tiny_llama.build(), world_mesh()), peft_config(method))
    late.save_pretrained(f"{folder}/late")  # every rank calls it; rank 0 writes
    pairs["split then adapter"] = (late, plain(f"{folder}/late"))
    models = [m for pair in pairs.values() for m in pair]
    out["logits"] = {route: err(model, ref) for route, (model, ref) in pairs.items()}
    losses = train_causal_lms(models, [ids] * 3)
    out["losses"] = {route: [(row[2 * i], row[2 * i + 1]) for row in losses] for i, route in enumerate(pairs)}
    out["saved"] = {}
    for route, (model, _) in pairs.items():  # after training: PEFT's format, the split model's logits
        model.save_pretrained(f"{folder}/{route}")
        out["saved"][route] = err(model, plain(f"{folder}/{route}"))
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world", [2, 3])
def test_peft_methods_in_both_orders_under_torchrun(pool2, pool3, world, method, tmp_path):
    """At 3 ranks the tiny Llama's 2 KV heads are replicated: the adapters' rows for them stay consistent."""
    pool = pool2 if world == 2 else pool3
    for result in pool.run(methods_task, method, str(tmp_path)):
        assert max(result["logits"].values()) < 1e-5, result["logits"]
        for route, losses in result["losses"].items():
            for got, want in losses:
                assert abs(got - want) <= 1e-4 * abs(want), (route, losses)
        assert max(result["saved"].values()) < 1e-5, result["saved"]


def refused_task() -> tuple[str, bool]:
    from peft import LoHaConfig, PromptTuningConfig, TaskType, get_peft_model
    from support import tiny_llama

    prompt = get_peft_model(tiny_llama.build(), PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))
    try:
        tp.parallelize(prompt, world_mesh())
        return "prompt tuning accepted", False
    except NotImplementedError as e:
        assert "prompt-learning" in str(e)
    model = tp.parallelize(tiny_llama.build(), world_mesh())
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    try:
        get_peft_model(model, LoHaConfig(r=4, target_modules=["q_proj"]))
        message = "accepted"
    except NotImplementedError as e:
        message = str(e)
    with torch.no_grad():
        return message, torch.equal(model(input_ids=ids).logits, before)


def test_unsupported_adapter_after_parallelize_is_refused_before_anything_changes(pool2):
    """Prompt tuning when parallelizing; LoHa when PEFT adds it to a parallelized model, which stays as it was."""
    for message, unchanged in pool2.run(refused_task):
        assert "LoHa adapters cannot follow the split" in message and unchanged


def save_task(folder: str) -> str:
    import torch.distributed as dist
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    from support import tiny_llama

    torch.manual_seed(0)
    ref = get_peft_model(tiny_llama.build(), LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False, modules_to_save=["lm_head"]))
    model = tp.parallelize(copy.deepcopy(ref), world_mesh())
    model.save_pretrained(f"{folder}/adapter", state_dict=None, is_main_process=dist.get_rank() == 0)
    bare = tp.parallelize(tiny_llama.build(), world_mesh())
    bare.save_pretrained(f"{folder}/model", state_dict=None, safe_serialization=True, max_shard_size="100KB")
    dist.barrier()
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(tiny_llama.build(), f"{folder}/adapter").eval()
        err = (loaded(input_ids=ids).logits - ref.eval()(input_ids=ids).logits).norm() / ref(input_ids=ids).logits.norm()
        plain = AutoModelForCausalLM.from_pretrained(f"{folder}/model").eval()
        err_model = (plain(ids).logits - tiny_llama.build()(ids).logits).norm() / plain(ids).logits.norm()
    return f"{err.item():.1e} {err_model.item():.1e}"


def test_save_pretrained_under_torchrun(pool2, tmp_path):
    for result in pool2.run(save_task, str(tmp_path)):
        adapter, model = map(float, result.split())
        assert adapter < 1e-5 and model < 1e-5  # PEFT's format and the unsplit checkpoint, both loaded by plain code


def switching_task() -> list[float]:
    """PEFT's own merge/unmerge/disable on the parallelized PeftModel (DTensor parameters)."""
    from support import tiny_llama
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    ref = get_peft_model(tiny_llama.build(), LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False)).eval()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh()).eval()
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    errors = []
    with torch.no_grad():
        for step in ("merge_adapter", "unmerge_adapter", "disable_adapter_layers", "enable_adapter_layers", "merge_adapter"):
            getattr(model, step)()
            getattr(ref, step)()
            want = ref(input_ids=ids).logits
            errors.append(((model(input_ids=ids).logits - want).norm() / want.norm()).item())
    return errors


def test_adapters_merge_and_switch_under_torchrun(pool2):
    for errors in pool2.run(switching_task):
        assert max(errors) < 1e-5, errors
