"""What `mode="reduce-overhead"` becomes for the compiled decode step of an in-process split model
(engines/inprocess/cuda_graph_mode.py): CUDA graphs cut at the collectives where a GPU is among the devices,
inductor's default mode on CPU slots only, said so in the log. Pure decisions: no GPU is needed to check them
(tests/gpu/test_gpu_decoding.py runs the CUDA graphs)."""

from __future__ import annotations

import logging

import pytest

from support.helpers import log_messages
from tensorshard.engines.inprocess import cuda_graph_mode
from tensorshard.engines.inprocess.cuda_graph_mode import decode_options

LOGGER = "tensorshard.engines.inprocess.cuda_graph_mode"


@pytest.fixture
def logged():
    messages, stop = log_messages(LOGGER, logging.INFO)
    yield messages
    stop()


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:1"], ["cuda:0", "cpu"], ["cpu", "cuda:0", "cpu"]])
def test_with_a_gpu_the_mode_becomes_cuda_graphs_cut_at_the_collectives(devices, logged):
    asked = {"fullgraph": False, "dynamic": False, "mode": "reduce-overhead"}
    got = decode_options(asked, devices)
    # torch.compile takes `mode` or `options`, not both: the mode is given as inductor's options
    assert got == {"fullgraph": False, "dynamic": False, "options": {"triton.cudagraphs": True, "graph_partition": True}}
    assert asked["mode"] == "reduce-overhead"  # (the caller's dict is left alone)
    assert logged == []


def test_the_users_inductor_options_are_kept_on_top_of_the_mode():
    got = decode_options({"mode": "reduce-overhead", "options": {"epilogue_fusion": False}}, ["cuda:0", "cuda:1"])
    assert got["options"] == {"triton.cudagraphs": True, "epilogue_fusion": False, "graph_partition": True}


def test_on_cpu_slots_the_mode_is_replaced_and_the_log_says_why(logged):
    got = decode_options({"dynamic": False, "mode": "reduce-overhead"}, ["cpu", "cpu"], model_name="LlamaForCausalLM")
    assert got == {"dynamic": False}
    assert len(logged) == 1 and "LlamaForCausalLM" in logged[0] and "CPU slots do not have" in logged[0], logged


def test_another_backend_runs_without_the_mode_and_says_so(logged):
    assert decode_options({"backend": "eager", "mode": "reduce-overhead"}, ["cuda:0", "cuda:1"]) == {"backend": "eager"}
    assert len(logged) == 1 and "backend='eager'" in logged[0], logged


def test_without_graph_partitions_the_mode_is_refused_with_a_warning(monkeypatch):
    messages, stop = log_messages(LOGGER, logging.WARNING)
    monkeypatch.setattr(cuda_graph_mode, "partitions_supported", lambda: False)
    try:
        got = decode_options({"mode": "reduce-overhead"}, ["cuda:0", "cuda:1"])
    finally:
        stop()
    assert got == {} and len(messages) == 1 and "graph_partition" in messages[0] and "upgrade torch" in messages[0]


@pytest.mark.parametrize("mode", [None, "default", "max-autotune-no-cudagraphs"])
def test_other_modes_pass_through(mode, logged):
    asked = {"mode": mode} if mode is not None else {}
    assert decode_options(asked, ["cuda:0", "cpu"]) == asked and decode_options(asked, ["cpu", "cpu"]) == asked
    assert logged == []

