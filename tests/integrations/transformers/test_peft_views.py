"""Views of a split model held across PEFT's adapters added after splitting (in-process engine).

A view made before ``get_peft_model(split, LoraConfig(...))`` (``split.model``, ``split.model.layers[1].mlp``,
``split.view(path)``, ``get_input_embeddings()``, a T5's ``get_encoder()``) runs the adapted submodule once the
split model adopted the adapters: its output matches the unsplit PeftModel's submodule (1e-5 relative), its
collectives and the split model's are those of one adoption (the same collectives, bytes and places as a view
made after PEFT, on a model split the same way), and three AdamW steps match the unsplit PeftModel (losses
within 1e-4 relative, fp32). The models are in train mode, so ZeRO-3 partitions the whole parameters and the
adapter's whole factors, as by default.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

import tensorshard as tp
from support.hf_configs import FAMILIES, tiny_config
from support.helpers import rel_err, train_both_causal_lm

pytestmark = pytest.mark.timeout(120)

TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "t5": ["q", "k", "v", "o", "wi", "wo"]}


def tiny(family: str):
    torch.manual_seed(0)
    auto = AutoModelForSeq2SeqLM if FAMILIES[family][1] == "seq2seq" else AutoModelForCausalLM
    return auto.from_config(tiny_config(family))  # dropout off: train-mode calls compare with the unsplit model


def lora(model, family: str):
    torch.manual_seed(1)  # init_lora_weights=False: B is random too, so the adapter matters from the first step
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family], init_lora_weights=False))


def ids(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(seed))


def hidden(width: int) -> torch.Tensor:
    return torch.randn(2, 7, width, generator=torch.Generator().manual_seed(3))


@dataclass
class Kind:
    family: str
    view: Callable  # the split model -> the view
    unsplit: Callable  # the unsplit PeftModel -> the same submodule
    run: Callable  # a view or submodule -> a tensor


def _out(result) -> torch.Tensor:
    return result if isinstance(result, torch.Tensor) else result.last_hidden_state


KINDS = {
    "split.model": Kind("llama", lambda s: s.model, lambda r: r.base_model.model.model,
                        lambda m: _out(m(input_ids=ids()))),
    "split.model.layers[1].mlp": Kind("llama", lambda s: s.model.layers[1].mlp,
                                      lambda r: r.base_model.model.model.layers[1].mlp, lambda m: m(hidden(72))),
    "split.view(path)": Kind("llama", lambda s: s.view("model.layers.0.mlp"),
                             lambda r: r.base_model.model.model.layers[0].mlp, lambda m: m(hidden(72))),
    "get_input_embeddings()": Kind("llama", lambda s: s.get_input_embeddings(),
                                   lambda r: r.base_model.model.get_input_embeddings(), lambda m: m(ids())),
    "get_encoder()": Kind("t5", lambda s: s.get_encoder(), lambda r: r.base_model.model.get_encoder(),
                          lambda m: _out(m(input_ids=ids()))),
}


def train_both(model, ref, steps: int = 3) -> list[tuple[float, float]]:
    """AdamW steps on both; the losses of each step (split, unsplit)."""
    return train_both_causal_lm(model, ref, [ids(10 + step) for step in range(steps)])


def collectives(call) -> Counter:
    """Each collective `call` runs, with its phase, kind, bytes and place."""
    with tp.count_collectives() as c:
        call()
    return Counter(c.log)


def step(model) -> None:
    x = ids(5)
    model(input_ids=x, labels=x).loss.backward()
    model.zero_grad()


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_a_view_made_before_peft_runs_the_adopted_adapter(kind, n, tmp_path):
    k = KINDS[kind]
    split = tp.tensor_parallel(tiny(k.family), ["cpu"] * n)  # train mode: ZeRO-3 on, as by default
    view = k.view(split)  # held while PEFT wraps the layers
    model = lora(split, k.family)  # the split model adopts the adapters
    model.save_pretrained(tmp_path)  # the adapter it adopted, for the unsplit reference
    ref = PeftModel.from_pretrained(tiny(k.family), tmp_path, is_trainable=True)

    # the same split, adapted, then viewed: one adoption for sure
    control = lora(tp.tensor_parallel(tiny(k.family), ["cpu"] * n), k.family)
    control_view = k.view(control.base_model.model)

    with torch.no_grad():
        seen = collectives(lambda: k.run(view))  # the view first: its model's adoption is all it may use
        assert rel_err(k.run(view), k.run(k.unsplit(ref))) < 1e-5
        assert seen == collectives(lambda: k.run(control_view))
    with torch.enable_grad():
        seen = collectives(lambda: step(model))
        assert seen == collectives(lambda: step(control))
        assert sum(1 for _, _, _, where in seen if "partial gradients" in where) == 1  # one reduction, all layers

    with torch.no_grad():
        assert rel_err(model(input_ids=ids(), labels=ids()).logits, ref(input_ids=ids(), labels=ids()).logits) < 1e-5
    for got, want in train_both(model, ref):
        assert abs(got - want) <= 1e-4 * abs(want)
    with torch.no_grad():  # the view runs the trained adapter
        assert rel_err(k.run(view), k.run(k.unsplit(ref))) < 1e-5


def test_views_made_before_peft_read_their_split_model_bookkeeping():
    """The split model called first, then a view and a view of a view: each reads the split model's splits and
    ZeRO-3 partitions below its path, the adapter's included, and adopts nothing of its own."""
    split = tp.tensor_parallel(tiny("llama"), ["cpu"] * 2)
    outer, inner = split.model, split.model.layers[0].mlp
    lora(split, "llama")
    with torch.no_grad():
        split(input_ids=ids())
        outer(input_ids=ids())
        inner(hidden(72))
    for view, path in ((outer, "model."), (inner, "model.layers.0.mlp.")):
        assert view.splits == {k[len(path):]: v for k, v in split.splits.items() if k.startswith(path)}
        assert view.zero_splits == {k[len(path):]: v for k, v in split.zero_splits.items() if k.startswith(path)}
        assert view._module_names == {n for n, _ in view.module_shards[0].named_modules()}
    assert "gate_proj.lora_A.default.weight" in inner.zero_splits  # the adapter's whole factor, partitioned once
    assert inner.splits["gate_proj.base_layer.weight"] == split.splits["model.layers.0.mlp.gate_proj.base_layer.weight"]
