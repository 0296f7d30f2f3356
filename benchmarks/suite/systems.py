"""The systems compared, as they run in the main environment (torch 2.13, transformers 5.x):

| name             | what                                                                | processes      |
|------------------|---------------------------------------------------------------------|----------------|
| plain            | the unsplit model                                                   | 1              |
| ours-inprocess   | `tp.tensor_parallel(model, devices)` (defaults; llama: our preset); plain AdamW | 1, N threads |
| ours-torchrun    | `tp.parallelize(model, mesh)` (llama: our preset)                   | N (torchrun)   |
| dtensor          | `parallelize_module` with the Lightning guide's hand-written plan    | N (torchrun)   |
| hf-tp-plan       | transformers' own `DistributedConfig(tp_size=N)` (`base_model_tp_plan`) | N (torchrun) |

The tensor_parallel package runs in its own environment (peer_job.py). Each builder returns a `Built`:
the model to call, and per device of this process the named parameters it holds and the module whose
forward runs that device's share (where activation hooks go).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from suite.config import FeedForward, Sizes

DISTRIBUTED = {"ours-torchrun", "dtensor", "hf-tp-plan"}
ALL = ("plain", "ours-inprocess", "ours-torchrun", "dtensor", "hf-tp-plan")


@dataclass
class Built:
    model: nn.Module
    slots: list[list[tuple[str, torch.Tensor]]]  # per device of this process: (name, parameter)
    slot_modules: list[nn.Module] | None  # per device: the module run in that device's thread (in-process)
    note: str = ""


def devices_for(device: str, world: int) -> list[str]:
    return ["cpu"] * world if device == "cpu" else [f"cuda:{i}" for i in range(world)]


def local_device(device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


# --- models ---------------------------------------------------------------------------------------------------


def llama_config(sizes: Sizes, layers: int | None = None):
    from transformers import LlamaConfig

    return LlamaConfig(**sizes.llama.config_kwargs(layers))


def build_llama(sizes: Sizes, checkpoint: str | None, *, layers: int | None = None, train: bool = True) -> nn.Module:
    """The Llama model on the CPU: the benchmark's weights from `checkpoint` (a save_pretrained folder) when
    given, else random (seed 0)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(sizes, layers))
    if checkpoint:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(os.path.join(checkpoint, "model.safetensors")), strict=True)
    return model.train(train)


def build_ff(sizes: Sizes, *, meta: bool = False) -> nn.Module:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return FeedForward(sizes.ff.dim, sizes.ff.hidden)


def save_checkpoint(sizes: Sizes, folder: str, layers: int | None = None) -> None:
    """Write the benchmark's Llama (random weights, seed 0) once, for every system to load."""
    model = build_llama(sizes, None, layers=layers)
    model.save_pretrained(folder)


# --- plans -----------------------------------------------------------------------------------------------------


def ours_plan(model_name: str):
    import tensorshard as tp

    if model_name == "ff":
        return tp.Plan({"w[13]": tp.ColwiseParallel(), "w2": tp.RowwiseParallel()})
    return None  # llama: the preset (embedding split by vocabulary, lm_head column-parallel, gathered)


def guide_plan(model_name: str, layers: int) -> dict:
    """The Lightning guide's hand-written DTensor plan: w1, w3 column / w2 row; for Llama the same pairing
    on attention (q, k, v / o) and MLP (gate, up / down). Embedding and output head stay whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if model_name == "ff":
        return {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
    plan = {}
    for i in range(layers):
        block = f"model.layers.{i}"
        plan |= {
            f"{block}.self_attn.q_proj": ColwiseParallel(),
            f"{block}.self_attn.k_proj": ColwiseParallel(),
            f"{block}.self_attn.v_proj": ColwiseParallel(),
            f"{block}.self_attn.o_proj": RowwiseParallel(),
            f"{block}.mlp.gate_proj": ColwiseParallel(),
            f"{block}.mlp.up_proj": ColwiseParallel(),
            f"{block}.mlp.down_proj": RowwiseParallel(),
        }
    return plan


# --- optimizers ------------------------------------------------------------------------------------------------


def optimizer_for(system: str, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over the model's parameters, as users write it, for every system (the in-process engine steps each
    device's parameters in its shard's thread by itself: engines/inprocess/default_step.py)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


# --- builders --------------------------------------------------------------------------------------------------


def build(system: str, model_name: str, sizes: Sizes, *, world: int, device: str, checkpoint: str | None,
          layers: int | None = None, train: bool = True, check_inputs: int | None = None) -> Built:
    """`system`'s model over `world` devices (this process's part of it under torchrun)."""
    if model_name == "ff" and system == "hf-tp-plan":
        raise NotImplementedError("transformers' tp_plan applies to transformers models only (FeedForward is not one)")
    layers = layers or sizes.llama.num_hidden_layers
    if system == "plain":
        model = build_ff(sizes) if model_name == "ff" else build_llama(sizes, checkpoint, layers=layers, train=train)
        model = model.to(devices_for(device, 1)[0]).train(train)
        return Built(model, [list(model.named_parameters())], None)
    if system == "ours-inprocess":
        import tensorshard as tp

        model = build_ff(sizes) if model_name == "ff" else build_llama(sizes, checkpoint, layers=layers, train=train)
        model.train(train)
        wrapped = tp.tensor_parallel(model, devices_for(device, world), plan=ours_plan(model_name))
        shards = list(wrapped.module_shards)
        zero = train and world > 1 and model_name == "llama"
        return Built(wrapped, [list(s.named_parameters()) for s in shards], shards,
                     note="defaults: ZeRO-3 for the parameters the plan leaves whole (norms)" if zero else "")
    return _build_distributed(system, model_name, sizes, world=world, device=device, checkpoint=checkpoint,
                              layers=layers, train=train, check_inputs=check_inputs)


def _build_distributed(system, model_name, sizes, *, world, device, checkpoint, layers, train, check_inputs) -> Built:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    assert dist.is_initialized() and dist.get_world_size() == world, "run under torchrun with --nproc_per_node=world"
    dev = local_device(device)
    if system == "hf-tp-plan":
        from transformers import AutoModelForCausalLM

        from transformers.distributed import DistributedConfig

        kwargs: dict[str, Any] = {"dtype": torch.float32}
        if world > 1:
            kwargs["distributed_config"] = DistributedConfig(tp_size=world)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs).to(dev).train(train)
        return Built(model, [list(model.named_parameters())], None,
                     note="tp_size=1 is the plain transformers model" if world == 1 else "")

    mesh = init_device_mesh(dev.type, (world,))
    meta = model_name == "ff"  # each rank materialises only its shards (the guide's model is 0.75 GiB)
    model = build_ff(sizes, meta=meta) if model_name == "ff" else build_llama(sizes, checkpoint, layers=layers, train=train)
    model.train(train)
    if not meta:
        model.to(dev)
    if system == "ours-torchrun":
        import tensorshard as tp

        options = {} if check_inputs is None else {"check_inputs": check_inputs}
        model = tp.parallelize(model, mesh, plan=ours_plan(model_name), src_data_rank=None, **options)
    elif system == "dtensor":
        from torch.distributed.tensor.parallel import parallelize_module

        model = parallelize_module(model, mesh, guide_plan(model_name, layers), src_data_rank=None)
    else:
        raise ValueError(f"unknown system {system!r}; one of {ALL}")
    if meta:
        model.to_empty(device=dev)
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.normal_(0, sizes.ff.dim ** -0.5)
    return Built(model, [list(model.named_parameters())], None)
