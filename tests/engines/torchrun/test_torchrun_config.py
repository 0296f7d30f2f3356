"""Configuration changed after parallelize(), under torchrun: each process holds its one model, in place, so its
configuration is the one every module reads; what the plan gives each rank its own value of (Phi-3's head
count) is a view over it; fields that size the split are refused when set. The same checks as the in-process
tests (tests/integrations/transformers/test_one_config.py), at 2 and 3 ranks: the unsplit model's outputs with
the same change made to it (fp32, 1e-5 relative)."""

import copy

import pytest
import torch

import tensorshard as tp
from support.classifiers import NAMES, PAD, classifier, padded_batch
from support.harness import world_mesh
from support.helpers import rel_err
from support.hf_configs import VOCAB, tiny_model
from tensorshard.engines.shared_config import FrozenBySplitError

pytestmark = pytest.mark.timeout(180)


def config_task() -> dict:
    mesh = world_mesh()
    gen = torch.Generator().manual_seed(0)
    errors: dict[str, float] = {}
    with torch.no_grad():
        for name in NAMES:
            ref = classifier(name)
            model = tp.parallelize(copy.deepcopy(ref), mesh)
            batch = padded_batch(gen)
            model.config.pad_token_id = ref.config.pad_token_id = PAD
            errors[f"pad {name}"] = rel_err(model(**batch).logits, ref(**batch).logits)

        ref = tiny_model("llama")
        model = tp.parallelize(copy.deepcopy(ref), mesh)
        ids = torch.randint(1, VOCAB, (2, 6), generator=gen)
        model.model.config.output_hidden_states = ref.config.output_hidden_states = True
        got, expected = model(ids).hidden_states, ref(ids).hidden_states
        errors["hidden states"] = max(rel_err(a, b) for a, b in zip(got, expected))
        count = len(got)
        model.model.layers[1].self_attn.scaling = ref.model.layers[1].self_attn.scaling = 0.05  # a flag on a layer
        errors["scaling"] = rel_err(model(ids).logits, ref(ids).logits)
        refused = []
        for field, value in (("num_attention_heads", 8), ("hidden_size", 64), ("vocab_size", 128)):
            try:
                setattr(model.config, field, value)
            except FrozenBySplitError as e:
                refused.append("before splitting" in str(e) and getattr(model.config, field) != value)
        model.config.hidden_size = model.config.hidden_size  # unchanged: accepted

        ref = tiny_model("phi3")
        model = tp.parallelize(copy.deepcopy(ref), mesh)
        model.set_attn_implementation("eager")
        ref.set_attn_implementation("eager")
        attn_config = model.model.layers[0].self_attn.config
        errors["phi3"] = rel_err(model(ids).logits, ref(ids).logits)
    return {"errors": errors, "hidden": count, "refused": refused, "phi3 heads": attn_config.num_attention_heads,
            "phi3 attention": attn_config._attn_implementation, "phi3 config heads": model.config.num_attention_heads}


@pytest.mark.parametrize("world", [2, 3])
def test_configuration_changed_after_parallelize(pool2, pool3, world):
    results = (pool2 if world == 2 else pool3).run(config_task, timeout=150)
    heads = {2: [4, 4], 3: [2, 2, 4]}[world]  # Phi-3's 8 heads in 2 KV groups
    for rank, result in enumerate(results):
        assert all(err < 1e-5 for err in result["errors"].values()), result["errors"]
        assert result["hidden"] == 3 and result["refused"] == [True, True, True]
        assert result["phi3 heads"] == heads[rank] and result["phi3 config heads"] == 8
        assert result["phi3 attention"] == "eager"
