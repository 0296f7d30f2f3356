"""Decode captures kept on disk (engines/capture_store.py, engines/inprocess/kept_captures.py): once a kind of decode
call's step is compiled, the shards' dynamo graphs are written to the store; the first call of that kind on a split
model made later (another process, or another split model of the same shape in this one) builds its step from them
without tracing, with the unsplit model's tokens and the eager step's collectives. An entry whose traced source
files changed, or that cannot be read, is not used (traced again, and replaced); the switch turns it all off."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import tensorshard as tp
from tensorshard.engines import capture_store
from tensorshard.engines.inprocess.stitched_decode import STITCHES
from support.harness import child_env
from support.hf_configs import tiny_config, tiny_model
from support.helpers import log_messages

pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(not STITCHES, reason="captures are stitched from torch 2.13 on")]

KEPT = "built from the shards' graphs kept on disk"


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store on, in a folder of this test's own; dynamo's caches emptied (every split model made in a process
    adds frames to the model's shared code, and past dynamo's recompile limit a call runs eagerly: nothing traced)."""
    torch._dynamo.reset()
    monkeypatch.setenv("TENSORSHARD_CAPTURE_CACHE", "1")
    monkeypatch.setattr(capture_store, "folder", lambda: tmp_path / "captures")
    return tmp_path / "captures"


def _ids() -> torch.Tensor:
    return torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(0))


