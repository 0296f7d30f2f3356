"""The fast decoding path for every family the default path decodes (tests/support/hf_configs.py, the families
test_hf_presets.py checks generate on), at 2 and 3 devices: `generate(..., cache_implementation="static")` gives the
unsplit model's greedy tokens.

What can break per family is each shard's graph as torch.compile captures it with the collectives inside (the
model's own Python read at trace time: a head count from a config, a fused q|k|v slice, a sliding window), so the
shards compile with dynamo's graph as it is (`CompileConfig(backend="eager")`): the same capture, without inductor's
minutes per family on 2 cores. Inductor and the stitched graph are tested on a few families in test_static_cache.py.

Capturing costs ~2 s of CPU per shard on 2 cores (~4-7 s per case, 40 cases): the suite runs the families whose
capture broke before (Phi-3's head count read from its config, BLOOM's per-head ALiBi input) and marks the others
slow (`pytest -m slow tests/integrations/transformers/test_fast_path_families.py` runs them).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CompileConfig

import tensorshard as tp
from support.hf_configs import FAMILIES, tiny_model

pytestmark = pytest.mark.timeout(300)

# Families whose unsplit model cannot decode with a static cache at all (transformers 5.23-5.24): nothing to match.
UNSPLIT_CANNOT = {
    "falcon_alibi": "Falcon with ALiBi adds a bias of the prompt's length to a mask of the static cache's length",
}

# Families whose shard step torch.compile captures with a graph break: decoded right (the rest of the step runs
# eagerly), but as more than one graph per shard, so never stitched. Each with the reason.
GRAPH_BREAKS = {
    "phi3": "the attention reads config._attn_implementation, a property, through the view of the config holding its "
            "device's head count (styles/local_values.py); dynamo finds the property on the config's class (the "
            "view's __class__) but then looks for it along the view's own type, and breaks the graph (torch 2.13)",
}


def _ids() -> torch.Tensor:
    return torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(0))


def _greedy(model, **kwargs) -> torch.Tensor:
    ids = _ids()
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                              do_sample=False, pad_token_id=0, **kwargs)


IN_THE_SUITE = {("phi3", 3), ("bloom", 2)}
CASES = [
    pytest.param(family, devices, marks=() if (family, devices) in IN_THE_SUITE else pytest.mark.slow)
    for family in FAMILIES if family not in UNSPLIT_CANNOT for devices in (2, 3)
]


@pytest.mark.parametrize("family, devices", CASES)
def test_fast_path_gives_the_unsplit_tokens(family, devices):
    model = tiny_model(family)
    expected = _greedy(model)  # the default path (dynamic cache), unsplit
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * devices)
    # fullgraph: one graph per shard (a graph break would run part of a shard's step eagerly, unseen)
    config = CompileConfig(backend="eager", fullgraph=family not in GRAPH_BREAKS)
    out = _greedy(split, cache_implementation="static", compile_config=config)
    assert torch.equal(out, expected)
    assert split.__dict__.get("_tensorshard_compiled_steps"), "the fast path did not compile the decode step"


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.xfail(reason=why, strict=True))
                                    for f, why in GRAPH_BREAKS.items()])
def test_fast_path_captures_one_graph_per_shard(family):
    model = tiny_model(family)
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 2)
    out = _greedy(split, cache_implementation="static", compile_config=CompileConfig(backend="eager", fullgraph=True))
    assert torch.equal(out, _greedy(model))


@pytest.mark.parametrize("family", sorted(UNSPLIT_CANNOT))
def test_families_left_out_cannot_decode_with_a_static_cache_unsplit(family):
    """The families left out above, for the reason given: when transformers fixes one, this fails, and it joins."""
    with pytest.raises(RuntimeError):
        _greedy(tiny_model(family), cache_implementation="static", disable_compile=True)
