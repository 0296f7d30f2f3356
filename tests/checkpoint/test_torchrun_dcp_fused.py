"""A torch.distributed.checkpoint of a GPT-2 split by `parallelize` over 2 ranks, whose fused q|k|v
projection (`c_attn`) is split by blocks: each rank holds its rows of q, of k and of v, and the DTensor's
"global" tensor is the ranks' local tensors stacked, i.e. the real rows permuted. Without padding its
stored shape is the real one, so only the loading model's plan (the tensor is split by blocks) and DCP's
chunks (one equal piece per saving rank along the split dim) tell it apart. `tp.load_sharded` must refuse
it by name, at any device count, with the model untouched; `dcp.load` at the saving count and plan, then
`tp.save_sharded`, converts it (what the error says), and the result loads anywhere, exactly.
"""

import copy
import os

import pytest
import torch

import tensorshard as tp
from support.checkpoints import gathered
from support.harness import world_mesh

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def gpt2(seed: int):
    import transformers as T

    torch.manual_seed(seed)
    config = T.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=64, tie_word_embeddings=False,
                          bos_token_id=0, eos_token_id=0)
    return T.GPT2LMHeadModel(config).eval()


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model(input_ids=ids).logits


def save_task(folder: str) -> list[str]:
    """Save with DCP as a torchrun user would; the same ranks load it back with tp.load_sharded (refused)
    and with dcp.load (exact), then convert it with tp.save_sharded."""
    import torch.distributed.checkpoint as dcp

    mesh = world_mesh()
    model = tp.parallelize(gpt2(0), mesh)
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(folder, "distcp"))
    wrong = []
    other = tp.parallelize(gpt2(1), mesh)
    before = gathered(other)
    try:
        tp.load_sharded(other, os.path.join(folder, "distcp"), progress=False)
        wrong.append("tp.load_sharded read the stacked c_attn without an error")
    except ValueError as e:
        if "transformer.h.0.attn.c_attn.weight" not in str(e) or "save_sharded" not in str(e):
            wrong.append(f"unexpected error: {e}")
    wrong += [f"changed by the refused load: {k}" for k, v in gathered(other).items() if not torch.equal(v, before[k])]
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(folder, "distcp"))  # the fix the error names, step 1
    wrong += [f"dcp.load {k}" for k, v in gathered(other).items() if not torch.equal(v, gathered(model)[k])]
    tp.save_sharded(other, os.path.join(folder, "converted"))  # step 2
    return wrong


def test_dcp_of_a_block_split_fused_projection_is_refused_and_converts(pool2, tmp_path):
    ref = gpt2(0)
    assert pool2.run(save_task, str(tmp_path)) == [[]] * 2

    for devices in (1, 2, 3):
        model = gpt2(1) if devices == 1 else tp.tensor_parallel(gpt2(1), ["cpu"] * devices)
        state = (lambda: gathered(model)) if devices > 1 else (lambda: {k: v.clone() for k, v in model.state_dict().items()})
        before = state()
        with pytest.raises(ValueError, match=r"(?s)transformer\.h\.0\.attn\.c_attn\.weight.*stacked.*save_sharded") as e:
            tp.load_sharded(model, tmp_path / "distcp", progress=False)
        assert "c_attn.bias" in str(e.value) and "mlp.c_fc" not in str(e.value)  # even single-block splits are real
        assert all(torch.equal(v, before[k]) for k, v in state().items()), devices

        tp.load_sharded(model, tmp_path / "converted", progress=False)
        assert (logits(model) - logits(ref)).abs().max().item() < 1e-6, devices
