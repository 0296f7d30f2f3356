"""Optimizers that read a whole weight, over a tiny Llama split on 2 and 3 CPU slots (3: uneven splits, 176
features as 59/59/58, 4 heads as 2/1/1): Muon and Adafactor step each split weight whole (tensorshard/optimizers),
with and without ZeRO-3 partitions of the replicated parameters; a trust-ratio optimizer and an override of Muon's
step are refused before any parameter changes; an unknown subclass warns once and trains exactly.

Tolerance against the unsplit model's losses over 8 steps (fp32): 1e-5 relative (tests/support/optimizers.py says
why Muon needs its default lr for that). Without the whole-weight step, the same runs are 3e-4 to 6e-4 (Muon) and 8e-5
(Adafactor) away.
"""

import copy
import warnings

import pytest
import torch

import tensorshard as tp
from support import optimizers, tiny_llama

pytestmark = pytest.mark.timeout(120)

STEPS = 8


@pytest.fixture(scope="module")
def reference():
    """The unsplit model before training, and its losses per family."""
    ref = tiny_llama.build().train()
    data = optimizers.batches(STEPS)
    losses = {}
    for family in ("muon", "adafactor", "unknown_subclass"):
        model = copy.deepcopy(ref)
        losses[family] = optimizers.train(model, optimizers.build(model, family), data)
    return ref, data, losses


def split(ref, world, sharded=False):
    return tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * world, sharded=sharded)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("family", ["muon", "adafactor"])
@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "zero3"])
def test_whole_weight_optimizers_match_the_unsplit_model(reference, world, family, sharded):
    ref, data, want = reference
    model = split(ref, world, sharded)
    got = optimizers.train(model, optimizers.build(model, family), data)
    assert optimizers.worst_rel(got, want[family]) < 1e-5


@pytest.mark.parametrize("world", [2, 3])
def test_per_device_optimizer_steps_split_weights_whole_after_its_closure(reference, world):
    ref, data, want = reference
    model = split(ref, world)
    opts = [tp.per_device_optimizer(o, model) for o in optimizers.build(model, "muon")]
    losses = []
    for x in data:
        def closure(x=x):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            return loss

        losses.append(opts[0].step(closure).item())  # the closure computes every parameter's gradient
        opts[1].step()
        for o in opts:
            o.zero_grad()
    assert optimizers.worst_rel(losses, want["muon"]) < 1e-5


def step_once(model, opts, data):
    model(input_ids=data[0], labels=data[0]).loss.backward()
    for o in opts:
        o.step()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("family, why", [("lamb", "trust ratio"), ("muon_subclass", "LoggingMuon overrides step()")])
def test_what_cannot_be_exact_is_refused_before_any_change(reference, world, family, why):
    ref, data, _ = reference
    model = split(ref, world)
    opts = optimizers.build(model, family)
    before = optimizers.snapshot(model)
    with pytest.raises(TypeError, match=r"cannot step model\.\S+\.weight exactly: the plan splits it") as info:
        step_once(model, opts, data)
    assert why in str(info.value) and "Nothing was changed" in str(info.value)
    assert optimizers.unchanged(model, before)


@pytest.mark.parametrize("world", [2, 3])
def test_a_closure_runs_once_before_the_whole_weight_step(reference, world):
    """As Lightning calls step(closure): the closure computes the gradients, so it runs first, once."""
    ref, data, want = reference
    model = split(ref, world)
    losses = optimizers.train(model, optimizers.build(model, "muon"), data, closure=True)
    assert optimizers.train.closure_calls == len(data)
    assert optimizers.worst_rel(losses, want["muon"]) < 1e-5


def test_a_step_hook_of_the_optimizers_own_is_refused_and_names_the_way_out(reference):
    ref, data, _ = reference
    model = split(ref, 2)
    muon = optimizers.build(model, "muon")[0]
    muon.register_step_pre_hook(lambda *_: None)  # it would run after the split weights were stepped
    model(input_ids=data[0], labels=data[0]).loss.backward()
    before = optimizers.snapshot(model)
    with pytest.raises(RuntimeError, match=r"must see model\.layers\.0\.self_attn\.q_proj\.weight whole.*step hooks "
                                           r"of its own.*tp\.per_device_optimizer"):
        muon.step()
    assert optimizers.unchanged(model, before)


