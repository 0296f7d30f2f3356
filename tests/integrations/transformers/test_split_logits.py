"""In one process, a causal LM's logits stay split by vocabulary through the model's forward: with labels= its loss
comes from the slices, and the logits are assembled once at the end of the call, into one tensor
(integrations/transformers/split_logits.py). The same logits, loss and gradients as the unsplit model, with the
head's output never whole on any device inside the call; a model whose code is not provably elementwise on its
logits, or a loss of the user's own, keeps the gathering head."""

import copy

import pytest
import torch

import tensorshard as tp
from support.hf_parity import gathered_grads

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
pytestmark = pytest.mark.timeout(120)


def tiny(vocab: int = 301, cls=LlamaForCausalLM):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    return cls(config).eval()


def head_widths(split) -> list[int]:
    """The width of each shard's head output, recorded at every call of the head."""
    widths = []
    for shard in split.module_shards:
        shard.get_output_embeddings().register_forward_hook(lambda m, i, o: widths.append(o.shape[-1]))
    return widths


@pytest.mark.parametrize("n", [2, 3])
def test_logits_are_assembled_once_from_the_vocabulary_slices(n):
    model = tiny()  # vocabulary 301: uneven slices at 2 and 3 devices
    ids = torch.randint(0, 301, (2, 7))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * n)
    widths = head_widths(split)
    storages = []  # where each device's model put the logits it returned
    hooks = [
        shard.register_forward_hook(lambda m, i, o: storages.append(o.logits.untyped_storage().data_ptr()))
        for shard in split.module_shards
    ]
    with torch.no_grad(), tp.count_collectives() as counted:
        out = split(input_ids=ids)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(out.logits, ref, **TOL)
    assert sorted(widths) == sorted(split.splits["lm_head.weight"][1].local_size(r) for r in range(n))
    assert storages == [out.logits.untyped_storage().data_ptr()] * n  # one tensor, not one per device
    assert counted.forward == {"all_reduce": 1 + 2 * 2, "all_gather": 1}  # as with the gathering head
    tuple_out = split(input_ids=ids, return_dict=False, use_cache=False)
    torch.testing.assert_close(tuple_out[0], ref, **TOL)


def test_training_through_the_logits_matches_the_unsplit_gradients():
    model = tiny().train()
    ids = torch.randint(0, 301, (2, 6))
    model(input_ids=ids).logits.log_softmax(-1).mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 2, sharded=False)
    widths = head_widths(split)
    split(input_ids=ids).logits.log_softmax(-1).mean().backward()
    assert sorted(widths) == [150, 151]  # the head's output stayed split through the forward
    grads = gathered_grads(split)
    assert set(grads) == set(ref)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref[name], **TOL)


@pytest.mark.parametrize("n", [2, 3])
def test_a_call_with_labels_computes_the_loss_from_the_slices(n):
    model = tiny().train()
    ids = torch.randint(0, 301, (2, 6))
    labels = ids.clone()
    labels[0, :2] = -100  # ignored positions, as a data collator pads
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * n, sharded=False)  # no ZeRO-3 gathers to count
    widths = head_widths(split)
    with tp.count_collectives() as counted:
        out = split(input_ids=ids, labels=labels)
        out.loss.backward()
    assert sorted(widths) == sorted(split.splits["lm_head.weight"][1].local_size(r) for r in range(n))
    # the blocks' all-reduces, and the loss's two (the max, and the sums of exp and of the target logits)
    assert counted.forward == {"all_reduce": 1 + 2 * 2 + 2, "all_gather": 1}
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    torch.testing.assert_close(out.logits, ref.logits, **TOL)
    grads = gathered_grads(split)
    assert set(grads) == set(expected)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], **TOL)
    with torch.no_grad():  # the Trainer's form: a summed loss over the batch's counted tokens
        summed = split(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(7)).loss
        plain = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(7)).loss
    torch.testing.assert_close(summed, plain, **TOL)


def test_a_loss_of_the_users_own_reads_the_gathered_logits():
    model = tiny()
    ids = torch.randint(0, 301, (2, 6))
    seen = []

    def loss_function(logits, labels, **kwargs):
        seen.append(logits.shape[-1])
        return logits.float().logsumexp(-1).mean()

    with torch.no_grad():
        model.loss_function = loss_function
        ref = model(input_ids=ids, labels=ids).loss
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 2)
    with torch.no_grad():
        got = split(input_ids=ids, labels=ids).loss
    assert seen == [301, 301, 301]  # the unsplit model's call, then each device's: whole logits
    torch.testing.assert_close(got, ref, **TOL)


class MasksOneToken(LlamaForCausalLM):
    """Edits its logits by token id after the head: slices would mask the wrong column (or none)."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        out.logits[..., 7] = -1e4
        return out


def test_a_model_that_edits_logits_by_token_keeps_the_gathered_head():
    model = tiny(cls=MasksOneToken)
    ids = torch.randint(0, 301, (2, 5))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 2)
    widths = head_widths(split)
    with torch.no_grad():
        out = split(input_ids=ids).logits
    assert widths == [301, 301]
    torch.testing.assert_close(out, ref, **TOL)


def test_softcapped_logits_stay_split_and_match():
    """Gemma 2 caps its logits (divide, tanh, multiply) after the head: elementwise, so the slices serve."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=301, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=3, head_dim=32, final_logit_softcapping=0.5,
    )
    model = Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, 301, (2, 6))
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids)
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 3)
    widths = head_widths(split)
    with torch.no_grad():
        out = split(input_ids=ids, labels=ids)
    assert sorted(widths) == [100, 100, 101]
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    torch.testing.assert_close(out.logits, ref.logits, **TOL)


class DoublesLogitsInPlace(torch.nn.Module):
    """User code around a causal LM that changes its logits in place: run once per device, it must see a tensor of
    that device's own."""

    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        logits = self.lm(input_ids=input_ids).logits
        logits.mul_(2)
        return logits


def test_code_around_the_model_gets_logits_of_each_devices_own():
    wrapped = DoublesLogitsInPlace(tiny())
    ids = torch.randint(0, 301, (2, 5))
    with torch.no_grad():
        ref = wrapped(ids)
    split = tp.tensor_parallel(copy.deepcopy(wrapped), ["cpu"] * 2)
    with torch.no_grad():
        torch.testing.assert_close(split(ids), ref, **TOL)
