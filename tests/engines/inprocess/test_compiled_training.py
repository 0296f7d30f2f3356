"""torch.compile of an in-process split model (engines/inprocess/compiled_shards.py): every shard compiled in its
own thread, the collectives inside its graphs with comm/functions.py's autograd. Compiled three ways, as users
do (`torch.compile(split)`, `split.compile()`, `block.compile()` on the split model's blocks, torchtitan's way),
a transformers Llama trains with the unsplit model's losses, dynamo reports no more graph breaks than for the
unsplit model compiled the same way, and each step runs the eager path's collectives (tp.count_collectives()).

aot_eager is the backend: it traces forward and backward graphs as inductor does (aot_autograd, the collectives as
operators in both) without generating code; the no-gradient forward also runs under inductor. Each compile costs
seconds: the unsplit reference is compiled once per module."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import tensorshard as tp
from support import tiny_llama
from support.helpers import rel_err

pytestmark = pytest.mark.timeout(300)

STEPS = 3
BACKEND = "aot_eager"


def _batch() -> torch.Tensor:
    return torch.randint(0, tiny_llama.VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def _compile(model, how: str):
    """`model` compiled the way `how` names; the callable to train."""
    if how == "torch.compile":
        return torch.compile(model, backend=BACKEND)
    if how == "split.compile":
        model.compile(backend=BACKEND)
        return model
    for block in model.model.layers:  # blocks (of the split model: a view of every shard's block)
        block.compile(backend=BACKEND)
    return model


def _train(model, how: str) -> tuple[list[float], int, list[tuple[dict, dict]]]:
    """Losses of STEPS AdamW steps compiled `how`, dynamo's graph breaks, each step's collectives."""
    torch._dynamo.reset()
    counters.clear()
    call = _compile(model, how)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _batch()
    losses, collectives = [], []
    for _ in range(STEPS):
        with tp.count_collectives() as c:
            loss = call(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        collectives.append((dict(c.forward), dict(c.backward)))
    return losses, sum(counters["graph_break"].values()), collectives


@pytest.fixture(scope="module")
def llama():
    return tiny_llama.build().train()


@pytest.fixture(scope="module")
def unsplit(llama):
    """The unsplit model's run, compiled whole and per block: {how: (losses, graph breaks)}."""
    runs = {}
    for how in ("torch.compile", "blocks"):
        losses, breaks, _ = _train(copy.deepcopy(llama), how if how == "blocks" else "torch.compile")
        runs[how] = (losses, breaks)
    return runs


@pytest.mark.parametrize(
    "how, devices", [("torch.compile", 2), pytest.param("split.compile", 3, marks=pytest.mark.slow), ("blocks", 2)]
)
def test_compiled_training_matches_the_unsplit_model(llama, unsplit, how, devices):
    split = tp.tensor_parallel(copy.deepcopy(llama), ["cpu"] * devices)  # training: ZeRO-3 on, as by default
    ids = _batch()
    with tp.count_collectives() as eager:  # the eager path's collectives, a step of the same kind
        split(input_ids=ids, labels=ids).loss.backward()
    split.zero_grad()
    losses, breaks, collectives = _train(split, how)
    ref_losses, ref_breaks = unsplit["blocks" if how == "blocks" else "torch.compile"]
    assert losses == pytest.approx(ref_losses, rel=1e-5)  # fp32, sums in another order
    assert breaks <= ref_breaks  # 0 for this Llama: one graph per shard (per block and shard)
    for step in collectives:  # 2 + 2 all-reduces per block, the embedding's, the loss's; ZeRO-3's gather
        assert step == (dict(eager.forward), dict(eager.backward))
    if devices == 2:  # 2 per block (q, k and v read one tensor: one all-reduce), the loss's; none for the embedding
        assert eager.backward == {"all_reduce": 2 * 2 + 1}


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_no_grad_forward_of_a_causal_lm_equals_the_unsplit_model(llama, backend):
    """The regression of issue 40: the first shard traced, the others eager, took different paths at the
    vocabulary-parallel head (`collective #6 of this call differs between shards`)."""
    ref = copy.deepcopy(llama).eval()
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"])
    torch._dynamo.reset()
    compiled = torch.compile(split, backend=backend)
    ids = _batch()
    with torch.no_grad():
        for _ in range(2):  # the compiling call, then the compiled one
            out = compiled(input_ids=ids).logits
        expected = ref(input_ids=ids).logits
    assert rel_err(out, expected) < 1e-5


DEEP = 10  # blocks: past dynamo's recompile limit (8), had each block of each shard needed a graph of its own


