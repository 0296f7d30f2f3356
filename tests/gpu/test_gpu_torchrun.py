"""The torchrun engine with one rank on NCCL, in a fresh process launched by torchrun itself: tensor_parallel(...,
distributed=True) picks cuda:LOCAL_RANK and initialises an NCCL group; parallelize on a CUDA mesh gives the
unsplit model's logits, labels loss, gradients and greedy tokens; a sharded checkpoint saved there loads in
one process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import tensorshard as tp
from support.gpu import ONE_GPU
from support.harness import child_env
from support.hf_configs import VOCAB, tiny_model
from support.helpers import rel_err

pytestmark = ONE_GPU + [pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent("""
    import copy, json, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import tensorshard as tp
    from support.hf_configs import VOCAB, tiny_model

    out = {}
    # 1. distributed=True from torchrun's environment: the rank's GPU and an NCCL group, made by tensorshard
    ref = tiny_model("llama").cuda()
    model = tp.tensor_parallel(copy.deepcopy(ref).cpu(), distributed=True)
    out["backend"] = dist.get_backend()
    out["mesh"] = model.tensorshard.mesh.device_type
    out["devices"] = sorted({p.device.type for p in model.parameters()})
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids).logits           # inputs on the CPU are moved to the rank's GPU
    out["logits_device"] = logits.device.type
    out["logits"] = (logits - ref(input_ids=ids.cuda()).logits).norm().item() / ref(input_ids=ids.cuda()).logits.norm().item()

    # 2. parallelize on a CUDA mesh, trained with labels= (the loss from the vocabulary slice)
    ref.train()
    split = tp.parallelize(copy.deepcopy(ref), init_device_mesh("cuda", (1,)))
    x = ids.cuda()
    loss, want = split(input_ids=x, labels=x).loss, ref(input_ids=x, labels=x).loss
    loss.backward()
    want.backward()
    out["loss"] = abs(loss.item() - want.item()) / abs(want.item())
    got = split.model.layers[0].mlp.down_proj.weight.grad.full_tensor()
    want_grad = ref.model.layers[0].mlp.down_proj.weight.grad
    out["grad"] = ((got - want_grad).norm() / want_grad.norm()).item()

    # 3. greedy decoding; one SGD step on both, then a sharded checkpoint of the split model and the unsplit
    # model's weights, for the parent to load in one process
    split.eval()
    generate = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    out["greedy"] = torch.equal(split.generate(x[:1], **generate), ref.eval().generate(x[:1], **generate))
    torch.optim.SGD(split.parameters(), lr=1.0).step()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    tp.save_sharded(split, sys.argv[1])
    torch.save({k: v.cpu() for k, v in ref.state_dict().items()}, sys.argv[2])
    print("RESULT " + json.dumps(out))
""")


def test_one_rank_on_nccl_matches_the_unsplit_model(tmp_path):
    script = tmp_path / "one_rank.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script), str(tmp_path / "ckpt"), str(tmp_path / "ref.pt")],
        env=child_env(OMP_NUM_THREADS="1"), cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    assert out["backend"] == "nccl" and out["mesh"] == "cuda" and out["devices"] == ["cuda"]
    assert out["logits_device"] == "cuda" and out["logits"] < 1e-5
    assert out["loss"] < 1e-5 and out["grad"] < 1e-5
    assert out["greedy"]

    # the rank's checkpoint loads in one process onto a GPU and a CPU slot: the trained weights, not the initial ones
    trained = tiny_model("llama")
    trained.load_state_dict(torch.load(tmp_path / "ref.pt"))
    model = tp.tensor_parallel(tiny_model("llama"), ["cuda:0", "cpu"])
    tp.load_sharded(model, tmp_path / "ckpt", progress=False)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids.to(model.device)).logits
        assert rel_err(logits, trained(input_ids=ids).logits) < 1e-4
        assert rel_err(logits, tiny_model("llama")(input_ids=ids).logits) > 1e-2
