"""Bad input gets a clear error and changes nothing.

Each case below is one row of the table in docs/errors.md (`test_docs_table_matches_the_cases` keeps the
two in step): what the user passed, the error type, a piece of the message, and the model is checked to
be exactly as it was (same tensor objects, values, devices, attributes; no hooks or overrides added).
"""

from __future__ import annotations

import logging
import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorshard as tp
from tensorshard.partition import block_partition
from support import ROOT, plans
from support.models import FeedForward, Transformer
from support.workers_state import assert_unchanged, snapshot

pytestmark = pytest.mark.timeout(60)

DOCS = ROOT / "docs" / "errors.md"
FF_PLAN = plans.FEED_FORWARD


class FusedMLP(nn.Module):
    """gate|up in one matrix, chunked in forward (Phi-3 style)."""

    def __init__(self, dim=8, hidden=12):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class FusedQKV(nn.Module):
    """Grouped-query attention with q|k|v in one matrix (6 query heads, 2 KV heads, head_dim 4)."""

    def __init__(self, dim=24, heads=6, kv_heads=2, head_dim=4):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim)
        self.o = nn.Linear(heads * head_dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1)
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, 1)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def attention_plan(n_heads, n_kv_heads, **changes):
    plan = {k: v for k, v in plans.transformer(n_heads, n_kv_heads).items()}
    plan.update(changes)
    return {k: v for k, v in plan.items() if v is not None}


def tied():
    emb, head = nn.Embedding(20, 8), nn.Linear(8, 20, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, head)


