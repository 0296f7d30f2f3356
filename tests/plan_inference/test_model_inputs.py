"""The inputs plan inference builds when none is given: from a transformers model's main input and config,
and from the receptive field of a convolution stack (issue 14, item 5)."""

import pytest
import torch
from torch import nn

import tensorshard as tp
from support.helpers import rel_err, split_copy
from tensorshard.plan_inference.inputs import input_candidates, synthetic_inputs
from tensorshard.plan_inference.model_inputs import model_input_candidates, receptive_field

pytestmark = pytest.mark.timeout(60)


class DilatedStack(nn.Module):
    """Unpadded dilated convolutions (WaveNet-style): the input must cover a 31-sample receptive field."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(*(nn.Conv1d(8, 8, 3, dilation=d) for d in (1, 2, 4, 8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.convs(x)


def test_receptive_field_of_a_chain():
    assert receptive_field([(3, 1, 1), (3, 1, 2), (3, 1, 4), (3, 1, 8)]) == (31, 1)
    assert receptive_field([(7, 2), (3, 2), (3, 1)]) == (7 + 2 * 2 + 2 * 4, 4)


@pytest.mark.parametrize("n", [2, 3])
def test_dilated_conv1d_stack_gets_an_input_long_enough(n, gen):
    ref = DilatedStack()
    plan = tp.infer_plan(ref, n)
    assert {k: type(v).__name__ for k, v in plan.items()} == {
        "convs.0": "ColwiseParallel", "convs.1": "RowwiseParallel", "convs.2": "ColwiseParallel", "convs.3": "RowwiseParallel"}
    model = split_copy(ref, n)
    x = torch.randn(2, 8, 40, generator=gen)
    assert rel_err(model(x), ref(x)) < 1e-5


def test_transposed_convolutions_get_an_input():
    model = nn.Sequential(nn.ConvTranspose1d(4, 8, 3), nn.ReLU(), nn.ConvTranspose1d(8, 4, 3))
    (x,), _ = synthetic_inputs(model)
    assert x.shape[:2] == (2, 4)
    assert len(tp.infer_plan(model, 2)) == 0  # nothing it can split, and no error about its input


def test_images_at_the_config_size():
    from transformers import ViTConfig, ViTModel

    model = ViTModel(ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                               image_size=24, patch_size=8, num_channels=2))
    _, kwargs = synthetic_inputs(model)
    assert set(kwargs) == {"pixel_values"} and kwargs["pixel_values"].shape == (2, 2, 24, 24)


def test_whisper_features_and_decoder_ids():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=10,
                           max_source_positions=12, max_target_positions=32, decoder_start_token_id=7,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = WhisperForConditionalGeneration(config)
    kwargs = next(model_input_candidates(model, torch.Generator().manual_seed(0)))
    assert kwargs["input_features"].shape == (2, 10, 24)  # mel bins x twice the encoder positions
    assert kwargs["decoder_input_ids"].shape == (2, 4) and bool((kwargs["decoder_input_ids"][:, 0] == 7).all())
    assert "decoder_inputs_embeds" not in kwargs and kwargs["use_cache"] is False


def test_encoder_decoder_that_cannot_shift_its_inputs_gets_decoder_ids():
    """Pegasus builds no decoder inputs from input_ids: the synthetic input must carry them."""
    from transformers import PegasusConfig, PegasusForConditionalGeneration

    config = PegasusConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)
    model = PegasusForConditionalGeneration(config).eval()
    plan = tp.infer_plan(model, 2)
    assert any(type(style).__name__ == "Heads" for _, style in plan.items())


def test_plain_models_keep_their_inputs():
    """A model without a config keeps the layer-shaped guesses (ids, (2, 5, in_features), images)."""
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 6))
    (x,), kwargs = next(iter(input_candidates(model)))
    assert x.shape == (2, 5, 6) and kwargs == {}


class _ScaledAttention(nn.Module):
    """Attention whose softmax scale comes from the head count, (C / h) ** -0.5: a structure-only plan splits
    its heads, and every device would scale by its own C."""

    def __init__(self, d: int = 96, h: int = 6) -> None:
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = (p(x).view(b, n, self.h, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = ((q @ k.transpose(-1, -2)) * (c / self.h) ** -0.5).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


class _ClsNet(nn.Module):
    """A class token and positional embeddings: it runs only on sequences of 8, so it needs example_inputs."""

    def __init__(self, d: int = 96) -> None:
        super().__init__()
        self.cls, self.pos = nn.Parameter(torch.randn(1, 1, d)), nn.Parameter(torch.randn(1, 9, d))
        self.inp, self.attn, self.out = nn.Linear(20, d), _ScaledAttention(d), nn.Linear(d, 4)

    def forward(self, x):
        x = self.inp(x)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.out((x + self.attn(x))[:, 0])


def test_the_plan_inferred_from_example_inputs_is_self_checked_by_default(gen):
    torch.manual_seed(0)
    ref = _ClsNet()
    x = torch.randn(2, 8, 20, generator=gen)
    with pytest.raises(RuntimeError, match=r"example_inputs=\(x,\)"):  # what the refusal says to do
        split_copy(ref, 2)
    plan = tp.infer_plan(ref, 2, example_inputs=(x,))  # before: unchecked, 1e-2 off with no word
    assert rel_err(split_copy(ref, 2, plan=plan)(x), ref(x)) < 1e-5
    assert "attn" not in " ".join(plan)  # the heads' split failed the check: kept whole
    unchecked = tp.infer_plan(ref, 2, example_inputs=(x,), check=False)
    assert rel_err(split_copy(ref, 2, plan=unchecked)(x), ref(x)) > 1e-3  # what the check caught
