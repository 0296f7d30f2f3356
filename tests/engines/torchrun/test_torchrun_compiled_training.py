"""Compiled training under torchrun: `torch.compile(model)` of a parallelized transformers Llama trains with the
unsplit model's losses, no more graph breaks than the unsplit model compiled the same way, and the eager step's
collectives (comm/dist_ops.py): the default plan, a sequence-parallel one (norm gradients in the bucket), 3 ranks
(KV heads replicated, their gradients tied), and dropout (the eager step's masks).

aot_eager traces what inductor would compile (the graphs with their autograd) without generating code, which
costs minutes per graph on these loaded cores.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import tensorshard as tp
from support import tiny_llama
from support.harness import world_mesh

pytestmark = pytest.mark.timeout(600)
TASK = 540  # seconds a task may take: it compiles the unsplit and the split model
STEPS, BATCH, SEQ = 3, 2, 12  # 12 tokens: sequence shards even over 2 and 3 ranks


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _train(model, batches, *, compiled: bool, labels: bool, seed: int = 0) -> dict:
    """STEPS AdamW steps on `batches`: the losses, the graph breaks, the graphs compiled and each step's counted
    collectives. With `labels`, the model computes its loss (under torchrun from vocabulary slices:
    integrations/causal_lm_loss.py), else the step does from the logits."""
    step = torch.compile(model, backend="aot_eager") if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(seed)  # the dropout masks' call seeds (comm/dropout.py)
    breaks, graphs, losses, counts = _graph_breaks(), _graphs(), [], []
    for ids in batches:
        with tp.count_collectives() as forward:
            if labels:
                loss = step(ids, labels=ids).loss
            else:
                logits = step(ids).logits
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, tiny_llama.VOCAB), ids[:, 1:].reshape(-1))
        with tp.count_collectives() as backward:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        counts.append([forward.counts, backward.counts])
    return {"losses": losses, "graph_breaks": _graph_breaks() - breaks, "graphs": _graphs() - graphs, "counts": counts}


def _setup(dropout: float):
    torch._dynamo.reset()
    ref = tiny_llama.build().train()
    for module in ref.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = dropout  # on the heads: each rank draws its own mask (split activations)
    gen = torch.Generator().manual_seed(5)
    return ref, [torch.randint(0, tiny_llama.VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _compiled_and_eager(ref, batches, plan, labels: bool) -> dict:
    def split():
        return tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=plan, check_inputs=0)

    return {"compiled": _train(split(), batches, compiled=True, labels=labels),
            "eager": _train(split(), batches, compiled=False, labels=labels)}


def compiled_training_task() -> dict:
    """The unsplit model compiled, and the split one compiled and eager with each plan (one task: one unsplit
    compile)."""
    ref, batches = _setup(0.0)
    out = {name: _compiled_and_eager(ref, batches, plan, labels=True)
           for name, plan in (("default", tiny_llama.plan()), ("sequence", tiny_llama.sequence_parallel_plan(head=None)))}
    out["unsplit"] = _train(copy.deepcopy(ref), batches, compiled=True, labels=True)
    return out


@pytest.mark.parametrize("world", [2, 3])  # 3 ranks: 4 query heads as 2/1/1, the 2 KV heads replicated (tied)
def test_compiled_training_gives_the_unsplit_losses_with_the_eager_collectives(pool2, pool3, world):
    for out in (pool2 if world == 2 else pool3).run(compiled_training_task, timeout=TASK):
        unsplit = out["unsplit"]
        for plan_name in ("default", "sequence"):
            compiled, eager = out[plan_name]["compiled"], out[plan_name]["eager"]
            for split, single in zip(compiled["losses"], unsplit["losses"]):
                assert abs(split - single) <= 1e-5 * abs(single), plan_name  # fp32, 3 AdamW steps
            assert compiled["graph_breaks"] <= unsplit["graph_breaks"], plan_name
            # one graph, as unsplit (its backward compiled with it): the engine's host-side wrapper around the
            # model's forward (the lazily gathered logits of integrations/lazy_logits.py) runs eagerly around it
            assert compiled["graphs"] == unsplit["graphs"] == 1, plan_name
            # every step, compiled or not, runs the same collectives (the first compiles, the later replay)
            assert compiled["counts"] == eager["counts"], plan_name
            backward = eager["counts"][0][1]
            tie = 2 * 2 if world == 3 else 0  # k and v weight gradients summed over their holders
            if plan_name == "default":
                # q, k and v (gate and up) share one input-gradient all-reduce: 2 per layer, and lm_head
                assert backward == {"all_reduce": 2 * 2 + 1 + tie}
            else:
                # each norm's gathered output claimed by column layers: its gradient reduce-scattered; o_proj and
                # down_proj's reduce-scatters gathered back, and the split of layer 0's input; the norm weights'
                # partial gradients in one bucket
                assert backward == {"reduce_scatter": 2 * 2 + 1, "all_gather": 2 * 2 + 1, "all_reduce": 1 + tie}


def compiled_dropout_task() -> dict:
    """With and without labels: the model's forward traced inside the engine's eager wrapper, or the whole call."""
    ref, batches = _setup(0.2)
    return {labels: _compiled_and_eager(ref, batches, tiny_llama.plan(), labels) for labels in (False, True)}


def test_compiled_dropout_draws_the_eager_masks(pool2):
    for out in pool2.run(compiled_dropout_task, timeout=TASK):
        for labels, run in out.items():
            compiled, eager = run["compiled"], run["eager"]
            for traced, ran in zip(compiled["losses"], eager["losses"]):
                # the same masks (with dropout off the losses differ by 1e-3 to 1e-2)
                assert abs(traced - ran) <= 1e-5 * abs(ran), labels
            assert compiled["graph_breaks"] == 0 and compiled["graphs"] == 1, labels
            assert compiled["counts"] == eager["counts"], labels  # each dropout's small all-gather (its key) too
