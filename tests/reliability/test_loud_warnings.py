"""Silent where a user needs to know, class 9: a split that splits nothing, only the ends or little of the
model warns (WARNING, shown by default) naming the largest layers left whole and why; so does a call
without devices on a machine without GPUs, which uses one device."""

import copy
import logging

import pytest
import torch
from torch import nn

import tensorshard as tp

pytestmark = pytest.mark.timeout(60)

REPORT = "tensorshard.engines.split_report"


def conv_net() -> nn.Sequential:
    """A norm over all channels (GroupNorm with one group) after every convolution mixes all of its output
    features, so nothing can be split. (BatchNorm between convolutions, resnet's pattern, used to be the
    example here; it splits by channels since ChannelParallel.)"""
    def block(c):
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(1, c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(1, c))

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(1, 16), block(16), block(16), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()


class Lm(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.body = nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.Linear(128, 32))
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == REPORT and r.levelno == logging.WARNING]


def test_a_split_of_nothing_warns_with_the_reasons(caplog):
    with caplog.at_level(logging.WARNING):
        tp.tensor_parallel(conv_net(), ["cpu"] * 2)
    (message,) = warnings_of(caplog)  # before: one INFO line, hidden by default
    assert "0 module(s) split, 0 plan entries. The plan splits nothing: each device holds the whole model." in message
    assert "Largest layers left whole: 2.0 (Conv2d, 2,320 parameters): plan inference kept it whole (" in message


def test_a_split_of_only_the_ends_warns(caplog):
    plan = {"embed": tp.EmbeddingParallel(), "head": tp.ColwiseParallel(gather_output=True)}
    with caplog.at_level(logging.WARNING):
        tp.tensor_parallel(Lm(), ["cpu"] * 2, plan=plan)
    (message,) = warnings_of(caplog)
    assert "The plan splits only the ends (embeddings, output head)" in message
    assert "Largest layers left whole: body.0 (Linear, 4,224 parameters): no plan entry matches it" in message


def test_a_real_split_logs_one_info_line(caplog):
    with caplog.at_level(logging.INFO):
        tp.tensor_parallel(nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8)), ["cpu"] * 2,
                           plan={"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()})
    assert not warnings_of(caplog)
    assert any("2 module(s) split" in r.getMessage() for r in caplog.records if r.name == REPORT)


def test_no_devices_without_gpus_warns(caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        model = tp.tensor_parallel(nn.Sequential(nn.Linear(8, 8)))
    assert model.world_size == 1
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert messages == [
        "no device list given and no GPU is visible: using one CPU device, so nothing is split. Pass the devices, "
        "e.g. tp.tensor_parallel(model, ['cpu', 'cpu']) to simulate two on this machine."
    ]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_layers_no_style_splits_stay_whole_at_any_device_count(caplog, gen, n):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.ConvTranspose1d(4, 8, 3), nn.ReLU(), nn.ConvTranspose1d(8, 4, 3)).eval()
    with caplog.at_level(logging.WARNING):
        split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n)  # before: refused, "nothing to split"
    assert len(split.plan) == 0
    x = torch.randn(2, 4, 9, generator=gen)
    assert torch.equal(split(x), ref(x))
    if n > 1:
        (message,) = warnings_of(caplog)
        assert "The plan splits nothing" in message and "2 (ConvTranspose1d, 100 parameters): no style splits a ConvTranspose1d" in message


def torchrun_ends_only_task() -> list[str]:
    import torch.distributed as dist

    from support.harness import world_mesh

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger(REPORT)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        plan = {"embed": tp.EmbeddingParallel(), "head": tp.ColwiseParallel(gather_output=True)}
        tp.parallelize(Lm(), world_mesh(), plan=plan)
    finally:
        log.removeHandler(handler)
    return [f"{r.levelname} {r.getMessage()}" for r in records] if dist.get_rank() == 0 else records


def test_under_torchrun_rank_0_warns_once(pool2):
    on_rank0, on_rank1 = pool2.run(torchrun_ends_only_task)
    (message,) = on_rank0
    assert message.startswith("WARNING parallelized Lm over 2 rank(s) of mesh [0, 1]: 2 module(s) split")
    assert "The plan splits only the ends (embeddings, output head)" in message and "body.0 (Linear" in message
    assert on_rank1 == []
