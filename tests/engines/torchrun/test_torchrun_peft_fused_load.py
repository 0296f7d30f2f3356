"""A LoRA adapter saved unsplit by plain PEFT, on GPT-2's fused ``c_attn`` (q|k|v in one Conv1D) and on
``c_proj``, loaded under torchrun into a parallelized model through PEFT's own API: each rank takes its q, k
and v blocks of the saved lora_B (rank 0 of 2: rows 0-31, 64-95, 128-159 of 192), not a contiguous chunk,
which PEFT's own DTensor resharding would give it. Even heads (4 over 2: the blocks stored as a tensor of
the saved shape) and uneven ones (9 over 2: 5/4, padded); logits within 1e-5 of plain PEFT, unsplit."""

import copy

import pytest
import torch

import tensorshard as tp
from support.harness import world_mesh

pytestmark = pytest.mark.timeout(120)

VOCAB = 128


def fused_load_task(n_embd: int, n_head: int, folder: str) -> dict[str, float]:
    import torch.distributed as dist
    import transformers as T
    from peft import LoraConfig, PeftModel, get_peft_model

    def config():
        return LoraConfig(r=4, target_modules=["c_attn", "c_proj"], init_lora_weights=False)  # B non-zero

    torch.manual_seed(0)
    base = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_layer=2, n_positions=64, n_embd=n_embd, n_head=n_head)).eval()
    for seed, name in ((1, "first"), (2, "second")):  # two adapters made unsplit
        torch.manual_seed(seed)
        made = get_peft_model(copy.deepcopy(base), config())
        if dist.get_rank() == 0:
            made.save_pretrained(f"{folder}/{name}")
    dist.barrier()
    plain = PeftModel.from_pretrained(copy.deepcopy(base), f"{folder}/first").eval()
    plain.load_adapter(f"{folder}/second", adapter_name="second")
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))

    def err(model, adapter: str) -> float:
        plain.set_adapter(adapter)
        with torch.no_grad():
            return (model.eval()(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max().item()

    out = {}
    loaded = PeftModel.from_pretrained(tp.parallelize(copy.deepcopy(base), world_mesh()), f"{folder}/first")
    out["from_pretrained onto a split base"] = err(loaded, "default")
    loaded.load_adapter(f"{folder}/second", adapter_name="second")
    loaded.set_adapter("second")
    out["load_adapter, set_adapter"] = err(loaded, "second")
    torch.manual_seed(7)  # adapter, then split; then its adapter loaded again (Trainer's resume)
    resumed = tp.parallelize(get_peft_model(copy.deepcopy(base), config()), world_mesh())
    resumed.load_adapter(f"{folder}/first", adapter_name="default")
    out["adapter then split, load_adapter"] = err(resumed, "default")
    return out


@pytest.mark.parametrize("n_embd,n_head", [(64, 4), (72, 9)], ids=["4 heads", "9 heads"])
def test_fused_qkv_adapter_saved_unsplit_loads_by_blocks(pool2, n_embd, n_head, tmp_path):
    for errors in pool2.run(fused_load_task, n_embd, n_head, str(tmp_path)):
        assert max(errors.values()) < 1e-5, errors
