"""Lightning: a LightningModule that does not split its model under ModelParallelStrategy gets a clear
error before the first step, not N ranks each training the whole model (2-process gloo pool).

Rows of the Lightning table in docs/errors.md; `test_docs_rows_match_the_cases` keeps them in step.
"""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch

from support import ROOT, lightning_example as ex

pytestmark = pytest.mark.timeout(120)

DOCS = ROOT / "docs" / "errors.md"


class NoHook(ex.LitModel):
    configure_model = L.LightningModule.configure_model  # the hook left as Lightning's default


class ReturnsEarly(ex.LitModel):
    def configure_model(self):
        if self.device_mesh is not None and self.device_mesh.size() > 8:  # a condition that is never true here
            super().configure_model()


class Whole(ex.LitModel):
    def configure_model(self):
        return None  # parallelizes nothing: the training is not split


def fit(model_class: str, strategy: str) -> tuple[str, str]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from tensorshard.integrations.lightning import TensorParallelStrategy

    strategies = {"TensorParallelStrategy": TensorParallelStrategy, "ModelParallelStrategy": ModelParallelStrategy}
    L.seed_everything(0)
    model = {"LitModel": ex.LitModel, "NoHook": NoHook, "ReturnsEarly": ReturnsEarly, "Whole": Whole}[model_class]()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategies[strategy](), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    try:
        trainer.fit(model)
    except Exception as e:  # noqa: BLE001 - compared by the test
        assert not isinstance(model.model.w1.weight, torch.distributed.tensor.DTensor)  # no step ran split
        return type(e).__name__, str(e)
    assert isinstance(model.model.w1.weight, torch.distributed.tensor.DTensor)
    return "no error", ""


CASES = {
    # id: (LightningModule, strategy, error type, message excerpt)
    "no-configure-model": ("NoHook", "TensorParallelStrategy", TypeError,
                           "NoHook has no configure_model() hook: under TensorParallelStrategy the model is split there. Add def configure_model(self): tp.parallelize(self.model, self.device_mesh['tensor_parallel'], plan=plan)"),
    "configure-model-returns-early": ("ReturnsEarly", "TensorParallelStrategy", RuntimeError,
                                      "ReturnsEarly.configure_model() left the model whole: no parameter is split over the 2 ranks of the tensor-parallel mesh"),
    "configure-model-splits-nothing": ("Whole", "TensorParallelStrategy", RuntimeError,
                                       "Whole.configure_model() left the model whole"),
    "no-configure-model-lightning-strategy": ("NoHook", "ModelParallelStrategy", TypeError,
                                              "When using the ModelParallelStrategy, you are required to override the `configure_model()` hook"),
}


@pytest.mark.parametrize("id", list(CASES))
def test_lightning_rejected(id, pool2):
    model_class, strategy, error, excerpt = CASES[id]
    for kind, message in pool2.run(fit, model_class, strategy):
        assert kind == error.__name__, message
        assert excerpt in message, message


def test_a_split_model_trains_under_the_checking_strategy(pool2):
    assert pool2.run(fit, "LitModel", "TensorParallelStrategy") == [("no error", "")] * 2


def test_docs_rows_match_the_cases():
    rows = {m.group(1): line for line in DOCS.read_text().splitlines() for m in re.finditer(r"test_lightning_rejected\[([\w-]+)\]", line)}
    assert set(rows) == set(CASES)
    for id, (_, _, error, excerpt) in CASES.items():
        assert f"`{error.__name__}`" in rows[id] and excerpt in rows[id], id
