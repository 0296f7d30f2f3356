import copy, tempfile
import pytest
import torch
import tensorshard as tp
from support.harness import world_mesh

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

def task(kind, folder):
    import torch.distributed as dist
    from support import tiny_llama
    from peft import LoraConfig, IA3Config, PeftModel, get_peft_model
    cfgs = {"lora": LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False),
            "dora": LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, use_dora=True),
            "ia3": IA3Config(target_modules=TARGETS, feedforward_modules=["down_proj", "up_proj"], init_ia3_weights=False),
            "mts": LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False, use_rslora=True, modules_to_save=["lm_head"])}
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    out = {}
    # before order
    torch.manual_seed(0)
    ref = get_peft_model(tiny_llama.build(), copy.deepcopy(cfgs[kind]))
    model = tp.parallelize(copy.deepcopy(ref), world_mesh())
    with torch.no_grad():
        w = ref(input_ids=ids).logits
        out["before"] = ((model(input_ids=ids).logits - w).norm() / w.norm()).item()
    model.save_pretrained(f"{folder}/b", is_main_process=dist.get_rank() == 0)
    # late order
    torch.manual_seed(0)
    late = get_peft_model(tp.parallelize(tiny_llama.build(), world_mesh()), copy.deepcopy(cfgs[kind]))
    late.save_pretrained(f"{folder}/late")
    dist.barrier()
    ref2 = PeftModel.from_pretrained(tiny_llama.build(), f"{folder}/late", is_trainable=True)
    with torch.no_grad():
        w = ref2(input_ids=ids).logits
        out["late"] = ((late(input_ids=ids).logits - w).norm() / w.norm()).item()
    # from_pretrained onto a parallelized base
    loaded = PeftModel.from_pretrained(tp.parallelize(tiny_llama.build(), world_mesh()), f"{folder}/late", is_trainable=True)
    with torch.no_grad():
        out["loaded"] = ((loaded(input_ids=ids).logits - w).norm() / w.norm()).item()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (late, ref2, loaded)]
    losses = []
    for step in range(3):
        row = []
        for m, o in zip((late, ref2, loaded), opts):
            l = m(input_ids=ids, labels=ids).loss
            l.backward(); o.step(); o.zero_grad(); row.append(l.item())
        losses.append(row)
    out["losses"] = losses
    return out

@pytest.mark.parametrize("kind", ["lora", "dora", "ia3", "mts"])
@pytest.mark.parametrize("world", [2, 3])
def test_scratch(pool2, pool3, world, kind, tmp_path):
    pool = pool2 if world == 2 else pool3
    for r in pool.run(task, kind, str(tmp_path)):
        print(world, kind, r)
        assert r["before"] < 1e-5 and r["late"] < 1e-5 and r["loaded"] < 1e-5
        for a, b, c in r["losses"]:
            assert abs(a - b) <= 1e-4 * abs(b) and abs(c - b) <= 1e-4 * abs(b)
