"""Encoder layouts plan inference must read without a preset (issue 15): Megatron-BERT's attention, whose
head counts live in a submodule (``attention.self``) beside the output projection (``attention.output``);
a BERT-like decoder whose forward fills a KV cache it makes itself (the self-check must not run a region on
a cache the traced pass already filled); BART's classifier, which pools at the eos token and builds its own
decoder inputs; Ovis2's visual embedding table, an Embedding fed the vision tower's probabilities (not ids),
which must stay whole. Each split without a plan at 2 and 3 devices: logits within 1e-5 (fp32, relative) of
the unsplit model, and every block's attention and MLP split."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from support.helpers import rel_err, split_copy
from tensorshard.plan_inference.model_inputs import model_input_candidates

pytestmark = pytest.mark.timeout(120)


def _load_sweep():
    """benchmarks/coverage.py (the sweep's tiny configs), loaded by path under another name."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "coverage.py"
    spec = importlib.util.spec_from_file_location("coverage_sweep", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["coverage_sweep"] = module
    spec.loader.exec_module(module)
    return module


coverage = _load_sweep()


def _styles(model) -> dict[str, str]:
    return {k: type(v).__name__ for k, v in model.plan.items()}


@pytest.mark.parametrize("n", [2, 3])
def test_megatron_bert_splits_heads_counted_in_a_submodule(n):
    ref, _, inputs = coverage.build("megatron-bert", "masked-lm")
    model = split_copy(ref, n)
    heads = model.plan["bert.encoder.layer.*.attention"]
    # q, k, v reshape with attention.self's counts; the owner (attention) holds none of them
    assert heads.attrs == {"self.num_attention_heads": "heads", "self.all_head_size": "features"}
    styles = _styles(model)
    for layer in ("attention.self.query", "attention.self.value", "intermediate.dense"):
        assert styles[f"bert.encoder.layer.*.{layer}"] == "ColwiseParallel"
    for layer in ("attention.output.dense", "output.dense"):
        assert styles[f"bert.encoder.layer.*.{layer}"] == "RowwiseParallel"
    with torch.no_grad():
        assert rel_err(model(**inputs).logits, ref(**inputs).logits) < 1e-5


@pytest.mark.parametrize("n", [2, 3])
def test_decoder_that_makes_its_own_cache_passes_the_self_check(n):
    """MegatronBertForCausalLM (is_decoder) creates a DynamicCache inside its forward and hands it to each
    layer: the captured cache is the one the layer saw, and each self-check run appends to its own copy."""
    ref, _, inputs = coverage.build("megatron-bert", "causal-lm")
    model = split_copy(ref, n)
    styles = _styles(model)
    assert styles["bert.encoder.layer.*.attention"] == "Heads"
    assert styles["bert.encoder.layer.*.intermediate.dense"] == "ColwiseParallel"
    assert "kept whole" not in " ".join(model.plan.whole.get(f"bert.encoder.layer.{i}.output.dense", "") for i in (0, 1))
    with torch.no_grad():
        assert rel_err(model(**inputs).logits, ref(**inputs).logits) < 1e-5
        ids = inputs["input_ids"][:1]
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False),
                           ref.generate(ids, max_new_tokens=5, do_sample=False))


def test_bart_classifier_input_ends_in_eos_without_decoder_ids():
    ref, cfg, _ = coverage.build("bart", "sequence-classification")
    runs = []
    for kwargs in model_input_candidates(ref, torch.Generator().manual_seed(0)):
        try:
            with torch.no_grad():
                ref(**kwargs)
            runs.append(kwargs)
        except Exception:
            pass
    first = runs[0]
    assert "decoder_input_ids" not in first and bool((first["input_ids"][:, -1] == cfg.eos_token_id).all())
    assert int((first["input_ids"] == cfg.eos_token_id).sum()) == first["input_ids"].shape[0]  # one eos each


@pytest.mark.parametrize("n", [2, 3])
def test_bart_classifier_splits_without_a_plan(n, gen):
    ref, cfg, _ = coverage.build("bart", "sequence-classification")
    model = split_copy(ref, n)
    styles = _styles(model)
    assert styles["model.encoder.layers.*.self_attn"] == "Heads" and styles["model.decoder.layers.*.fc1"] == "ColwiseParallel"
    ids = torch.randint(4, 500, (3, 9), generator=gen)
    ids[:, -1] = cfg.eos_token_id
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5


@pytest.mark.parametrize("n", [2, 3])
def test_an_embedding_fed_probabilities_is_not_split_by_vocabulary(n):
    ref, _, inputs = coverage.build("ovis2", "image-text-to-text")
    assert "pixel_values" in inputs
    model = split_copy(ref, n)
    assert "model.visual_embeddings_table" not in model.plan.assign(ref)
    assert type(model.plan.assign(ref)["model.language_model.embed_tokens"].style).__name__ == "EmbeddingParallel"
    with torch.no_grad():
        assert rel_err(model(**inputs).logits, ref(**inputs).logits) < 1e-5


def test_an_embedding_called_with_floats_is_not_a_lookup():
    """Traced with a float input, an Embedding subclass that multiplies it with its table plays no lookup
    role, so plan inference never splits it by vocabulary."""
    from torch import nn

    class SoftTable(nn.Embedding):
        def forward(self, x):
            return x @ self.weight if x.is_floating_point() else super().forward(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = SoftTable(24, 16)
            self.out = nn.Linear(16, 8)

        def forward(self, ids):  # soft one-hot rows made from the input ids themselves
            soft = torch.nn.functional.one_hot(ids, 24).float().mul(0.9).add(0.1 / 24)
            return self.out(self.table(soft))

    from tensorshard.plan_inference.infer import infer

    report = infer(Model(), 2, example_inputs=(torch.randint(0, 24, (2, 5)),), check=True)
    assert report.trace.layers["table"].roles == {"soft"}  # not "embedding": no vocabulary split candidate
    assert "table" not in dict(report.plan.items())
