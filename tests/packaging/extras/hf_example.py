"""tensorshard[hf]: a transformers Llama split over 2 CPU slots decodes the unsplit model's tokens."""

import torch
import transformers as T

import tensorshard as tp

torch.manual_seed(0)
config = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
reference = T.LlamaForCausalLM(config).eval()
model = tp.tensor_parallel(T.LlamaForCausalLM(config).eval(), ["cpu", "cpu"])
model.load_state_dict(reference.state_dict())
ids = torch.randint(0, 128, (1, 6))
want = reference.generate(ids, max_new_tokens=5, do_sample=False)
got = model.generate(ids, max_new_tokens=5, do_sample=False)
assert torch.equal(got, want), (got, want)
print("hf ok:", got.tolist())
