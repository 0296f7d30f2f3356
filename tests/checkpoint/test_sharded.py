"""Sharded checkpoints: saved at one device count, loaded at another, bit for bit, optimizer included."""

import copy
import json

import pytest
import torch

import tensorshard as tp
from support import plans
from support.checkpoints import gathered
from support.helpers import rel_err
from support.models import FeedForward, Transformer

pytestmark = pytest.mark.timeout(60)

LR = 1e-2


def make_model(n: int, sharded: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # weights only; test data use private generators
    return tp.tensor_parallel(Transformer(n_heads=8, n_kv_heads=2, bias=True), ["cpu"] * n, plan=plans.transformer(8, 2), sharded=sharded)


def train(model, opt, gen, steps: int) -> list[torch.Tensor]:
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 96, (2, 7), generator=gen)
        loss = model(tokens).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-device model (ZeRO-3 on) trained 3 steps and saved; then trained 3 more steps uninterrupted."""
    path = tmp_path_factory.mktemp("ckpt")
    model = make_model(2, sharded=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(7)
    train(model, opt, gen, 3)
    tp.save_sharded(model, path, optimizer=opt)
    state = {k: v.clone() for k, v in gathered(model).items()}
    probe = torch.randint(0, 96, (3, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(probe)
    after = train(model, opt, torch.Generator().manual_seed(8), 3)
    return {"path": path, "state": state, "probe": probe, "out": out, "after": after}


@pytest.mark.parametrize("n, sharded", [(1, False), (2, True), (3, False), (4, True)])
def test_save_at_two_load_at_n_resumes_like_the_uninterrupted_run(trained, n, sharded):
    model = make_model(n, sharded=sharded, seed=1)  # other weights: the load must replace them all
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # other lr: the load restores the saved one
    tp.load_sharded(model, trained["path"], optimizer=opt, progress=False)
    assert opt.param_groups[0]["lr"] == LR

    state = gathered(model)
    assert list(state) == list(trained["state"])
    for key, value in trained["state"].items():
        assert torch.equal(state[key], value), key  # resharding is exact to the bit
    with torch.no_grad():
        out = model(trained["probe"])
    after = train(model, opt, torch.Generator().manual_seed(8), 3)
    if n == 2:  # same device count: the very same arithmetic
        assert torch.equal(out, trained["out"])
        assert all(torch.equal(a, b) for a, b in zip(after, trained["after"]))
    else:  # another count sums row-parallel partial products in another order: fp32 rounding only
        assert rel_err(out, trained["out"]) < 1e-5
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(after, trained["after"]))


def test_plain_module_loads_a_sharded_checkpoint_and_saves_one(trained, tmp_path):
    plain = Transformer(n_heads=8, n_kv_heads=2, bias=True)
    tp.load_sharded(plain, trained["path"], progress=False)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in trained["state"].items())
    tp.save_sharded(plain, tmp_path)  # one rank, every tensor whole
    model = make_model(3, sharded=True, seed=2)
    tp.load_sharded(model, tmp_path, progress=False)
    assert all(torch.equal(gathered(model)[k], v) for k, v in trained["state"].items())


def test_folder_holds_one_file_per_device_and_an_index(trained):
    index = tp.checkpoint.read_index(trained["path"])
    assert index["world_size"] == 2 and index["devices"] == ["cpu[0]", "cpu[1]"]
    assert tp.Plan.from_dict(index["plan"]) == plans.transformer(8, 2)
    assert "layers.0.attn_norm.weight" in index["zero"]
    model_files = sorted(f for f in index["files"] if f.startswith("model-"))
    assert model_files == ["model-g000001-rank00000-of-00002.safetensors", "model-g000001-rank00001-of-00002.safetensors"]
    wq = index["tensors"]["layers.0.attn.wq.weight"]  # 8 heads of 8 features: 4 heads per device
    assert [(c["offsets"], c["sizes"]) for c in wq["chunks"]] == [([0, 0], [32, 64]), ([32, 0], [32, 64])]
    # The step count is one scalar per parameter, stored once.
    step = index["optimizer"]["tensors"]["state.layers.0.attn.wq.weight.step"]
    assert step["shape"] == [] and len(step["chunks"]) == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_distributed_checkpoint_reads_our_folder(trained):
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load

    state = {k: torch.zeros_like(v) for k, v in trained["state"].items()}
    load(state, storage_reader=HuggingFaceStorageReader(str(trained["path"])), no_dist=True)
    for key, value in trained["state"].items():
        assert torch.equal(state[key], value), key


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_distcp_folder_loads_at_another_device_count(trained, tmp_path):
    import torch.distributed.checkpoint as dcp

    # Lightning's layouts: the model under "model" (Fabric), or under "state_dict" as the attribute "net" of
    # a LightningModule (Trainer). One process writes them here; torchrun ranks write chunks (see
    # test_torchrun_interop.py).
    fabric = {"model": trained["state"], "step": torch.tensor(3)}
    trainer = {"state_dict": {f"net.{k}": v for k, v in trained["state"].items()}, "optimizer_0": {"lr": 0.1}}
    for name, state in (("fabric", fabric), ("trainer", trainer)):
        dcp.save(state, checkpoint_id=str(tmp_path / name), no_dist=True)
        model = make_model(3, sharded=True, seed=2)
        tp.load_sharded(model, tmp_path / name, progress=False)
        assert all(torch.equal(gathered(model)[k], v) for k, v in trained["state"].items()), name


def test_kv_heads_held_by_two_devices_are_stored_once(tmp_path):
    ref = Transformer(n_heads=8, n_kv_heads=2)  # at 3 devices, devices 0 and 1 both hold KV head 0
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 3, plan=plans.transformer(8, 2), sharded=False)
    tp.save_sharded(model, tmp_path)
    wk = tp.checkpoint.read_index(tmp_path)["tensors"]["layers.0.attn.wk.weight"]  # (16, 64): 2 heads of 8
    ranks = [(c["file"].split("-")[2], c["offsets"]) for c in wk["chunks"]]
    assert ranks == [("rank00000", [0, 0]), ("rank00002", [8, 0])]  # rank 1 adds nothing
    back = tp.tensor_parallel(Transformer(n_heads=8, n_kv_heads=2), ["cpu"] * 2, plan=plans.transformer(8, 2), sharded=False)
    tp.load_sharded(back, tmp_path, progress=False)
    assert all(torch.equal(gathered(back)[k], v) for k, v in ref.state_dict().items())


def tied_transformer() -> Transformer:
    model = Transformer(n_heads=8, n_kv_heads=2)
    model.output.weight = model.tok_embeddings.weight  # (96, 64) both; split by vocabulary on both sides
    return model


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    torch.manual_seed(0)
    ref = tied_transformer()
    plan = plans.transformer(8, 2) | {"output": tp.ColwiseParallel(gather_output=True)}
    tp.save_sharded(tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plan), tmp_path)
    index = tp.checkpoint.read_index(tmp_path)
    assert index["aliases"] == {"output.weight": "tok_embeddings.weight"}
    assert "output.weight" not in index["tensors"]

    loaded = tp.from_pretrained(tmp_path, ["cpu"] * 3, model=tied_transformer, progress=False)  # the stored plan
    assert loaded.plan == plan
    for shard in loaded.module_shards:
        assert shard.output.weight is shard.tok_embeddings.weight  # filled once, still one parameter
    tokens = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    assert rel_err(loaded(tokens), ref(tokens)) < 1e-5

    with pytest.raises(ValueError, match="'layers.\\*.attn' matches no module of FeedForward"):
        tp.from_pretrained(tmp_path, ["cpu"] * 2, model=lambda: FeedForward(64, 176), progress=False)

    untied = Transformer(n_heads=8, n_kv_heads=2)  # a model that keeps two copies gets both
    tp.load_sharded(untied, tmp_path, progress=False)
    assert torch.equal(untied.output.weight, ref.tok_embeddings.weight)
    assert torch.equal(untied.tok_embeddings.weight, ref.tok_embeddings.weight)


# --- what does not fit is named, and nothing changes --------------------------------------------------


def test_wrong_shapes_and_dtypes_are_listed_and_the_model_is_untouched(trained):
    wide = tp.tensor_parallel(Transformer(dim=64, hidden=200, n_heads=8, n_kv_heads=2, bias=True), ["cpu"] * 2, plan=plans.transformer(8, 2))
    before = {k: v.clone() for k, v in gathered(wide).items()}
    with pytest.raises(ValueError, match=r"layers.0.ffn.w1.weight: checkpoint \[176, 64\], model \[200, 64\]") as info:
        tp.load_sharded(wide, trained["path"], progress=False)
    assert "Nothing was loaded" in str(info.value)
    assert all(torch.equal(gathered(wide)[k], v) for k, v in before.items())

    half = make_model(2, sharded=False).to(torch.bfloat16)
    with pytest.raises(ValueError, match="another dtype: .*checkpoint torch.float32, model torch.bfloat16"):
        tp.load_sharded(half, trained["path"], progress=False)


def test_missing_and_unexpected_tensors_are_named(trained, tmp_path):
    bigger = tp.tensor_parallel(Transformer(n_layers=3, n_heads=8, n_kv_heads=2, bias=True), ["cpu"] * 2, plan=plans.transformer(8, 2))
    with pytest.raises(ValueError, match="not in the checkpoint: layers.2"):
        tp.load_sharded(bigger, trained["path"], progress=False)
    smaller = tp.tensor_parallel(Transformer(n_layers=1, n_heads=8, n_kv_heads=2, bias=True), ["cpu"] * 2, plan=plans.transformer(8, 2))
    with pytest.raises(ValueError, match="not in the model: layers.1"):
        tp.load_sharded(smaller, trained["path"], progress=False)
    tp.load_sharded(smaller, trained["path"], strict=False, progress=False)  # takes what fits
    assert torch.equal(gathered(smaller)["layers.0.attn.wq.weight"], trained["state"]["layers.0.attn.wq.weight"])


def test_a_missing_rank_file_is_named(trained, tmp_path):
    import shutil

    shutil.copytree(trained["path"], tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model-g000001-rank00001-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="file model-g000001-rank00001-of-00002.safetensors is missing"):
        tp.load_sharded(make_model(2, sharded=False), tmp_path / "ckpt", progress=False)
    index = json.loads((tmp_path / "ckpt" / "tensorshard.json").read_text())
    index["format"] = "something else"
    (tmp_path / "ckpt" / "tensorshard.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="expected format 'tensorshard.sharded/1'"):
        tp.load_sharded(make_model(2, sharded=False), tmp_path / "ckpt", progress=False)


def test_optimizer_must_match(trained, tmp_path):
    model = make_model(2, sharded=False)
    with pytest.raises(ValueError, match="torch.optim.adamw.AdamW, but the optimizer given is a torch.optim.sgd.SGD"):
        tp.load_sharded(model, trained["path"], optimizer=torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    others = [p for n, p in model.named_parameters() if "norm" not in n]
    split_groups = torch.optim.AdamW([{"params": norms}, {"params": others}])
    before = {k: v.clone() for k, v in gathered(model).items()}
    with pytest.raises(ValueError, match="param group 0 of the optimizer holds .* matches none"):
        tp.load_sharded(model, trained["path"], optimizer=split_groups, progress=False)
    assert all(torch.equal(gathered(model)[k], v) for k, v in before.items())  # refused before loading
    tp.save_sharded(model, tmp_path)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        tp.load_sharded(model, tmp_path, optimizer=torch.optim.AdamW(model.parameters()), progress=False)


def test_saving_a_model_without_weights_is_refused(tmp_path):
    with torch.device("meta"):
        empty = Transformer()
    model = tp.tensor_parallel(empty, ["cpu"] * 2, plan=plans.transformer(8, 2))
    with pytest.raises(RuntimeError, match="meta device"):
        tp.save_sharded(model, tmp_path)
