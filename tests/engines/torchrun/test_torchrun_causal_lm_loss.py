"""A transformers causal LM called with labels= under torchrun: the loss from vocabulary slices, the logits
gathered only when read (integrations/causal_lm_loss.py, lazy_logits.py).

Against the unsplit model (fp32): loss within 1e-5 relative (the slices' log-sum-exp adds in another order
than F.cross_entropy), logits and every parameter's gradient within 1e-5. Counts: a training step that reads
only the loss has no all-gather at all (the (batch, seq, vocab) logits gather is gone) and two all-reduces of
per-token numbers for the loss instead.
"""

import copy
import time

import pytest
import torch
import torch.nn.functional as F

import tensorshard as tp
from support import tiny_llama
from support.harness import world_mesh
from support.helpers import log_messages, rel_err

pytestmark = pytest.mark.timeout(120)

BATCH, SEQ, LAYERS = 2, 9, 2


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tiny_llama.VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt the loss skips
    labels[1, -2:] = -100  # padding
    return ids, labels


def _grads(model, ref) -> float:
    """Worst relative error of this rank's gradient slices against the same slices of the unsplit gradients."""
    state, rank = model.tensorshard, torch.distributed.get_rank()
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        split = state.splits.get(name)
        want = q.grad if split is None else split[1].take(q.grad, split[0], rank)
        worst = max(worst, rel_err(state.layouts[name].view(p.grad.to_local()), want))
    return worst


def parity_task() -> dict:
    ref = tiny_llama.build().train()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), check_inputs=0)
    ids, labels = _batch(1)
    out = {}

    # 1. the usual training call: loss only (no logits read), then the logits and a backward through them
    with tp.count_collectives() as fwd:
        got = model(input_ids=ids, labels=labels)
        loss = got.loss
    with tp.count_collectives() as bwd:
        loss.backward()
    want = ref(input_ids=ids, labels=labels)
    want.loss.backward()
    out["counts"] = (dict(fwd.forward), dict(bwd.backward))
    out["loss"] = abs(loss.item() - want.loss.item()) / abs(want.loss.item())
    out["grads"] = _grads(model, ref)
    with tp.count_collectives() as read:
        logits = got.logits
    out["read"] = dict(read.forward)
    out["output"] = (type(got) is type(want), tuple(logits.shape), rel_err(logits, want.logits), rel_err(got["logits"], want.logits))

    # 2. backward through .logits (and the loss together) reaches the head as in the unsplit model
    model.zero_grad(), ref.zero_grad()
    weight = torch.randn(tiny_llama.VOCAB, generator=torch.Generator().manual_seed(5))
    got, want = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    (got.loss + (got.logits * weight).sum() * 1e-3).backward()
    (want.loss + (want.logits * weight).sum() * 1e-3).backward()
    out["logits_backward"] = _grads(model, ref)

    # 3. ForCausalLMLoss's other arguments: num_items_in_batch (sum / count), shift_labels, ignore_index
    with torch.no_grad():
        n = torch.tensor(7)
        pairs = [
            (model(input_ids=ids, labels=labels, num_items_in_batch=n).loss, ref(input_ids=ids, labels=labels, num_items_in_batch=n).loss),
            (model(input_ids=ids, labels=labels, shift_labels=ids).loss, ref(input_ids=ids, labels=labels, shift_labels=ids).loss),
            (model(input_ids=ids, labels=ids, ignore_index=5).loss, ref(input_ids=ids, labels=ids, ignore_index=5).loss),
        ]
        out["options"] = [abs(a.item() - b.item()) / abs(b.item()) for a, b in pairs]
        # return_dict=False: a tuple, gathered at once
        tup = model(input_ids=ids, labels=labels, return_dict=False)
        out["tuple"] = (tuple(tup[1].shape), rel_err(tup[1], ref(input_ids=ids, labels=labels).logits))
        # a class no vocabulary slice holds: refused on every rank (F.cross_entropy refuses it too), not a wrong loss
        wrong = labels.clone()
        wrong[0, 5] = tiny_llama.VOCAB
        try:
            model(input_ids=ids, labels=wrong)
            out["refused"] = ""
        except ValueError as e:
            out["refused"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 3])  # 3: the vocabulary 128 splits 43/43/42
