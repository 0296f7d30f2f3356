"""Checkpoints that do not fit, or are damaged, are refused by name, and nothing changes.

Each case of `CASES` is one row of the checkpoint table in docs/errors.md (`test_docs_rows_match_the_cases`
keeps the two in step): a good checkpoint is copied, damaged the way the row says, and loaded; the test
checks the error type, a piece of the message, that the model is exactly as it was (the same tensor
objects, the same values) and that no file of the checkpoint changed.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

import tensorshard as tp
from support import ROOT, plans
from support.checkpoints import build, gathered
from support.helpers import rel_err
from support.models import FeedForward, Transformer

pytestmark = pytest.mark.timeout(60)

DOCS = ROOT / "docs" / "errors.md"
PLAN = plans.transformer(8, 2)
RANK1 = "model-g000001-rank00001-of-00002.safetensors"


def split(module, n: int = 2):
    return tp.tensor_parallel(module, ["cpu"] * n, plan=PLAN, sharded=False)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """Good checkpoints of one trained model: tensorshard (with AdamW state), Hugging Face, DCP."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("good")
    model = split(build())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))).sum().backward()
    opt.step()
    tp.save_sharded(model, root / "sharded", optimizer=opt)
    tp.save_gathered(model, root / "hf", max_shard_size="100KB", progress=False)
    with tp.save_tensor_parallel(model):
        state = model.state_dict()
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"model": state}, checkpoint_id=str(root / "distcp"), no_dist=True)
    tp.save_sharded(split(build(hidden=200)), root / "wider")  # another model's files, same names
    return {"sharded": root / "sharded", "hf": root / "hf", "distcp": root / "distcp", "wider": root / "wider"}


# --- ways to damage a checkpoint -----------------------------------------------------------------------------


def truncate(name: str, nbytes: int = 100) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / name
        path.write_bytes(path.read_bytes()[:-nbytes])

    return damage


def overwrite(name: str, at: int, data: bytes) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / name
        raw = bytearray(path.read_bytes())
        raw[at:at + len(data)] = data
        path.write_bytes(bytes(raw))

    return damage


