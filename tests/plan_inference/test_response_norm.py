"""ConvNeXt V2's global response norm between its pointwise convolutions (Linear layers, channels last):
split with the channels, its mean over all channels made whole by one all-reduce (styles/channel.py).
Parity (fp32) at 2 and 3 devices in forward and after training steps; a module shaped like a response
norm that computes something else is not taken for one."""

import pytest
import torch
from torch import nn

import tensorshard as tp
from support.helpers import check_training_parity, rel_err, split_copy
from tensorshard.styles.channel import is_response_norm

pytestmark = pytest.mark.timeout(120)


def _convnextv2():
    from transformers import ConvNextV2Config, ConvNextV2ForImageClassification

    config = ConvNextV2Config(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5, image_size=32)
    torch.manual_seed(0)
    model = ConvNextV2ForImageClassification(config)
    with torch.no_grad():  # GRN starts as the identity (zero weight and bias): make it matter
        for m in model.modules():
            if type(m).__name__ == "ConvNextV2GRN":
                m.weight.normal_(0, 0.5)
                m.bias.normal_(0, 0.5)
    return model.eval()


@pytest.mark.parametrize("n", [2, 3])
def test_convnextv2_splits_through_its_response_norm(n, gen):
    ref = _convnextv2()
    model = split_copy(ref, n)
    styles = {k: v.describe() for k, v in model.plan.items()}
    assert styles["convnextv2.encoder.stages.*.layers.*.grn"] == "ChannelParallel()"
    assert styles["convnextv2.encoder.stages.*.layers.*.pwconv1"] == "ColwiseParallel()"
    assert styles["convnextv2.encoder.stages.*.layers.*.pwconv2"] == "RowwiseParallel()"
    grn = model.module_shards[0].convnextv2.encoder.stages[1].layers[0].grn
    assert grn.weight.shape[-1] == (128 + n - 1) // n  # 4 x 32 channels, each device its share
    x = torch.randn(2, 3, 32, 32, generator=gen)
    with tp.count_collectives() as fwd:
        y = model(pixel_values=x).logits
    assert fwd.counts == {"all_reduce": 2 * 2}  # per block: the response norm's mean, the row's sum
    assert rel_err(y, ref(pixel_values=x).logits) < 1e-5
    model.train()
    ref.train()
    check_training_parity(ref, model, lambda: torch.randn(2, 3, 32, 32, generator=gen),
                          output=lambda m, x: m(pixel_values=x).logits)


class ShapedLikeGRN(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, 1, 1, dim))
        self.bias = nn.Parameter(torch.zeros(1, 1, 1, dim))

    def forward(self, x):  # normalizes by the largest channel norm, not the mean
        g = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True)
        return self.weight * (x * g / (g.amax(dim=-1, keepdim=True) + 1e-6)) + self.bias + x


def test_a_module_shaped_like_a_response_norm_is_not_one():
    assert not is_response_norm(ShapedLikeGRN(8))
    model = nn.Sequential(nn.Linear(8, 32), ShapedLikeGRN(32), nn.Linear(32, 8))
    assert not any(type(s).__name__ == "ChannelParallel" for _, s in tp.infer_plan(model, 2, check=True).items())
