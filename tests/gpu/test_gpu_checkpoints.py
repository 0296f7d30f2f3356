"""Checkpoints and loads with a GPU among the devices: sharded saves (optimizer included) that reload at another
device list to the bit, gathered saves that transformers reads, and from_pretrained streaming each slice onto
its device, the GPU's peak memory below what the whole model would take."""

import copy

import pytest
import torch
import transformers as T

import tensorshard as tp
from support import plans
from support.checkpoints import build, differ, gathered, probe
from support.gpu import ONE_GPU, assert_on_their_devices
from support.hf_configs import VOCAB, tiny_model
from support.helpers import rel_err

pytestmark = ONE_GPU + [pytest.mark.timeout(300)]


def split(devices, seed: int = 0):
    return tp.tensor_parallel(build(seed), devices, plan=plans.transformer(8, 2), sharded=False)


def train(model, opt, gen, steps: int = 2) -> None:
    for _ in range(steps):
        tokens = torch.randint(0, 96, (2, 7), generator=gen)
        opt.zero_grad()
        model(tokens).square().mean().backward()
        opt.step()


@pytest.mark.parametrize(
    "saved_on, loaded_on",
    [(["cuda:0", "cpu"], ["cpu", "cpu", "cpu"]), (["cpu", "cpu"], ["cuda:0", "cpu", "cpu"]), (["cuda:0", "cpu"], ["cpu", "cuda:0"])],
    ids=["gpu-to-cpu", "cpu-to-gpu", "gpu-to-gpu"],
)
def test_sharded_checkpoint_moves_between_gpu_and_cpu_exactly(saved_on, loaded_on, gen, tmp_path):
    model = split(saved_on)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, gen)
    tp.save_sharded(model, tmp_path / "ckpt", optimizer=opt)
    state = gathered(model)

    other = split(loaded_on, seed=1)  # other weights: the load must replace them all
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    tp.load_sharded(other, tmp_path / "ckpt", optimizer=other_opt, progress=False)
    assert_on_their_devices(other, loaded_on)
    assert other_opt.param_groups[0]["lr"] == 1e-2
    assert differ({k: v.cpu() for k, v in gathered(other).items()}, {k: v.cpu() for k, v in state.items()}) == []
    # the optimizer state came back too: one more step on the same batch moves both alike
    steps = [torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)]
    train(model, opt, steps[0], steps=1)
    train(other, other_opt, steps[1], steps=1)
    assert rel_err(probe(other), probe(model)) < 1e-4


def test_save_pretrained_from_a_gpu_split_is_what_transformers_loads(gen, tmp_path):
    ref = tiny_model("llama")
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cuda:0", "cpu"])
    model.save_pretrained(tmp_path)
    plain = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(1, VOCAB, (2, 6), generator=gen)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, ref(input_ids=ids).logits)  # the same weights, bit for bit


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cpu"], ["cpu", "cuda:0", "cpu"]], ids=["gpu", "gpu+cpu", "cpu+gpu+cpu"])
def test_from_pretrained_streams_each_slice_onto_its_device(devices, gen, tmp_path):
    """The model is built empty and every device reads only its slices from the files: the GPU's peak is its
    own share plus at most the largest tensor being read (docs/checkpoints.md), below the whole model's bytes
    when it has neighbours. Logits and greedy tokens are the unsplit model's. 21 MB of fp32 weights, so the
    allocator's rounding (the 1 MiB allowed) is small beside them."""
    config = T.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(config).eval()
    ref.save_pretrained(tmp_path, max_shard_size="4MB")
    state = ref.state_dict()
    whole, largest = _bytes(state.values()), max(_bytes([t]) for t in state.values())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(0)
    base = torch.cuda.memory_allocated(0)
    model = tp.from_pretrained(tmp_path, devices, progress=False)
    peak = torch.cuda.max_memory_allocated(0) - base
    assert_on_their_devices(model, devices)
    on_gpu = _bytes(list(model.module_shards[devices.index("cuda:0")].parameters()))
    assert peak <= on_gpu + largest + 2**20, (peak, on_gpu, largest)
    if len(devices) > 1:
        assert on_gpu < 0.6 * whole, (on_gpu, whole)
    ids = torch.randint(1, 1024, (2, 9), generator=gen)
    with torch.no_grad():
        assert rel_err(model(input_ids=ids.to(model.device)).logits, ref(input_ids=ids).logits) < 1e-4
    generate = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1].to(model.device), **generate).cpu(), ref.generate(ids[:1], **generate))