@pytest.mark.parametrize("world", [2, 3])
def test_an_unknown_subclass_warns_once_and_steps_slices(reference, world, monkeypatch):
    ref, data, want = reference
    monkeypatch.setattr(tp.optimizers.kinds, "_warned", set())
    model = split(ref, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = optimizers.train(model, optimizers.build(model, "unknown_subclass"), data)
    messages = [str(w.message) for w in caught if "tensorshard assumes" in str(w.message)]
    assert len(messages) == 1 and "CountingSGD is elementwise" in messages[0]
    assert "tp.optimizers.register_elementwise(cls)" in messages[0]
    assert optimizers.worst_rel(got, want["unknown_subclass"]) < 1e-5


@pytest.mark.parametrize("per_device", [False, True], ids=["default_step", "per_device_optimizer"])
def test_a_wrapper_optimizer_is_the_kind_of_the_one_inside_and_is_not_warned_about(reference, per_device, monkeypatch):
    """accelerate's AcceleratedOptimizer (what transformers' Trainer steps) and Lightning's and Fabric's wrappers
    (subclasses of the wrapped class with a step of their own) hand their step to the optimizer inside: they are of
    its kind (Muon's: split weights stepped whole), with no unknown-optimizer warning, and train exactly."""
    accelerate = pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState
    from lightning.fabric.wrappers import _FabricOptimizer
    from lightning.pytorch.core.optimizer import LightningOptimizer

    ref, data, want = reference
    monkeypatch.setattr(tp.optimizers.kinds, "_warned", set())
    model = split(ref, 2)
    accelerate.Accelerator(cpu=True)  # AcceleratedOptimizer reads the process's accelerator state
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            muon, adamw = optimizers.build(model, "muon")
            for wrap in (lambda o: AcceleratedOptimizer(o, device_placement=False), LightningOptimizer,
                         lambda o: _FabricOptimizer(o, strategy=None)):
                assert tp.optimizers.kind_of(wrap(muon)) == tp.optimizers.PER_TENSOR
                assert tp.optimizers.kind_of(wrap(adamw)) == tp.optimizers.ELEMENTWISE
            if per_device:  # the wrapper around the per-device optimizer; the other way round is refused
                with pytest.raises(TypeError, match=r"AcceleratedOptimizer, a wrapper .* per_device_optimizer\(Muon"):
                    tp.per_device_optimizer(AcceleratedOptimizer(muon, device_placement=False), model)
                muon, adamw = (tp.per_device_optimizer(o, model) for o in (muon, adamw))
            wrapped = [AcceleratedOptimizer(o, device_placement=False) for o in (muon, adamw)]
            got = optimizers.train(model, wrapped, data)
    finally:
        AcceleratorState._reset_state(True)
    assert [str(w.message) for w in caught if "tensorshard assumes" in str(w.message)] == []
    assert optimizers.worst_rel(got, want["muon"]) < 1e-5


def test_registering_a_class_states_its_kind():
    class Mine(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    opt = Mine([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    try:
        tp.optimizers.register_per_tensor(Mine)
        assert tp.optimizers.kind_of(opt) == tp.optimizers.PER_TENSOR
        tp.optimizers.register_elementwise(Mine)
        assert tp.optimizers.kind_of(opt) == tp.optimizers.ELEMENTWISE
    finally:
        tp.optimizers.kinds._kinds.pop(tp.optimizers.kinds._key(Mine), None)
    with pytest.raises(TypeError, match="register an optimizer class"):
        tp.optimizers.register_elementwise(opt)


@pytest.mark.parametrize("family", ["muon", "adafactor"])
def test_fused_blocks_are_put_back_in_place(family):
    """Phi-3's fused qkv_proj (q|k|v, 8 heads over 2 KV heads: 3/3/2 query heads) and gate_up_proj (two 88-feature
    blocks, each 30/29/29) at 3 devices: every device holds a piece of every block, in block order."""
    from support.hf_configs import VOCAB, tiny_model
    from tensorshard.plans.slices import split_layout

    ref = tiny_model("phi3").train()
    data = optimizers.batches(STEPS, vocab=VOCAB)
    unsplit = copy.deepcopy(ref)
    want = optimizers.train(unsplit, optimizers.build(unsplit, family), data)
    model = split(ref, 3)
    assert split_layout(model).placements["model.layers.0.self_attn.qkv_proj.weight"][1].ranges[0][1:], \
        "fused blocks: a device holds several ranges"
    got = optimizers.train(model, optimizers.build(model, family), data)
    assert optimizers.worst_rel(got, want) < 1e-5
