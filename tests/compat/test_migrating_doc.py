"""docs/migrating.md: its examples run as written (checked on the run of tests/test_docs_snippets.py), and its table of the
tensor_parallel package's names covers every public name of the original 2.0, each marked works / differs /
refused, and what it marks as working (or working differently) exists in tensorshard.compat."""

import re
from pathlib import Path

import pytest

import tensorshard.compat as tp
from support.docs import docs_runs, python_blocks
from support.hf_configs import tiny_model

pytestmark = pytest.mark.timeout(450)  # the first test to ask runs every doc once (support.docs.docs_runs)

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"

# Every public name of tensor_parallel 2.0 (its package, the attributes of its two model classes, and each of its
# modules' top-level names; loggers left out), spelled as the table spells them.
ORIGINAL = [
    # the package
    "tensor_parallel.tensor_parallel", "TensorParallel", "TensorParallelPreTrainedModel", "Config", "Sharded",
    "save_tensor_parallel", "convert_state_dict", "infer_sharded_device_map", "make_distributed_shard", "StateAction",
    # TensorParallel and TensorParallelPreTrainedModel: attributes and methods
    "module_shards", "devices", "device_ids", "output_device_index", "all_cuda", "need_delayed_init",
    "sharding_manager", "tensor_parallel_config", "modified_parameters_names", "param_fractions",
    "preserve_shards_when_saving", "set_preserve_shards_when_saving", "apply_sharding", "forward", "state_dict",
    "prepare_args_kwargs_for_forward", "process_sharded_state_dict", "wrapped_model", "prepare_inputs_for_generation",
    "get_encoder",
    # the modules
    *(f"state_actions.{n}" for n in ("StateAction", "LegacyStateAction", "Split", "Scale", "SplitInChunks",
                                     "SplitInGroupedChunks")),
    "undo",
    "pretrained_model.find_predefined_tensor_parallel_config",
    *(f"config.{n}" for n in ("TENSOR_PARALLEL_USE_NATIVE", "add_lora_rules", "create_collective_ops",
                              "convert_legacy_state_action", "get_parameter_name_mapping", "Arg", "Action",
                              "MappedActions", "StateRules", "ModuleRules")),
    "Config.create_collective_ops",
    *(f"dispatch.{n}" for n in ("infer_sharded_data_device_id", "convert_data", "convert_names",
                                "prefix_names_with_shard_id", "convert_state_dict_single_shard")),
    *(f"tensor_parallel.{n}" for n in ("parallel_apply_simple", "get_a_var", "canonicalize_device", "check_device_ids")),
    *(f"slicing_configs.{n}" for n in ("PREDEFINED_CONFIGS", "ConfigGetter", "get_bloom_config", "get_t5_config",
                                       "get_bert_config", "get_gpt2_config", "get_gpt_neox_config", "get_codegen_config",
                                       "get_llama_config", "get_refined_web_config")),
    "autoconfig.get_default_config",
    *(f"aux_actions.{n}" for n in ("gather_kv", "select_kv_for_rank", "split_heads", "split_num_heads",
                                   "split_inner_dim", "split_alibi")),
    *(f"communications.{n}" for n in ("CollectiveOpetationBase", "CollectiveOperation", "NCCLAllReduce",
                                      "NCCLAllGather", "AllReduce", "ScatterReduce", "AllGather",
                                      "DistributedAllReduce", "DistributedAllGather")),
    *(f"cross_device_ops.{n}" for n in ("broadcast_coalesced", "gather", "reduce_add", "all_gather",
                                        "NCCLAllReduceFunction", "NCCLAllGatherFunction")),
    "per_device_tensors.PerDeviceTensors",
    *(f"shard.{n}" for n in ("make_shard", "make_distributed_shard", "find_matching_actions", "process_state_",
                             "process_attrs_", "fix_general_attributes")),
    "sharding.Sharded", "sharding.maybe_script",
    *(f"utils.{n}" for n in ("nested_compare", "nested_flatten", "nested_pack", "is_namedtuple", "nested_map",
                             "find_tied_weight_aliases", "check_lora")),
    *(f"wrapper.{n}" for n in ("apply_action", "process_input", "process_output", "TensorParallelWrapper")),
    "imports.verify_peft_version",
]


def test_migrating_doc_examples_run():
    assert len(python_blocks(DOC)) >= 5
    run = docs_runs()["docs/migrating.md"]  # in a process of its own: the doc's tensor_parallel aliases stay there
    assert not run.errors, run.errors[0]
    printed = run.printed
    assert "TensorParallelOPTForCausalLM True" in printed
    assert re.search(r"fc1\s+ColwiseParallel\(\)\nfc2\s+RowwiseParallel\(\)", printed)
    assert "no output rule 'sum' covers it" in printed
    assert "{'num_key_value_groups': PerDevice((3, 3))}" in printed


def _table() -> dict[str, str]:
    """name -> status, from the rows of the section 'Every name of tensor_parallel 2.0'."""
    section = DOC.read_text().split("## Every name of tensor_parallel 2.0", 1)[1]
    status = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in ("works", "differs", "refused"):
            for name in re.findall(r"`([^`]+)`", cells[0]):
                assert name not in status, f"{name} is in two rows"
                status[name] = cells[1]
    return status


def test_the_table_covers_every_public_name_of_the_original():
    status = _table()
    assert sorted(set(ORIGINAL) - set(status)) == []
    assert sorted(set(status) - set(ORIGINAL)) == []


def test_what_the_table_marks_as_working_exists():
    model = tp.TensorParallelPreTrainedModel(tiny_model("t5"), ["cpu", "cpu"])  # an encoder-decoder: get_encoder too
    missing = []
    for name, status in _table().items():
        if status == "refused":
            continue
        module, _, attr = name.rpartition(".")
        if name == "undo":
            owner = tp.Split
        elif module in ("", "tensor_parallel"):
            owner = tp if hasattr(tp, attr) else model
        else:
            owner = tp.ALIASES[f"tensor_parallel.{module}"]
        if not hasattr(owner, attr):
            missing.append(name)
    assert missing == []
