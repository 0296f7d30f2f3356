"""Layers with a forward of their own (plan_inference/own_forward.py): a weight-standardized convolution (BiT's)
normalizes each filter over its input channels, so it must never be cut by input channels (row); cut by
output channels with the output gathered it is exact. Parity (fp32) at 2 and 3 devices, forward and after
training steps, and one all-gather per such convolution forward."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tensorshard as tp
from support.helpers import check_training_parity, rel_err, split_copy

pytestmark = pytest.mark.timeout(120)


class StdConv2d(nn.Conv2d):
    """Weight standardization: each output channel's filter to zero mean, unit variance."""

    def forward(self, x):
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        std = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False).add(1e-6).sqrt()
        return F.conv2d(x, (w - mean) / std, self.bias, self.stride, self.padding)


class StdBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = StdConv2d(8, 24, 1)
        self.norm = nn.GroupNorm(6, 24)
        self.conv2 = StdConv2d(24, 8, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.relu(self.norm(self.conv1(x))))


@pytest.mark.parametrize("n", [2, 3])
def test_weight_standardized_convs_split_by_output_and_gather(n, gen):
    torch.manual_seed(0)
    ref = StdBlock()
    model = split_copy(ref, n)
    assert {k: v.describe() for k, v in model.plan.items()} == {
        "conv1": "ColwiseParallel(gather_output=True)", "conv2": "ColwiseParallel(gather_output=True)"}
    x = torch.randn(2, 8, 6, 6, generator=gen)
    with tp.count_collectives() as fwd:
        y = model(x)
    assert fwd.counts == {"all_gather": 2}
    assert rel_err(y, ref(x)) < 1e-5
    assert max(sum(p.numel() for p in s.parameters()) for s in model.module_shards) < sum(p.numel() for p in ref.parameters())
    check_training_parity(ref, model, lambda: torch.randn(2, 8, 6, 6, generator=gen))


def test_a_row_split_of_a_weight_standardized_conv_is_refused():
    """The data flow alone pairs conv1 -> conv2 like plain convolutions; the self-check refuses the row cut
    through conv2's standardization (never silently wrong), and only then are the outputs gathered."""
    from tensorshard.plan_inference.infer import infer

    torch.manual_seed(0)
    unchecked = {k: v.describe() for k, v in infer(StdBlock(), 2, check=False).plan.items()}
    assert unchecked["conv2"].startswith("RowwiseParallel(")
    checked = infer(StdBlock(), 2, check=True).plan
    assert not any(type(s).__name__ == "RowwiseParallel" for _, s in checked.items())


@pytest.mark.parametrize("n", [2, 3])
def test_bit_splits_every_weight_standardized_conv(n, gen):
    from transformers import BitConfig, BitForImageClassification

    config = BitConfig(embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1], num_groups=4, num_labels=5,
                       layer_type="bottleneck", global_padding="SAME")
    torch.manual_seed(0)
    ref = BitForImageClassification(config).eval()
    model = split_copy(ref, n)
    styles = {k: v.describe() for k, v in model.plan.items()}
    convs = [name for name, m in ref.named_modules() if type(m).__name__ == "WeightStandardizedConv2d"]
    assert all(model.plan.assign(ref)[c].style.describe() == "ColwiseParallel(gather_output=True)" for c in convs), styles
    x = torch.randn(2, 3, 32, 32, generator=gen)
    with torch.no_grad():
        assert rel_err(model(pixel_values=x).logits, ref(pixel_values=x).logits) < 1e-5