def test_labels_loss_from_slices_matches_unsplit(pool2, pool3, world):
    for out in (pool2 if world == 2 else pool3).run(parity_task):
        assert out["loss"] < 1e-5 and out["grads"] < 1e-5 and out["logits_backward"] < 1e-5
        same_class, shape, err, err_item = out["output"]
        assert same_class and shape == (BATCH, SEQ, tiny_llama.VOCAB) and err < 1e-5 and err_item < 1e-5
        assert max(out["options"]) < 1e-5
        assert out["tuple"][0] == (BATCH, SEQ, tiny_llama.VOCAB) and out["tuple"][1] < 1e-5
        forward, backward = out["counts"]
        # Forward: the embedding 1 + 2 per block + the loss's max and (sum of exp, target logit): no all-gather
        # (the preset gathered the (batch, seq, vocab) logits here). Backward as before: 2 per block + the head's
        # input (3 on 3 ranks adds the k/v ties of the replicated KV heads: 2 per block).
        assert forward == {"all_reduce": 1 + 2 * LAYERS + 2}
        ties = 2 * LAYERS if world == 3 else 0
        assert backward == {"all_reduce": 2 * LAYERS + 1 + ties}
        assert out["read"] == {"all_gather": 1}  # reading .logits gathers them, once
        assert f"class {tiny_llama.VOCAB}, outside the vocabulary 0..{tiny_llama.VOCAB - 1}" in out["refused"]


def fallback_task() -> dict:
    """Where the loss is not plain causal-LM cross-entropy the model's own path runs (logits gathered first)."""
    ref = tiny_llama.build()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), check_inputs=0)
    ids, labels = _batch(2)

    def smoothed(logits, labels, vocab_size, **kwargs):
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab_size).float(), labels[:, 1:].reshape(-1), label_smoothing=0.1)

    model.loss_function, ref.loss_function = smoothed, smoothed
    with torch.no_grad(), tp.count_collectives() as c:
        got = model(input_ids=ids, labels=labels)
    want = ref(input_ids=ids, labels=labels)
    plain = model(input_ids=ids)  # no labels: unchanged, the head gathers
    return {
        "loss": abs(got.loss.item() - want.loss.item()) / abs(want.loss.item()),
        "gathers": c.forward.get("all_gather", 0),
        "logits": (type(plain.logits).__name__, tuple(plain.logits.shape)),
    }


def test_custom_loss_keeps_the_models_own_path(pool2):
    for out in pool2.run(fallback_task):
        assert out["loss"] < 1e-6 and out["gathers"] == 1
        assert out["logits"] == ("Tensor", (BATCH, SEQ, tiny_llama.VOCAB))


BANNED = 7  # a token the masking model forbids, as Chameleon forbids its image tokens