def remove(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def edit_index(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        index = json.loads((folder / "tensorshard.json").read_text())
        change(index)
        (folder / "tensorshard.json").write_text(json.dumps(index))

    return damage


def from_other_checkpoint(name: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        shutil.copy(folder.parent / "wider" / name, folder / name)

    return damage


def hf_shard(folder: Path) -> str:
    return sorted(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())[-1]


def distcp_file(folder: Path) -> str:
    return next(p.name for p in folder.glob("*.distcp"))


def nothing(folder: Path) -> None:
    pass


@dataclass
class Case:
    id: str
    checkpoint: str  # which good checkpoint to start from
    damage: Callable[[Path], None]
    error: type
    excerpt: str  # a piece of the message, as docs/errors.md quotes it
    model: Callable = lambda: split(build(seed=1))
    optimizer: bool = False


CASES = [
    Case("another-model", "sharded", nothing, ValueError,
         "tensor(s) of the model are not in the checkpoint: w1.weight, w2.weight, w3.weight",
         model=lambda: tp.tensor_parallel(FeedForward(64, 176), ["cpu"] * 2, plan=plans.FEED_FORWARD)),
    Case("another-size", "sharded", nothing, ValueError,
         "layers.0.ffn.w1.weight: checkpoint [176, 64], model [200, 64]", model=lambda: split(build(seed=1, hidden=200))),
    Case("another-dtype", "sharded", nothing, ValueError,
         "another dtype: tok_embeddings.weight: checkpoint torch.float32, model torch.bfloat16",
         model=lambda: split(build(seed=1).to(torch.bfloat16))),
    Case("truncated-rank-file", "sharded", truncate(RANK1), ValueError,
         f"{RANK1} is truncated: its header announces"),
    Case("truncated-hf-file", "hf", lambda f: truncate(hf_shard(f))(f), ValueError, "is truncated: its header announces"),
    Case("truncated-distcp-file", "distcp", lambda f: truncate(distcp_file(f))(f), ValueError,
         "is truncated: .metadata places data up to byte"),
    Case("truncated-optimizer-file", "sharded", truncate("optimizer/optim-g000001-rank00000-of-00002.safetensors"),
         ValueError, "optim-g000001-rank00000-of-00002.safetensors is truncated", optimizer=True),
    Case("corrupted-header", "sharded", overwrite(RANK1, 8, b"\x00garbage"), ValueError,
         f"{RANK1}: the header is not valid JSON"),
    Case("corrupted-header-hf", "hf", lambda f: overwrite(hf_shard(f), 8, b"\x00garbage")(f), ValueError,
         "the header is not valid JSON"),
    Case("corrupted-header-length", "sharded", overwrite(RANK1, 0, b"\xff" * 8), ValueError,
         f"{RANK1}: the header length field says"),
    Case("corrupted-index", "sharded", overwrite("tensorshard.json", 0, b"{garbage"), ValueError,
         "tensorshard.json is not valid JSON"),
    Case("corrupted-distcp-metadata", "distcp", overwrite(".metadata", 0, b"garbage"), ValueError,
         ".metadata cannot be read"),
    Case("missing-rank-file", "sharded", remove(RANK1), ValueError, f"file {RANK1} is missing"),
    Case("index-names-missing-file", "sharded", edit_index(lambda i: i["files"].append("model-extra.safetensors")),
         ValueError, "the index names 1 file(s) that do not exist: model-extra.safetensors"),
    Case("hf-index-names-missing-file", "hf", lambda f: remove(hf_shard(f))(f), FileNotFoundError,
         "model.safetensors.index.json names 1 file(s) that do not exist"),
    Case("file-from-another-checkpoint", "sharded", from_other_checkpoint(RANK1), ValueError,
         f"{RANK1}: layers.0.ffn.w1.weight is [100, 64] F32, the index says [88, 64] F32"),
]


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def snapshot(model) -> dict:
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return {name: (id(t), t.detach().clone()) for name, t in tensors}


def assert_unchanged(model, before: dict) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (ident, value) in before.items():
        assert after[name][0] == ident and torch.equal(after[name][1], value), name


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_refused(case, good, tmp_path):
    folder = tmp_path / case.checkpoint
    shutil.copytree(good[case.checkpoint], folder)
    shutil.copytree(good["wider"], tmp_path / "wider")
    case.damage(folder)
    model = case.model()
    optimizer = torch.optim.AdamW(model.parameters()) if case.optimizer else None
    before, files = snapshot(model), digests(folder)
    with pytest.raises(case.error) as info:
        tp.load_sharded(model, folder, optimizer=optimizer, progress=False)
    assert case.excerpt in str(info.value), str(info.value)
    assert_unchanged(model, before)
    assert not optimizer or not optimizer.state
    assert digests(folder) == files


# --- what is not an error -------------------------------------------------------------------------------------


def test_another_plan_is_resharded_exactly(good):
    """Saved with the attention and MLP split (2 devices), loaded with only the MLP split (3 devices)."""
    mlp_only = tp.Plan({"layers.*.ffn.w[13]": tp.ColwiseParallel(), "layers.*.ffn.w2": tp.RowwiseParallel()})
    model = tp.tensor_parallel(build(seed=1), ["cpu"] * 3, plan=mlp_only, sharded=False)
    tp.load_sharded(model, good["sharded"], progress=False)
    plain = build(seed=2)
    tp.load_sharded(plain, good["sharded"], progress=False)
    with tp.save_tensor_parallel(model):
        state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())


def test_a_meta_model_names_the_loader_then_loads(good):
    with torch.device("meta"):
        empty = Transformer(n_heads=8, n_kv_heads=2, bias=True)
    model = split(empty)
    tokens = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match=r"is on the meta device: .*tp\.load_sharded\(model, path\)"):
        model(tokens)
    tp.load_sharded(model, good["sharded"], progress=False)  # each device's slices created where they belong
    plain = build(seed=2)
    tp.load_sharded(plain, good["sharded"], progress=False)
    assert rel_err(model(tokens), plain(tokens)) < 1e-5


def test_a_read_error_during_the_load_says_what_was_loaded(good, tmp_path, monkeypatch):
    """A failure only reading can find (an I/O error, a file removed meanwhile): the note says which tensors
    had been copied into the model; tensors on the meta device are not installed at all."""
    import safetensors

    shutil.copytree(good["sharded"], tmp_path / "ckpt")
    real, calls = safetensors.safe_open, []

    def failing_open(*args, **kwargs):  # the third file opened fails, as a disk would
        calls.append(args[0])
        if len(calls) == 3:
            raise OSError(5, "Input/output error", args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", failing_open)
    model = split(build(seed=1))
    with pytest.raises(OSError, match="Input/output error") as info:
        tp.load_sharded(model, tmp_path / "ckpt", progress=False)
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "while reading 'layers.0.attn_norm.weight'" in note  # the embedding's two files opened fine
    assert "after 1 of 34 tensors had been copied into the model (tok_embeddings.weight)" in note

    calls.clear()
    with torch.device("meta"):
        empty = Transformer(n_heads=8, n_kv_heads=2, bias=True)
    meta = split(empty)
    with pytest.raises(OSError) as info:
        tp.load_sharded(meta, tmp_path / "ckpt", progress=False)
    assert "nothing in the model was changed" in " ".join(info.value.__notes__)
    assert all(p.is_meta for p in meta.parameters())


# --- under torchrun: a failure on one rank stops every rank ---------------------------------------------------


def failed_save_task(folder: str) -> dict:
    """Generation 1 is saved; rank 1 cannot put its file of generation 2 in place (a directory has its name)."""
    import torch.distributed as dist
    from support.harness import world_mesh

    folder = Path(folder)
    model = tp.parallelize(build(), world_mesh(), plan=PLAN)
    tp.save_sharded(model, folder)
    committed = {name: digest for name, digest in digests(folder).items()}
    saved = gathered(model)
    if dist.get_rank() == 0:
        (folder / "model-g000002-rank00001-of-00002.safetensors").mkdir()
        (folder / "model-g000002-rank00001-of-00002.safetensors" / "in-the-way").write_text("")
    dist.barrier()
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    try:
        tp.save_sharded(model, folder)
        result = {"error": None}
    except OSError as e:
        result = {"error": type(e).__name__, "notes": " ".join(getattr(e, "__notes__", []))}
    dist.barrier()  # every rank has finished removing its own temporary file before the folder is read
    now = digests(folder)
    result["committed_intact"] = all(now.get(name) == digest for name, digest in committed.items())
    result["generation"] = tp.checkpoint.read_index(folder)["generation"]
    check = tp.parallelize(build(seed=3), world_mesh(), plan=PLAN)
    tp.load_sharded(check, folder, progress=False)
    result["loads_generation_1"] = all(torch.equal(v, saved[k]) for k, v in gathered(check).items())
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder / "model-g000002-rank00001-of-00002.safetensors")
    dist.barrier()
    tp.save_sharded(model, folder)  # and the next save cleans up what the failed one left
    index = tp.checkpoint.read_index(folder)
    result["clean"] = sorted(p.name for p in folder.iterdir()) == sorted(["tensorshard.json"] + index["files"])
    return result


def failed_load_task(good: str, broken: str) -> dict:
    """Rank 1 sees a checkpoint without one of its files (as a node with an incomplete copy would)."""
    import torch.distributed as dist
    from support.harness import world_mesh

    model = tp.parallelize(build(seed=1), world_mesh(), plan=PLAN)
    before = gathered(model)
    try:
        tp.load_sharded(model, good if dist.get_rank() == 0 else broken, progress=False)
        result = {"error": None}
    except ValueError as e:
        result = {"error": str(e), "notes": " ".join(getattr(e, "__notes__", []))}
    result["unchanged"] = all(torch.equal(v, before[k]) for k, v in gathered(model).items())
    return result


@pytest.mark.timeout(180)
def test_a_save_failing_on_one_rank_fails_on_every_rank_and_keeps_the_checkpoint(pool2, tmp_path):
    results = pool2.run(failed_save_task, str(tmp_path / "ckpt"))
    for r in results:
        assert r["error"] in ("IsADirectoryError", "OSError")
        assert r["committed_intact"] and r["generation"] == 1 and r["loads_generation_1"] and r["clean"]
    assert "raised on rank 1 while renaming the files into place; rank 0 stops with it" in results[0]["notes"]


@pytest.mark.timeout(180)
def test_a_load_failing_on_one_rank_fails_on_every_rank_and_changes_nothing(pool2, good, tmp_path):
    shutil.copytree(good["sharded"], tmp_path / "broken")
    (tmp_path / "broken" / RANK1).unlink()
    results = pool2.run(failed_load_task, str(good["sharded"]), str(tmp_path / "broken"))
    for r in results:
        assert f"file {RANK1} is missing" in r["error"] and r["unchanged"]
    assert "raised on rank 1 while checking the checkpoint; rank 0 stops with it" in results[0]["notes"]


# --- the docs ----------------------------------------------------------------------------------------------


def test_docs_rows_match_the_cases():
    rows = {m.group(1): line for line in DOCS.read_text().splitlines() for m in re.finditer(r"test_refused\[([\w-]+)\]", line)}
    assert set(rows) == {c.id for c in CASES}
    for case in CASES:
        assert f"`{case.error.__name__}`" in rows[case.id], case.id
        assert case.excerpt.replace("|", "\\|") in rows[case.id], case.id