def _graphs_and_fallbacks() -> tuple[int, int]:
    """Graphs dynamo made since the last reset, and frames it ran eagerly for having hit its recompile limit."""
    limit_hits = sum(n for reason, n in counters["unimplemented"].items() if "recompile limit" in reason.lower())
    return counters["stats"]["unique_graphs"], limit_hits


def _deep_llama():
    torch.manual_seed(0)
    deep = tiny_llama.build()
    return type(deep)(type(deep.config)(**{**deep.config.to_dict(), "num_hidden_layers": DEEP, "use_cache": False}))


def test_per_block_compile_of_a_deep_split_model_needs_the_unsplit_models_graphs():
    """Compiled per block, every block of every shard shares one graph as the unsplit model's blocks do: the
    collectives name their shard and call site by a tensor the graph takes as an input (comm/thread_ops.py), and
    ZeRO-3's hooks read nothing that differs per block or shard; so nothing falls back to eager past the limit."""
    deep = _deep_llama().train()
    with torch._dynamo.config.patch(recompile_limit=8):
        ref_losses, _, _ = _train(copy.deepcopy(deep), "blocks")
        ref_graphs, ref_fallbacks = _graphs_and_fallbacks()
        split = tp.tensor_parallel(copy.deepcopy(deep), ["cpu", "cpu"])
        ids = _batch()
        with tp.count_collectives() as eager:
            split(input_ids=ids, labels=ids).loss.backward()
        split.zero_grad()
        losses, breaks, collectives = _train(split, "blocks")
        graphs, fallbacks = _graphs_and_fallbacks()
    assert (ref_graphs, ref_fallbacks) == (1, 0)  # one graph for the 10 blocks of the unsplit model
    assert (graphs, fallbacks, breaks) == (ref_graphs, 0, 0)  # and for the 2 x 10 of the split one
    assert losses == pytest.approx(ref_losses, rel=1e-5)  # fp32, sums in another order
    for step in collectives:
        assert step == (dict(eager.forward), dict(eager.backward))
    assert eager.backward == {"all_reduce": 2 * DEEP + 1}  # 2 per block, the loss's


class _BreakingNorm(torch.nn.Module):
    """A module of the user's with a graph break: dynamo compiles the frames around it, shared by every shard."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.norm(x)


@pytest.mark.parametrize("grad", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["no_grad", "training"])
def test_shards_past_the_recompile_limit_run_eagerly_beside_compiled_ones(llama, grad):
    """A frame many shards share (a transformers forward resumed after a graph break) past dynamo's recompile limit
    runs eagerly on the shards that reach it last and compiled on the others (a long-lived process that compiled
    ~25 split models hit it at 8); their collectives still meet: the same result as the unsplit model. (Before:
    `collective #6 of this call differs between shards`, an all-gather compiled against an assemble eager.)"""
    ref = copy.deepcopy(llama).train(grad)
    ref.model.norm = _BreakingNorm(ref.model.norm)
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"])
    ids = _batch()
    torch._dynamo.reset()
    counters.clear()
    labels = {"labels": ids} if grad else {}  # without: the logits assembled from the shards' slices
    with torch._dynamo.config.patch(recompile_limit=1), torch.set_grad_enabled(grad):
        compiled = torch.compile(split, backend="eager")
        for _ in range(2):
            out = compiled(input_ids=ids, **labels)
        expected = ref(input_ids=ids, **labels)
    assert _graphs_and_fallbacks()[1] > 0  # the limit was hit: some shard ran a frame eagerly
    assert rel_err(out.logits, expected.logits) < 1e-5
    if grad:
        out.loss.backward()
        expected.loss.backward()
        assert out.loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)


def test_per_block_compile_of_a_deep_split_model_without_gradients_needs_one_graph():
    """The same for a call without gradients (evaluation): the no-gradient collectives are named by the site tensor
    too (the decode steps' keep their constant names, which the stitched step rewrites)."""
    ref = _deep_llama().eval()
    ids = _batch()
    runs = []
    with torch._dynamo.config.patch(recompile_limit=8), torch.no_grad():
        for model in (copy.deepcopy(ref), tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"])):
            torch._dynamo.reset()
            counters.clear()
            for block in model.model.layers:
                block.compile(backend="eager")
            for _ in range(2):
                logits = model(input_ids=ids).logits
            runs.append((logits, _graphs_and_fallbacks()))
    (expected, ref_graphs), (logits, graphs) = runs
    assert ref_graphs == graphs == (1, 0)
    assert rel_err(logits, expected) < 1e-5
