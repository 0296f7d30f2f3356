"""Under torchrun: gathered saves hold the real weights (not the padded "stacked" DTensor layout), and
`from_pretrained(path, mesh=...)` builds the model empty and has each rank read only its own slices
(safetensors, a tensorshard sharded folder, GGUF).

Tolerances: gathered weights and weights read back are compared bit for bit; outputs of a model loaded
under torchrun against the unsplit model within 1e-5 relative (fp32: the split sums in another order).
"""

import copy

import pytest
import torch

import tensorshard as tp
from support import plans
from support.checkpoints import build, differ, gathered, probe
from support.harness import world_mesh
from support.helpers import rel_err
from support.models import Transformer

pytestmark = pytest.mark.timeout(180)

PLAN = plans.transformer(8, 2)


# --- tasks (every rank) ----------------------------------------------------------------------------------


def gathered_save_task(folder: str, expected: dict) -> dict:
    model = tp.parallelize(build(), world_mesh(), plan=PLAN)
    wq = model.layers[0].attn.wq.weight
    result = {"full_tensor": tuple(wq.full_tensor().shape), "differ": differ(gathered(model), expected)}
    tp.save_gathered(model, folder, max_shard_size="100KB", progress=False)  # several files and an index, from rank 0
    return result


def tied() -> Transformer:
    model = build()
    model.output.weight = model.tok_embeddings.weight  # (96, 64) both, split by vocabulary on both sides
    return model


TIED_PLAN = PLAN | {"output": tp.ColwiseParallel(gather_output=True)}


def streaming_task(hf_folder: str, sharded_folder: str, tied_folder: str, expected: dict) -> dict:
    mesh = world_mesh()
    model = tp.from_pretrained(hf_folder, mesh=mesh, model=build, plan=PLAN, progress=False)
    w1 = model.layers[0].ffn.w1.weight
    result = {
        "dtensor": type(w1).__name__, "rows": w1.to_local().shape[0], "out": probe(model),
        "differ": differ(gathered(model), expected),
    }
    # a tensorshard folder saved in-process at 2 devices; no plan given: the stored one
    again = tp.from_pretrained(sharded_folder, mesh=mesh, model=build, progress=False)
    result["stored_plan"] = again.tensorshard.plan == PLAN
    result["differ_sharded"] = differ(gathered(again), expected)
    ties = tp.from_pretrained(tied_folder, mesh=mesh, model=tied, progress=False)  # filled once, still one tensor
    result["tied"] = ties.output.weight is ties.tok_embeddings.weight and not ties.output.weight.is_meta
    result["tied_out"] = probe(ties)
    return result


def transformers_task(folder: str, gguf_path: str) -> dict:
    from support import tiny_llama

    ref = tiny_llama.build()
    mesh = world_mesh()
    model = tp.parallelize(copy.deepcopy(ref), mesh, plan=tiny_llama.plan())
    model.save_pretrained(folder)  # every rank calls it; rank 0 writes the unsplit weights

    ids = torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    loaded = tp.from_pretrained(folder, mesh=mesh, plan=tiny_llama.plan(), progress=False)
    with torch.no_grad():
        result = {"err": rel_err(loaded(input_ids=ids).logits, ref(input_ids=ids).logits), "eval": not loaded.training}
        from_gguf = tp.from_pretrained(gguf_path, mesh=mesh, plan=tiny_llama.plan(), progress=False)
        result["gguf_logits"] = from_gguf(input_ids=ids).logits
    return result


# --- tests -------------------------------------------------------------------------------------------------


def test_gathered_saves_hold_the_real_weights(pool3, tmp_path):
    from safetensors.torch import load_file

    ref = build()
    expected = ref.state_dict()
    results = pool3.run(gathered_save_task, str(tmp_path), expected)
    for r in results:
        # 8 query heads in 2 KV groups over 3 ranks: slices of unequal size, so DTensor's own full_tensor()
        # gives the padded storage (3 x the largest slice, 32 rows); tensorshard's gathered state dict gives
        # the real (64, 64) weight, on every rank.
        assert r["full_tensor"] == (96, 64)
        assert r["differ"] == []
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    state = {k: v for f in files for k, v in load_file(f).items()}
    plain = Transformer(n_heads=8, n_kv_heads=2, bias=True)
    plain.load_state_dict(state, strict=True)  # unsplit names and shapes
    assert differ(plain.state_dict(), expected) == []


def test_from_pretrained_under_torchrun_streams_each_ranks_slices(pool3, tmp_path):
    ref = build()
    tp.save_gathered(tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=PLAN), tmp_path / "hf", progress=False)
    tp.save_sharded(tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=PLAN), tmp_path / "sharded")
    ref_tied = tied()
    tp.save_sharded(tp.tensor_parallel(copy.deepcopy(ref_tied), ["cpu"] * 2, plan=TIED_PLAN), tmp_path / "tied")
    args = str(tmp_path / "hf"), str(tmp_path / "sharded"), str(tmp_path / "tied"), ref.state_dict()
    results = pool3.run(streaming_task, *args)
    assert [r["rows"] for r in results] == [59, 59, 58]  # 176 MLP features over 3 ranks
    for r in results:
        assert r["dtensor"] == "DTensor" and r["differ"] == [] and r["differ_sharded"] == [] and r["stored_plan"]
        assert rel_err(r["out"], probe(ref)) < 1e-5
        assert r["tied"] and rel_err(r["tied_out"], probe(ref_tied)) < 1e-5


def test_transformers_save_pretrained_and_from_pretrained_under_torchrun(pool4, tmp_path):
    transformers = pytest.importorskip("transformers")
    from support import tiny_gguf
    from support import tiny_llama

    ref = tiny_llama.build()
    gguf_path = tiny_gguf.write_gguf(ref, tmp_path / "tiny.gguf")
    results = pool4.run(transformers_task, str(tmp_path / "saved"), str(gguf_path))  # KV heads on 2 ranks each

    saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved")  # a plain model loads it
    assert differ(saved.state_dict(), ref.state_dict()) == []
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        from_gguf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf").eval()
        expected = from_gguf(input_ids=ids).logits  # transformers' own reading of the GGUF file
    for r in results:
        assert r["err"] < 1e-5 and r["eval"]
        assert rel_err(r["gguf_logits"], expected) < 1e-5
