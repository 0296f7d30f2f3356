"""`Heads(attrs={"config.n_head": "heads"})` on a model whose attention reads its head count from a config
object at run time (litgpt, Phi-3): that module sees a view of the config holding its device's count, and the
config's other fields as they are now (styles/local_values.py)."""

import copy
import pickle
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import tensorshard as tp
from support.helpers import rel_err, split_copy
from tensorshard.styles.local_values import LocalValues, local_values, set_local_path, shared_of

pytestmark = pytest.mark.timeout(60)


@dataclass
class Config:
    n_embd: int = 48
    n_head: int = 6
    scale: float = 1.0


class Attention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):  # (B, T, C)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.qkv.out_features // 3, dim=-1)
        heads = self.config.n_head  # read at run time: this device's count when split
        q, k, v = (z.view(b, t, heads, -1).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = torch.softmax(q @ k.transpose(-1, -2) * self.config.scale, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Model(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config  # the same object as every layer's
        self.layers = nn.ModuleList(Attention(config) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


PLAN = {
    "layers.*": tp.Heads(num_heads=6, attrs={"config.n_head": "heads"}),
    "layers.*.qkv": tp.ColwiseParallel(blocks=("q", "q", "q")),
    "layers.*.proj": tp.RowwiseParallel(blocks=("q",)),
}


@pytest.mark.parametrize("n", [2, 3])
def test_a_head_count_read_from_the_config_is_each_devices_own(n, gen):
    torch.manual_seed(0)
    ref = Model(Config()).eval()
    split = split_copy(ref, n, plan=PLAN)
    x = torch.randn(2, 5, 48, generator=gen)
    assert rel_err(split(x), ref(x)) < 1e-5
    for shard in split.module_shards:
        views = [layer.config for layer in shard.layers]
        assert all(type(v) is LocalValues and isinstance(v, Config) for v in views)
        assert all(shared_of(v) is shard.config for v in views) and shard.config.n_head == 6
        assert [v.n_head for v in views] == [6 // n] * 2
    for model in [ref, *split.module_shards]:  # a field the plan left alone: read through the view
        model.config.scale = 0.5
    assert rel_err(split(x), ref(x)) < 1e-5
    view = split.module_shards[0].layers[0].config
    view.scale = 0.25  # written to the shared object
    assert split.module_shards[0].config.scale == 0.25
    with pytest.raises(AttributeError, match="its device's own value"):
        view.n_head = 6


def test_copies_keep_the_local_values():
    shared = Config()
    view = LocalValues(shared, {"n_head": 3})
    for other in (copy.copy(view), pickle.loads(pickle.dumps(view))):
        assert other.n_head == 3 and other.n_embd == 48
    deep = copy.deepcopy(view)
    assert shared_of(deep) is not shared and deep.n_head == 3 and deep == view
    holder = nn.Module()
    holder.config = shared
    holder.twin = copy.deepcopy(holder)
    set_local_path(holder.twin, "config.n_embd", 24)  # a nested view for one module; the object stays as it was
    assert holder.twin.config.n_embd == 24 and local_values(holder.twin.config) == {"n_embd": 24}
    assert shared_of(holder.twin.config).n_embd == 48 and shared.n_embd == 48


class HeadCount(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config

    def forward(self, x):
        return x * self.config.n_head * self.config.scale


def test_torch_compile_reads_the_views_own_value():
    """Dynamo reads a plain object's fields from its ``__dict__``: the view's holds the local values (it was the
    shared object's, so a compiled split Phi-3 sliced its q|k|v with the unsplit head count), and a shared field
    written after the compile is seen (dynamo's guards read the field again through the view)."""
    shared = Config()
    module = HeadCount(shared)
    set_local_path(module, "config.n_head", 3)
    assert vars(module.config)["n_head"] == 3 and vars(module.config)["n_embd"] == 48
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    x = torch.ones(2)
    assert torch.equal(compiled(x), torch.full((2,), 3.0))
    shared.scale = 0.5
    assert torch.equal(compiled(x), torch.full((2,), 1.5))