def fake_gpus(monkeypatch, count=2):
    """This machine has no GPU: let the device checks see `count` of them (no CUDA call is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@dataclass
class Case:
    id: str
    model: Callable[[], nn.Module]
    kwargs: dict[str, Any]
    error: type
    excerpt: str  # a piece of the message, as docs/errors.md quotes it
    devices: Any = ("cpu", "cpu")
    setup: Callable | None = None  # (monkeypatch, tmp_path) -> None


def ff():
    return FeedForward(8, 16)


CASES = [
    # -- devices ------------------------------------------------------------------------------------------
    Case("devices-empty", ff, {"plan": FF_PLAN}, ValueError, "device_ids is empty; give at least one device", devices=[]),
    Case("devices-not-a-list", ff, {"plan": FF_PLAN}, TypeError, "device_ids must be a list of devices", devices="cuda:0"),
    Case("devices-dict", ff, {"plan": FF_PLAN}, TypeError, "got a dict ({'cpu': 1}), whose keys would be taken as the devices", devices={"cpu": 1}),
    Case("devices-set", ff, {"plan": FF_PLAN}, TypeError, "which has no order (device i holds shard i)", devices={"cpu"}),
    Case("devices-malformed", ff, {"plan": FF_PLAN}, ValueError, "device_ids[1] 'gpu:1' is not a device name; use e.g. 'cuda:0' or 'cpu'", devices=["cpu", "gpu:1"]),
    Case("devices-wrong-type", ff, {"plan": FF_PLAN}, TypeError, "device_ids[1] 1.5 has type float; use a torch.device, a string or an int", devices=["cpu", 1.5]),
    Case("devices-none", ff, {"plan": FF_PLAN}, TypeError, "device_ids[0] None has type NoneType", devices=[None]),
    Case("devices-bool", ff, {"plan": FF_PLAN}, TypeError, "device_ids[0] True is a bool", devices=[True]),
    Case("devices-negative-index", ff, {"plan": FF_PLAN}, ValueError, "device_ids[0] -1 is negative; GPU indices start at 0", devices=[-1]),
    Case("devices-meta", ff, {"plan": FF_PLAN}, ValueError, "shards cannot live on the meta device", devices=["meta", "meta"]),
    Case("devices-gpu-without-cuda", ff, {"plan": FF_PLAN}, ValueError, "names a GPU, but CUDA is not available here; use 'cpu'", devices=["cuda:0"]),
    Case("devices-unavailable-type", ff, {"plan": FF_PLAN}, ValueError, "names a device of type 'mps', but that type is not available here", devices=["mps"]),
    Case("devices-duplicated-gpu", ff, {"plan": FF_PLAN}, ValueError, "lists a device more than once (cuda:0 at positions [0, 1]); a GPU holds only one shard", devices=["cuda:0", 0], setup=lambda mp, _: fake_gpus(mp)),
    Case("devices-nonexistent-gpu", ff, {"plan": FF_PLAN}, ValueError, "device_ids[1] 'cuda:2' does not exist: 2 cuda device(s) are visible (cuda:0..cuda:1)", devices=["cuda:0", "cuda:2"], setup=lambda mp, _: fake_gpus(mp)),
    Case("output-device-malformed", ff, {"plan": FF_PLAN, "output_device": "host"}, ValueError, "output_device 'host' is not a device name"),
    # -- timeout ------------------------------------------------------------------------------------------
    Case("timeout-zero", ff, {"plan": FF_PLAN, "timeout": 0}, ValueError, "timeout: 0.0 is not a positive, finite number of seconds"),
    Case("timeout-infinite", ff, {"plan": FF_PLAN, "timeout": float("inf")}, ValueError, "timeout: inf is not a positive, finite number of seconds"),
    Case("timeout-string", ff, {"plan": FF_PLAN, "timeout": "60"}, TypeError, "timeout='60' has type str; give seconds as a number"),
    Case("timeout-env-malformed", ff, {"plan": FF_PLAN}, ValueError, "TENSORSHARD_TIMEOUT='soon' is not a number of seconds", setup=lambda mp, _: mp.setenv("TENSORSHARD_TIMEOUT", "soon")),
    Case("timeout-env-negative", ff, {"plan": FF_PLAN}, ValueError, "TENSORSHARD_TIMEOUT='-5': -5.0 is not a positive, finite number", setup=lambda mp, _: mp.setenv("TENSORSHARD_TIMEOUT", "-5")),
    # -- what is split ------------------------------------------------------------------------------------
    Case("contains-a-split-model", lambda: nn.Sequential(tp.tensor_parallel(ff(), ["cpu"] * 2, plan=FF_PLAN)), {}, TypeError, "Sequential.0 is already split over 2 device(s) ['cpu[0]', 'cpu[1]']: it is a model tensor_parallel() returned. Split the unsplit model once"),
    Case("plan-and-old-name", ff, {"plan": FF_PLAN, "tensor_parallel_config": FF_PLAN}, ValueError, "pass either plan= or tensor_parallel_config= (its old name), not both"),
    Case("sharded-name-already-split", ff, {"plan": FF_PLAN, "sharded_param_names": ["w1.weight"]}, ValueError, "sharded_param_names: 'w1.weight' is already split by the plan (dim 0); ZeRO-3 partitions only what the plan leaves whole"),
    Case("sharded-name-unknown", ff, {"plan": FF_PLAN, "sharded_param_names": ["w9.weight"]}, ValueError, "sharded_param_names: 'w9.weight' is not a parameter of the model."),
    # -- plans ----------------------------------------------------------------------------------------------
    Case("plan-wrong-type", ff, {"plan": 42}, TypeError, "plan must be a tensorshard Plan, a {pattern: style} dict or a path to a plan JSON file; got int"),
    Case("plan-entry-not-a-style", ff, {"plan": {"w1": "colwise"}}, TypeError, "plan entry 'w1' maps to 'colwise'; use a tensorshard style"),
    Case("plan-file-not-json", ff, {"plan": "PLAN_FILE"}, ValueError, "not valid JSON", setup=lambda mp, tmp: (tmp / "plan.json").write_text("{w1: colwise")),
    Case("plan-key-matches-nothing", lambda: Transformer(), {"plan": attention_plan(8, 2, **{"layers.*.ffn.w4": tp.ColwiseParallel()})}, ValueError, "'layers.*.ffn.w4' matches no module of Transformer. Closest module names: layers.*.ffn.w3, layers.*.ffn.w2, layers.*.ffn.w1"),
    Case("style-on-unsupported-layer", lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), {"plan": {"1": tp.ColwiseParallel()}}, NotImplementedError, "ColwiseParallel cannot split 1 (LayerNorm): it applies to Linear, Conv1D, ConvNd. Use Replicate() for this module"),
    Case("grouped-convolution", lambda: nn.Sequential(nn.Conv2d(4, 8, 3, groups=2)), {"plan": {"0": tp.ColwiseParallel(gather_output=True)}}, NotImplementedError, "grouped convolutions (groups=2) are not supported; replicate this layer"),
    Case("dimension-smaller-than-devices", lambda: nn.Sequential(nn.Linear(8, 3), nn.Linear(3, 8)), {"plan": {"0": tp.ColwiseParallel(), "1": tp.RowwiseParallel()}}, ValueError, "0: a block of 3 features cannot be split over 4 devices; use at most 3 devices or replicate this layer", devices=["cpu"] * 4),
    Case("vocabulary-smaller-than-devices", lambda: nn.Sequential(nn.Embedding(3, 8)), {"plan": {"0": tp.EmbeddingParallel()}}, ValueError, "0: a block of 3 features cannot be split over 4 devices", devices=["cpu"] * 4),
    Case("heads-fewer-than-devices", lambda: Transformer(dim=16, n_heads=2, n_kv_heads=2), {"plan": attention_plan(2, 2)}, ValueError, "2 query heads in 2 KV groups cannot be split over 3 devices", devices=["cpu"] * 3),
    Case("heads-do-not-group", lambda: Transformer(), {"plan": attention_plan(8, 3)}, ValueError, "8 query heads cannot be grouped over 3 key/value heads; num_heads must be a positive multiple of num_kv_heads"),
    Case("heads-do-not-divide-features", lambda: Transformer(), {"plan": attention_plan(8, 2, **{"layers.*.attn": tp.Heads(num_heads=6, num_kv_heads=2)})}, ValueError, "64 features do not divide into blocks ['q'] with 6 heads / 2 KV heads"),
    Case("head-blocks-without-heads", lambda: Transformer(), {"plan": attention_plan(8, 2, **{"layers.*.attn": None})}, ValueError, "name attention heads, but no Heads(...) entry in the plan matches a parent module"),
    Case("heads-attr-missing", lambda: Transformer(), {"plan": attention_plan(8, 2, **{"layers.*.attn": tp.Heads(num_heads=8, num_kv_heads=2, attrs={"n_head": "heads"})})}, ValueError, "Heads attrs names 'n_head', but Attention has no such attribute"),
    Case("heads-attr-other-count", lambda: Transformer(), {"plan": attention_plan(8, 2, **{"layers.*.attn": tp.Heads(num_heads=4, num_kv_heads=2, attrs={"n_heads": "heads"})})}, ValueError, "but the model has n_heads = 8, not 4"),
    Case("blocks-do-not-add-up", ff, {"plan": {"w[13]": tp.ColwiseParallel(blocks=(10, 10)), "w2": tp.RowwiseParallel()}}, ValueError, "w1: blocks [10, 10] add up to 20, but the dimension has 16"),
    Case("gather-replicated-kv-heads", lambda: Transformer(), {"plan": attention_plan(8, 2, **{"layers.*.attn.w[kv]": tp.ColwiseParallel(blocks=("kv",), gather_output=True)})}, NotImplementedError, "gather_output=True with KV heads replicated over devices is not supported", devices=["cpu"] * 4),
    Case("shard-params-unknown-name", ff, {"plan": {"w1": tp.ShardParams(params={"kernel": 0})}}, ValueError, "w1: ShardParams names 'kernel', but Linear has only ['weight'] as its own parameters/buffers"),
    Case("tied-weights-split-differently", tied, {"plan": {"0": tp.EmbeddingParallel(split="embedding"), "1": tp.ColwiseParallel(gather_output=True)}}, ValueError, "1.weight is the same tensor as 0.weight (tied weights), but the plan splits them differently"),
    # -- neighbours that disagree (plans/validate.py) ---------------------------------------------------
    Case("neighbours-split-differently", ff, {"plan": {"w[13]": tp.ColwiseParallel(blocks=(8, 8)), "w2": tp.RowwiseParallel()}}, ValueError, "w1 (ColwiseParallel(blocks=(8, 8))) leaves its 16 output features split as [0:4,8:12] | [4:8,12:16], but w2 (RowwiseParallel()), which reads them, expects [0:8] | [8:16]"),
    Case("heads-cut-by-a-plain-split", lambda: Transformer(dim=72, n_heads=9, n_kv_heads=9), {"plan": attention_plan(9, 9, **{"layers.*.attn.wq": tp.ColwiseParallel()})}, ValueError, "layers.0.attn.wq (ColwiseParallel()) splits its 72 features as [0:36] | [36:72], cutting across the 9 query heads of 8 features that the Heads entry at layers.0.attn places as [0:40] | [40:72]. Use blocks=('q',)"),
    Case("fused-output-without-blocks", FusedMLP, {"plan": {"gate_up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()}}, ValueError, "gate_up has 24 output features, 2 times the 12 that down reads: it fuses 2 outputs"),
    Case("fused-qkv-without-blocks", FusedQKV, {"plan": {"": tp.Heads(num_heads=6, num_kv_heads=2, attrs={"heads": "heads", "kv_heads": "kv_heads"}), "qkv": tp.ColwiseParallel(), "o": tp.RowwiseParallel(blocks=("q",))}}, ValueError, "qkv (ColwiseParallel()) has 40 output features, the size of fused q|k|v"),
    Case("split-output-read-whole", lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), {"plan": {"0": tp.ColwiseParallel()}}, ValueError, "0 (ColwiseParallel()) leaves its 16 output features split over 2 devices, but 2 (Linear, replicated), the next layer that reads 16 features, expects all of them"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rejected(case, monkeypatch, tmp_path):
    if case.id == "devices-gpu-without-cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if case.id == "devices-unavailable-type" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    if case.setup:
        case.setup(monkeypatch, tmp_path)
    kwargs = dict(case.kwargs)
    if kwargs.get("plan") == "PLAN_FILE":
        kwargs["plan"] = str(tmp_path / "plan.json")
    model = case.model()
    before = snapshot(model)
    devices = list(case.devices) if isinstance(case.devices, tuple) else case.devices
    with pytest.raises(case.error) as info:
        tp.tensor_parallel(model, devices, **kwargs)
    assert case.excerpt in str(info.value), str(info.value)
    assert_unchanged(model, before)


# --- errors raised later than tensor_parallel() ------------------------------------------------------------


def test_meta_model_without_weights_fails_at_the_call_naming_the_fix():
    with torch.device("meta"):
        model = FeedForward(8, 16)
    split = tp.tensor_parallel(model, ["cpu"] * 2, plan=FF_PLAN)  # meta-first: weights come later
    for _ in range(2):  # and again: the failed call changed nothing
        with pytest.raises(RuntimeError, match=r"w1.weight \(and 2 more\) is on the meta device: this model was split without its weights"):
            split(torch.randn(2, 8))


def test_meta_input_is_refused(gen):
    model = tp.tensor_parallel(FeedForward(8, 16), ["cpu"] * 2, plan=FF_PLAN)
    with pytest.raises(ValueError, match=r"input tensor #0 \(shape \(2, 8\)\) is on the meta device"):
        model(torch.empty(2, 8, device="meta"))
    assert model(torch.randn(2, 8, generator=gen)).shape == (2, 8)


def test_an_output_left_split_unevenly_is_caught_at_the_call(gen):
    model = nn.Sequential(nn.Linear(8, 15))
    with pytest.raises(ValueError, match=r"'0': its split output reaches the model's output .* gather_output=True"):
        tp.tensor_parallel(model, ["cpu"] * 2, plan={"0": tp.ColwiseParallel()})  # the pair check (plancheck.py)
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("tensorshard.plans.validate").addHandler(handler)
    try:  # trusted as written: the engine still catches it at the call
        split = tp.tensor_parallel(model, ["cpu"] * 2, plan={"0": tp.ColwiseParallel()}, check=False)
    finally:
        logging.getLogger("tensorshard.plans.validate").removeHandler(handler)
    assert any("leaves its output split and no row-parallel layer after it reads it" in w for w in warnings)
    with pytest.raises(RuntimeError, match=r"output leaf 0 has shape \(2, 8\) on cpu\[0\] but \(2, 7\) on cpu\[1\]: the plan leaves an output split"):
        split(torch.randn(2, 8, generator=gen))


def test_every_shard_sees_the_same_inputs(gen):
    """Inputs that differ across the group cannot happen in-process: the engine copies one input to all."""
    seen = {}

    class Record(nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = FeedForward(8, 16)

        def forward(self, x, scale):
            seen[tp.engines.inprocess.current_rank()] = (x, scale)
            return self.ff(x) * scale

    model = tp.tensor_parallel(Record(), ["cpu"] * 3, plan={"ff.w[13]": tp.ColwiseParallel(), "ff.w2": tp.RowwiseParallel()})
    x = torch.randn(6, 8, generator=gen).t().contiguous().t()  # non-contiguous
    model(x, scale=torch.tensor(2.0))
    assert sorted(seen) == [0, 1, 2]
    for rank, (xr, scale) in seen.items():
        assert torch.equal(xr, x) and scale.item() == 2.0


class _FailingAttach(tp.ColwiseParallel):
    def attach(self, module, splits, ctx):
        if ctx.rank == 1:
            raise RuntimeError("attach failed on purpose")
        super().attach(module, splits, ctx)


class _OutOfRange(tp.ColwiseParallel):
    def shard(self, module, ctx):
        dim, part = super().shard(module, ctx)["weight"]
        return {"weight": (dim, block_partition(part.size + 4, ctx.world_size))}  # past the end of the weight


def test_a_failure_while_building_restores_the_original_objects():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    params = list(model.parameters())  # the user holds them (an optimizer, say): they are put back as they are
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="attach failed on purpose") as info:
        tp.tensor_parallel(model, ["cpu"] * 2, plan={"0": _FailingAttach(), "2": tp.RowwiseParallel()})
    assert "the original model was restored" in " ".join(info.value.__notes__)
    assert_unchanged(model, before)
    assert all(p is q for p, q in zip(model.parameters(), params))


def test_a_failure_while_building_rebuilds_released_tensors_from_their_slices():
    model = tied()
    model.append(nn.Linear(20, 8))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    originals = [weakref.ref(p) for p in model.parameters()]
    with pytest.raises(RuntimeError):
        tp.tensor_parallel(model, ["cpu"] * 2, plan={"0": tp.EmbeddingParallel(), "1": tp.ColwiseParallel(gather_output=True), "2": _OutOfRange(gather_output=True)})
    # The first tensors were released (no one else held them) and are rebuilt; the tie survives.
    assert any(ref() is None for ref in originals)  # (ids could be reused by the rebuilt tensors)
    assert model[0].weight is model[1].weight and not model[0].weight.is_meta
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k


# --- the docs ----------------------------------------------------------------------------------------------


def test_docs_table_matches_the_cases():
    """Every case has a row in docs/errors.md with its error type and message excerpt; every test the
    page cites exists."""
    text = DOCS.read_text()
    rows = {m.group(1): line for line in text.splitlines() for m in re.finditer(r"test_rejected\[([\w-]+)\]", line)}
    assert set(rows) == {c.id for c in CASES}
    for case in CASES:
        row = rows[case.id]
        assert f"`{case.error.__name__}`" in row, case.id
        assert case.excerpt.replace("|", "\\|") in row, case.id
    root = DOCS.parents[1]
    for path, name in re.findall(r"(tests/[\w/]+\.py)::(test_\w+)", text):
        assert f"def {name}(" in (root / path).read_text(), f"{path}::{name}"


def test_docs_examples_run(capsys):
    for block in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S):
        exec(compile(block, str(DOCS), "exec"), {})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_inputs_on_another_device_are_moved(gen):
    ref = FeedForward(8, 16)
    model = tp.tensor_parallel(__import__("copy").deepcopy(ref), ["cpu", "cpu"], plan=FF_PLAN)
    x = torch.randn(2, 8, generator=gen)
    out = model(x.to("cuda:0"))
    assert out.device == torch.device("cpu") and torch.allclose(out, ref(x), atol=1e-6)
