"""Parameter counts under torchrun. A parallelized model's parameters are DTensors whose numel() is their global
size, so where every rank's slice is as long, transformers' ``num_parameters`` and PEFT's
``get_nb_trainable_parameters`` (LoRA before or after `parallelize`) are the unsplit model's, with no help from
tensorshard (the in-process engine needs its own: tests/integrations/transformers/test_parameter_count.py).

An uneven split is stored padded (comm/dtensor.py: 9 heads over 2 ranks are 2 x 5 heads' rows), and the
global size counts that padding: a known limitation (docs/transformers.md, "Parameter counts")."""

import copy

import pytest

import tensorshard as tp
from support.harness import world_mesh
from support.hf_configs import tiny_model

pytestmark = pytest.mark.timeout(120)

COUNTS = [{}, {"only_trainable": True}, {"exclude_embeddings": True}]


def count_task(family: str) -> dict:
    from peft import LoraConfig, get_peft_model

    def lora(model):
        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    mesh = world_mesh()
    ref = tiny_model(family)
    model = tp.parallelize(copy.deepcopy(ref), mesh)
    counts = {"bare": ([model.num_parameters(**o) for o in COUNTS], [ref.num_parameters(**o) for o in COUNTS])}
    peft_ref = lora(tiny_model(family))
    counts["peft-then-split"] = (tp.parallelize(copy.deepcopy(peft_ref), mesh).get_nb_trainable_parameters(),
                                 peft_ref.get_nb_trainable_parameters())
    counts["split-then-peft"] = (lora(tp.parallelize(tiny_model(family), mesh)).get_nb_trainable_parameters(),
                                 peft_ref.get_nb_trainable_parameters())
    return {k: (list(a), list(b)) for k, (a, b) in counts.items()}


@pytest.mark.parametrize("family", [
    "mistral",  # 8 heads in 2 KV groups, 88 MLP features: every slice as long over 2 ranks
    pytest.param("llama", marks=pytest.mark.xfail(strict=True, reason="9 heads over 2 ranks: padded DTensors count their padding")),
])
def test_parameter_counts_are_the_unsplit_models(pool2, family):
    for result in pool2.run(count_task, family, timeout=100):
        for case, (got, want) in result.items():
            assert got == want, case
