"""tensorshard's log lines come from global rank 0 only under torchrun (docs/torchrun.md), from every call in one
process, and every module of the library takes its logger from tensorshard.logs.get_logger, which makes it so."""

import ast
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tensorshard as tp
from support.harness import world_mesh

pytestmark = pytest.mark.timeout(120)

SRC = Path(__file__).resolve().parents[1] / "src" / "tensorshard"


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def _logged(run) -> list[str]:
    """The tensorshard records (DEBUG and up) emitted in this process while `run()` runs."""
    root, kept = logging.getLogger("tensorshard"), Kept()
    level = root.level
    root.addHandler(kept)
    root.setLevel(logging.DEBUG)
    try:
        run()
    finally:
        root.removeHandler(kept)
        root.setLevel(level)
    return kept.lines


def split_train_and_adapt():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=6, num_key_value_heads=3)
    model = tp.parallelize(LlamaForCausalLM(config), world_mesh())  # preset, split report, timeouts, shm setup
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()  # the vocabulary-parallel loss path
    late = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))  # PEFT after the split
    late(input_ids=ids, labels=ids).loss.backward()


def logged_by_each_rank_task() -> tuple[int, list[str]]:
    return dist.get_rank(), _logged(split_train_and_adapt)


def test_under_torchrun_only_global_rank_zero_logs(pool2):
    by_rank = dict(pool2.run(logged_by_each_rank_task))
    # rank 0 logs what every rank did once (the preset line was the one rank 1 repeated before the filter)
    assert any("preset plan for LlamaForCausalLM" in line for line in by_rank[0]), by_rank[0]
    assert any("parallelized LlamaForCausalLM over 2 rank(s)" in line for line in by_rank[0]), by_rank[0]
    assert by_rank[1] == []


def test_in_one_process_every_record_passes():
    from support.models import FeedForward
    from support.plans import FEED_FORWARD

    lines = _logged(lambda: tp.tensor_parallel(FeedForward(8, 16), ["cpu"] * 2, plan=FEED_FORWARD))
    assert any(line.startswith("tensorshard.engines.split_report: split FeedForward over 2 device(s)") for line in lines), lines


def test_every_module_takes_its_logger_from_get_logger():
    """A module that made its own `logging.getLogger(...)` would log on every rank again."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "logging"
                    and path.name != "logs.py"):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert offenders == [], f"use tensorshard.logs.get_logger(__name__) instead of logging.getLogger in {offenders}"
