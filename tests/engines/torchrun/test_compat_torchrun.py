"""tensorshard.compat under torchrun: `tensor_parallel(model, tensor_parallel_config=Config)` in a job whose
process group is up splits the model over the ranks (distributed defaults to True there, as in the
original), honours the config (the original ignored it) and returns the module (the original returned a
tuple)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from support.helpers import rel_err
from support.models import Transformer

pytestmark = pytest.mark.timeout(120)


def config_task() -> tuple[float, float, bool]:
    import tensorshard.compat as tp

    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = Transformer(n_heads=8, n_kv_heads=2)
    config = tp.Config(
        state_rules={
            r"attn\.w[qkv]\.weight$": tp.SplitInChunks(world_size=world, dim=0, chunk_size=8),
            r"attn\.wo\.weight$": tp.SplitInChunks(world_size=world, dim=1, chunk_size=8),
            r"ffn\.w[13]\.weight$": "split 0",
            r"ffn\.w2\.weight$": "split 1",
        },
        input_rules={},
        output_rules={r"\.attn$": {0: "sum"}, r"\.ffn\.w2$": {0: "sum"}},
        attr_rules={r"\.attn$": {"n_heads": "scale_int", "n_kv_heads": "scale_int"}},
    )
    model = tp.tensor_parallel(copy.deepcopy(ref), tensor_parallel_config=config)  # distributed: a group is up
    assert isinstance(model, nn.Module) and not isinstance(model, tuple)
    split = isinstance(model.layers[0].attn.wq.weight, DTensor) and model.layers[0].attn.n_heads == 8 // world
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    out, want = model(ids), ref(ids)
    out.pow(2).mean().backward(), want.pow(2).mean().backward()
    grad = model.layers[1].ffn.w2.weight.grad.full_tensor()
    return rel_err(out, want), rel_err(grad, ref.layers[1].ffn.w2.weight.grad), split


def test_a_config_under_torchrun_returns_the_split_module(pool2):
    for out_err, grad_err, split in pool2.run(config_task):
        assert split and out_err < 1e-5 and grad_err < 1e-5


def keep_task() -> tuple[bool, bool, float, bool]:
    import tensorshard.compat as tp

    torch.manual_seed(0)
    module = Transformer(n_heads=8, n_kv_heads=2)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    want = module(ids)
    model = tp.tensor_parallel(module)  # the original left the module as it was; so does compat
    kept = not any(isinstance(p, DTensor) for p in module.parameters()) and torch.equal(module(ids), want)
    split = isinstance(model.layers[0].attn.wq.weight, DTensor)
    consumed = tp.tensor_parallel(module, consume=True)  # tensorshard's way: split in place
    return kept, split, rel_err(model(ids), want), consumed is module


def test_under_torchrun_the_module_stays_as_it_was_unless_consumed(pool2):
    for kept, split, err, in_place in pool2.run(keep_task):
        assert kept and split and err < 1e-5 and in_place
