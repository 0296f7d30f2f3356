"""tensorshard[peft]: a LoRA adapter on a Llama split over 2 CPU slots gives the unsplit PeftModel's logits."""

import copy

import torch
import transformers as T
from peft import LoraConfig, get_peft_model

import tensorshard as tp

torch.manual_seed(0)
config = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # B nonzero: the adapter counts
reference = get_peft_model(T.LlamaForCausalLM(config), lora).eval()
model = tp.tensor_parallel(copy.deepcopy(reference), ["cpu", "cpu"])
ids = torch.randint(0, 128, (2, 6))
with torch.no_grad():
    err = (model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item()
assert err < 1e-5, err  # float rounding of the split matmuls
print(f"peft ok: max logit difference {err:.1e}")