def _masking_llama():
    """A Llama whose forward sets one vocabulary column of its logits to the dtype's minimum before the loss:
    on a vocabulary slice that edit would hit another token (local column 7 is token 7 + the slice's start)."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class MaskingLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden_states = self.model(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(hidden_states)
            logits[..., BANNED] = torch.finfo(logits.dtype).min
            loss = None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    plain = tiny_llama.build()
    model = MaskingLlama(plain.config).eval()
    model.load_state_dict(plain.state_dict())
    return model


def _debug_log(name: str):
    import logging

    return log_messages(name, logging.DEBUG)


def masking_task() -> dict:
    ref = _masking_llama()
    records, done = _debug_log("tensorshard.integrations.causal_lm_loss")
    try:
        model = tp.parallelize(copy.deepcopy(ref), world_mesh(), check_inputs=0)
    finally:
        done()
    ids, labels = _batch(3)
    labels[labels == BANNED] = 0  # the forbidden token as a target would make both losses ~1e38
    with torch.no_grad(), tp.count_collectives() as c:
        got = model(input_ids=ids, labels=labels).loss
        want = ref(input_ids=ids, labels=labels).loss
    return {"loss": abs(got.item() - want.item()) / abs(want.item()), "gathers": c.forward.get("all_gather", 0),
            "log": records}


def test_a_model_that_edits_logits_by_token_keeps_its_own_loss(pool2):
    on_rank0, on_rank1 = pool2.run(masking_task)
    for out in (on_rank0, on_rank1):
        # the gathered path: the same loss as the unsplit model (a slice would mask token 7 + 64 on rank 1)
        assert out["loss"] < 1e-6 and out["gathers"] == 1
    log = on_rank0["log"]
    assert any("MaskingLlama keeps its own loss" in m and "logits[..., BANNED]" in m for m in log), log
    assert on_rank1["log"] == []  # tensorshard logs from global rank 0 only (tensorshard/logs.py)


def softcapped_task() -> dict:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=tiny_llama.VOCAB, final_logit_softcapping=0.5, attn_implementation="eager",
    )  # a cap of 0.5: tanh bends these logits (|x| ~ 1) a lot, so a missed cap would show
    ref = Gemma2ForCausalLM(config).eval()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), check_inputs=0)
    ids, labels = _batch(4)
    with torch.no_grad(), tp.count_collectives() as c:
        got = model(input_ids=ids, labels=labels).loss
    want = ref(input_ids=ids, labels=labels).loss
    return {"loss": abs(got.item() - want.item()) / abs(want.item()), "counts": dict(c.forward)}


def test_softcapped_logits_still_use_the_slices(pool2):
    for out in pool2.run(softcapped_task):
        assert out["loss"] < 1e-5  # fp32, the slices' log-sum-exp in another order
        # the embedding 1 + 2 per block + the loss's 2; no all-gather: the sliced path ran
        assert out["counts"] == {"all_reduce": 1 + 2 + 2}


def one_reader(rank: int) -> None:
    """Rank 0 reads out.logits (an all-gather), rank 1 goes on to its next step: the ranks fall out of step."""
    from support import spawned

    model = tp.parallelize(tiny_llama.build(), world_mesh(), check_inputs=0)
    # The 3 s limit from here on only: parallelize's own setup (the plan check, then the transport's handshake)
    # waits for the slower rank under the limit in force, and on a loaded machine the ranks reach it seconds apart.
    model.tensorshard.comm.guard.set_timeout(3)
    ids, labels = _batch(5)
    out = model(input_ids=ids, labels=labels)
    began = time.monotonic()
    try:
        if rank == 0:
            out.logits
        else:
            model(input_ids=ids, labels=labels)
    finally:
        spawned.report("seconds", time.monotonic() - began)
        # Stay up until the other rank has failed too: behind by milliseconds (seconds on a loaded machine), it must
        # reach its own time limit rather than see this process gone (which stops it at once, as
        # CollectiveAborted: another outcome, tested elsewhere).
        spawned.wait_for_all("failed", timeout=20)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", ["shared memory", "gloo"])
def test_logits_read_on_one_rank_fails_within_the_limit_naming_the_fix(monkeypatch, transport):
    from support import spawned

    monkeypatch.setenv("TENSORSHARD_SHM", "1" if transport == "shared memory" else "0")  # the ranks inherit it
    result = spawned.run(one_reader, world=2, timeout=150)  # fresh processes: the group ends out of step (~15 s idle; room for a loaded machine)
    assert result.exit_codes == [1, 1]
    reader, other = (result.events[r]["raised"] for r in (0, 1))
    for event in (reader, other):
        assert event["type"] == "TimeoutError"
        assert "read the logits on every rank or on none" in event["message"], event["message"]
        assert "the ranks are at different collectives" in event["message"]
    assert "rank 1 at all_reduce at model.embed_tokens" in reader["message"]
    if transport == "gloo":
        assert all(3 <= result.events[r]["seconds"] < 3 + 10 for r in (0, 1))  # the limit (3 s), not a hang
    else:  # each rank wrote what it does next to its data: the mismatch shows at the first barrier
        assert all(result.events[r]["seconds"] < 3 for r in (0, 1))