def _greedy(model, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(_ids(), attention_mask=torch.ones_like(_ids()), max_new_tokens=5, do_sample=False, **kwargs)


def _traced_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _fast(split) -> tuple[torch.Tensor, list[str], int, dict]:
    """The fast path's tokens, its log, the graphs dynamo traced on the way, and its collectives."""
    messages, stop = log_messages("tensorshard.engines.inprocess", 20)
    before = _traced_graphs()
    try:
        with tp.count_collectives() as counted:
            out = _greedy(split, cache_implementation="static")
    finally:
        stop()
    return out, messages, _traced_graphs() - before, dict(counted.counts)


def test_a_later_split_model_decodes_from_the_kept_captures_without_tracing(store):
    model = tiny_model("llama")
    expected = _greedy(model)
    out, messages, traced, _ = _fast(tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"]))
    assert torch.equal(out, expected) and traced == 2, (traced, messages)  # one graph per shard
    assert len(list(store.glob("*.pkl"))) == 1 and not [m for m in messages if KEPT in m], messages

    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    out, messages, traced, counts = _fast(split)
    assert torch.equal(out, expected) and traced == 0, (traced, messages)
    assert len([m for m in messages if KEPT in m]) == 1, messages
    with tp.count_collectives() as eager:
        _greedy(split, cache_implementation="static", disable_compile=True)
    assert counts == eager.counts and counts["all_reduce"] > 0

    # An entry whose traced files changed since is not used: the kind is traced again, and the entry replaced.
    [path] = store.glob("*.pkl")
    entry = pickle.loads(path.read_bytes())
    first = next(iter(entry["files"]))
    entry["files"][first] = "0" * 64
    path.write_bytes(pickle.dumps(entry))
    out, messages, traced, _ = _fast(tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"]))
    assert torch.equal(out, expected) and traced == 2 and not [m for m in messages if KEPT in m], messages
    assert pickle.loads(path.read_bytes())["files"][first] != "0" * 64

    # An entry that does not fit the model after all (here: a weight it names is not there) is dropped before
    # anything runs; the kind is traced, logged, and the entry replaced.
    entry = pickle.loads(path.read_bytes())
    sources = entry["payload"][0]["sources"]
    at = next(i for i, s in enumerate(sources) if s[0] == "weight")
    sources[at] = (*sources[at][:3], "no_such_weight")
    path.write_bytes(pickle.dumps(entry))
    out, messages, traced, _ = _fast(tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"]))
    assert torch.equal(out, expected) and traced == 2, messages
    assert [m for m in messages if "kept on disk for this kind of call were not used (KeyError" in m], messages
    assert "no_such_weight" not in str(pickle.loads(path.read_bytes())["payload"][0]["sources"])


def test_an_entry_is_read_back_only_whole_and_with_its_files_unchanged(store, tmp_path):
    source = tmp_path / "model_code.py"
    source.write_text("x = 1\n")
    assert capture_store.save("k", {"graphs": [1, 2]}, {str(source)})
    assert capture_store.load("k") == {"graphs": [1, 2]} and capture_store.load("other") is None
    assert not [p for p in store.iterdir() if p.suffix != ".pkl"]  # (written to a temporary file, renamed)
    source.write_text("x = 2\n")  # a file dynamo traced has changed
    assert capture_store.load("k") is None
    capture_store.save("k", {"graphs": [1, 2]}, {str(source)})
    (store / "k.pkl").write_bytes((store / "k.pkl").read_bytes()[:20])  # cut short
    assert capture_store.load("k") is None
    capture_store.discard("k")
    assert not (store / "k.pkl").exists()


def test_another_process_decodes_from_the_kept_captures_without_tracing(store, tmp_path):
    """The store's real use: the process that made the entries has ended; a new one loads the same model."""
    from transformers import AutoModelForCausalLM

    tiny_model("llama").save_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()  # (as the other process loads it)
    expected = _greedy(model)
    _fast(tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"]))
    script = textwrap.dedent(f"""
        import json, logging
        from pathlib import Path
        import torch
        from transformers import AutoModelForCausalLM
        import tensorshard as tp
        from tensorshard.engines import capture_store
        torch.set_num_threads(1)
        capture_store.folder = lambda: Path({str(store)!r})
        messages = []
        handler = logging.Handler()
        handler.emit = lambda record: messages.append(record.getMessage())
        logging.getLogger("tensorshard").addHandler(handler)
        logging.getLogger("tensorshard").setLevel(logging.INFO)
        split = tp.tensor_parallel(AutoModelForCausalLM.from_pretrained({str(tmp_path / "model")!r}).eval(), ["cpu", "cpu"])
        ids = torch.tensor({_ids().tolist()})
        with torch.no_grad():
            out = split.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                                 cache_implementation="static")
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print(json.dumps({{"tokens": out.tolist(), "graphs": graphs, "messages": messages}}))
    """)
    env = child_env(TENSORSHARD_CAPTURE_CACHE="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == expected.tolist()
    assert result["graphs"] == 0 and len([m for m in result["messages"] if KEPT in m]) == 1, result


def test_the_key_follows_the_model_and_the_call():
    """The same shape split alike: the same key. Another shape, attribute, device count or kind: another one."""
    def key(model, devices=2, kind=("decode",)):
        split = tp.tensor_parallel(model, ["cpu"] * devices)
        return capture_store.key([kind, split.devices], split.module_shards)

    model = tiny_model("llama")
    same = key(copy.deepcopy(model))
    assert same is not None and key(copy.deepcopy(model)) == same
    assert key(copy.deepcopy(model), devices=3) != same
    assert key(copy.deepcopy(model), kind=("decode", 7)) != same
    config = tiny_config("llama")
    config.rms_norm_eps = 1e-3  # (a module attribute: the same weights' shapes)
    assert key(tiny_model("llama", config)) != same
    changed = copy.deepcopy(model)
    changed.model.layers[0].self_attn.scaling = 0.5
    assert key(changed) != same
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")  # (a private setting of the config: another attention function runs)
    assert key(eager) != same


def test_nothing_is_kept_with_the_store_switched_off(store, monkeypatch):
    monkeypatch.setenv("TENSORSHARD_CAPTURE_CACHE", "0")
    model = tiny_model("llama")
    out, _, traced, _ = _fast(tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"]))
    assert torch.equal(out, _greedy(model)) and traced == 2 and not store.exists()
