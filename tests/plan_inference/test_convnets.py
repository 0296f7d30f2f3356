"""ConvNets and ViTs split by inferred plans: channels through BatchNorm, depthwise convolutions and
squeeze-and-excitation between a column and a row convolution; attention heads and MLPs in a ViT.
Training in train mode (BatchNorm on batch statistics, running statistics updated) matches the unsplit
model: forward 1e-5, after 3 AdamW steps 1e-4 (relative, fp32), and so does eval mode on the running
statistics the steps left."""

import copy

import pytest
import torch

import tensorshard as tp
from support.helpers import check_training_parity, rel_err, split_copy
from support.models import TinyEfficientNet, TinyResNet

pytestmark = pytest.mark.timeout(90)


def _train_then_eval(ref, model, make_input):
    ref.train()
    model.train()
    check_training_parity(ref, model, make_input)
    ref.eval()
    model.eval()
    x = make_input()
    with torch.no_grad():
        assert rel_err(model(x), ref(x)) < 1e-4  # the running statistics were updated alike


@pytest.mark.parametrize("n", [2, 3])
def test_mbconv_channels_pass_batchnorm_depthwise_and_squeeze_excite(n, gen):
    ref = TinyEfficientNet()
    model = split_copy(ref, n)
    styles = {k: v.describe() for k, v in model.plan.items()}
    assert styles == {
        "blocks.*.expand": "ColwiseParallel()", "blocks.*.bn1": "ChannelParallel()",
        "blocks.*.depthwise": "ChannelParallel()", "blocks.*.bn2": "ChannelParallel()",
        "blocks.*.se.reduce": "RowwiseParallel()", "blocks.*.se.expand": "ColwiseParallel()",
        "blocks.*.project": "RowwiseParallel()",
    }
    x = torch.randn(4, 8, 6, 6, generator=gen)
    with tp.count_collectives() as fwd:
        y = model(x)
    with tp.count_collectives() as bwd:
        y.square().mean().backward()
    ref(x)  # the same update of the running statistics as the split model's pass
    # per block: the squeeze's reduce and the projection all-reduce forward; backward, the input gradients
    # of the expansion and of the excitation (both columns), less the first expansion's (x needs no gradient)
    assert fwd.counts == {"all_reduce": 2 * 2} and bwd.counts == {"all_reduce": 2 * 2 - 1}
    shard = model.module_shards[0].blocks[0]
    assert shard.depthwise.groups == shard.depthwise.out_channels == shard.bn1.num_features == shard.bn1.running_mean.numel()
    assert shard.bn1.num_features == (28 + n - 1) // n  # 28 channels: 14/14 or 10/9/9
    model.zero_grad()
    _train_then_eval(ref, model, lambda: torch.randn(4, 8, 6, 6, generator=gen))


@pytest.mark.parametrize("n", [2, 3])
def test_resnet_batchnorm_splits_with_its_convolution(n, gen):
    ref = TinyResNet()
    model = split_copy(ref, n)
    bns = [name for name, m in ref.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assigned = model.plan.assign(ref)
    channel = [name for name in bns if name in assigned and type(assigned[name].style).__name__ == "ChannelParallel"]
    assert channel, "no BatchNorm was split"
    for name in channel:  # each split BatchNorm holds its slice of the statistics
        local = model.module_shards[0].get_submodule(name)
        assert local.running_var.numel() == local.num_features < ref.get_submodule(name).num_features
    whole = sum(p.numel() for p in ref.parameters())
    assert max(sum(p.numel() for p in s.parameters()) for s in model.module_shards) < whole
    _train_then_eval(ref, model, lambda: torch.randn(4, 3, 8, 8, generator=gen))


@pytest.mark.parametrize("n", [2, 3])
def test_vit_splits_heads_and_mlp_and_trains_exactly(n, gen):
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=6,
                       image_size=16, patch_size=4, num_labels=5, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    ref = ViTForImageClassification(config)
    model = split_copy(ref, n)
    styles = {k: type(v).__name__ for k, v in model.plan.items()}
    assert styles["vit.layers.*.attention"] == "Heads"
    assert [styles[f"vit.layers.*.attention.{p}"] for p in ("q_proj", "k_proj", "v_proj", "o_proj")] == [
        "ColwiseParallel", "ColwiseParallel", "ColwiseParallel", "RowwiseParallel"]
    assert [styles["vit.layers.*.mlp.fc1"], styles["vit.layers.*.mlp.fc2"]] == ["ColwiseParallel", "RowwiseParallel"]
    images = lambda: torch.randn(3, 3, 16, 16, generator=gen)  # noqa: E731
    with tp.count_collectives() as fwd:
        model(pixel_values=images())
    assert fwd.counts == {"all_reduce": 2 * 2}  # attention and MLP per block
    check_training_parity(ref.train(), model.train(), images, output=lambda m, x: m(pixel_values=x).logits)


def test_depthwise_with_channel_multiplier_stays_whole(gen):
    """groups == in_channels but out_channels = 2 x in_channels: output channel j reads input j // 2; not
    a ChannelParallel layer (kept whole, so the column before it stays whole too)."""
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 8, 1)
            self.dw = nn.Conv2d(8, 16, 3, padding=1, groups=8)
            self.b = nn.Conv2d(16, 3, 1)

        def forward(self, x):
            return self.b(self.dw(self.a(x)))

    ref = Net()
    plan = tp.infer_plan(ref, 2)
    assert "dw" not in dict(plan.items())
    model = split_copy(ref, 2)
    x = torch.randn(2, 3, 6, 6, generator=gen)
    assert rel_err(model(x), ref(x)) < 1e-5


@pytest.mark.parametrize("n", [2, 3])
def test_groupnorm_splits_on_group_boundaries(n, gen):
    """GroupNorm(4 groups of 6 channels) between two convolutions: each group is one unit, like a head, so
    the channels split 12/12 or 12/6/6 and each device normalises whole groups."""
    from torch import nn
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.gn, self.b = nn.Conv2d(6, 24, 1), nn.GroupNorm(4, 24), nn.Conv2d(24, 6, 3, padding=1)

        def forward(self, x):
            return x + self.b(F.silu(self.gn(self.a(x))))

    ref = Net()
    model = split_copy(ref, n)
    assert type(model.plan["gn"]).__name__ == "ChannelParallel"
    assert [s.gn.num_groups for s in model.module_shards] == ([2, 2] if n == 2 else [2, 1, 1])
    check_training_parity(ref, model, lambda: torch.randn(3, 6, 5, 5, generator=gen))
