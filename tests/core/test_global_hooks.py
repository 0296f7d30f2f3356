"""Importing tensorshard changes nothing in the process; a split model's process-wide hooks go away with it
(src/tensorshard/global_hooks.py).

Each check runs in a fresh interpreter (a subprocess): the test process has imported tensorshard and split
models long before.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest

# torch's global hook dicts and PEFT's function, as a JSON-able snapshot.
SNAPSHOT = """
import gc
import json
from torch.nn.modules import module as _m
from torch.optim import optimizer as _o
def snapshot():
    import sys
    loading = sys.modules.get("peft.utils.save_and_load")
    reshard = getattr(loading, "_reshard_dtensor_values_for_load", None)
    return {
        "module": len(_m._global_module_registration_hooks),
        "parameter": len(_m._global_parameter_registration_hooks),
        "buffer": len(_m._global_buffer_registration_hooks),
        "step_pre": len(_o._global_optimizer_pre_hooks),
        "step_post": len(_o._global_optimizer_post_hooks),
        # tensorshard's wrapper copies the name of PEFT's function (functools.wraps) and marks itself
        "peft_reshard": (None if reshard is None
                         else "wrapped" if hasattr(reshard, "tensorshard_slices_first") else "peft's"),
    }
"""


def _run(body: str) -> list[dict]:
    """Run `body` in a fresh interpreter; each `print(json.dumps(snapshot()))` line comes back as a dict."""
    code = SNAPSHOT + textwrap.dedent(body)
    env = dict(os.environ)
    # a fresh interpreter imports torch and peft: a minute on a loaded machine
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


NOTHING = {"module": 0, "parameter": 0, "buffer": 0, "step_pre": 0, "step_post": 0,
           "peft_reshard": "peft's"}


@pytest.mark.timeout(450)
def test_import_changes_nothing_and_an_in_process_split_model_takes_its_hooks_with_it():
    before, imported, split, gone = _run("""
        import gc
        import peft, torch
        print(json.dumps(snapshot()))
        import tensorshard as tp
        from tensorshard import global_hooks
        print(json.dumps(snapshot()))
        assert global_hooks.installed() == []
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        split = tp.tensor_parallel(model, ["cpu", "cpu"])
        print(json.dumps(snapshot()))
        del split, model
        gc.collect()
        print(json.dumps(snapshot()))
        assert global_hooks.installed() == []
    """)
    assert before == NOTHING and imported == NOTHING and gone == NOTHING
    # registration counting (3; module: also PEFT's), the default optimizer step (2); PEFT's function stays
    assert split == {**NOTHING, "module": 2, "parameter": 1, "buffer": 1, "step_pre": 1, "step_post": 1}


@pytest.mark.timeout(450)
def test_two_split_models_hold_the_hooks_until_the_last_is_gone():
    one, other, none = _run("""
        import gc
        import torch
        import tensorshard as tp
        a = tp.tensor_parallel(torch.nn.Sequential(torch.nn.Linear(8, 8)), ["cpu", "cpu"])
        b = tp.tensor_parallel(torch.nn.Sequential(torch.nn.Linear(8, 8)), ["cpu", "cpu"])
        del a; gc.collect()
        print(json.dumps(snapshot()))
        b(torch.randn(2, 8)).sum().backward()
        torch.optim.SGD(b.parameters(), lr=0.1).step()   # the default step's hooks still serve b
        print(json.dumps(snapshot()))
        del b; gc.collect()
        print(json.dumps(snapshot()))
    """)
    held = {"module": 2, "parameter": 1, "buffer": 1, "step_pre": 1, "step_post": 1, "peft_reshard": None}
    assert one == held and other == held
    assert none == {**held, "module": 0, "parameter": 0, "buffer": 0, "step_pre": 0, "step_post": 0}


@pytest.mark.timeout(450)
def test_a_torchrun_split_model_under_peft_holds_the_peft_patch_until_it_is_gone(tmp_path):
    """One rank: parallelize, then PEFT's own API; PEFT's resharding function is wrapped only while that lives."""
    split, adapted, gone = _run(f"""
        import gc
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        import peft
        import tensorshard as tp
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rendezvous", rank=0, world_size=1)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        model = tp.parallelize(model, init_device_mesh("cpu", (1,)),
                               plan={{"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()}})
        print(json.dumps(snapshot()))
        adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["0", "2"]))
        print(json.dumps(snapshot()))
        del adapted, model
        gc.collect()
        print(json.dumps(snapshot()))
        dist.destroy_process_group()
    """)
    # the optimizer step hooks too: an optimizer that reads a whole weight (Muon) sees split weights whole there
    assert split == {**NOTHING, "module": 2, "parameter": 1, "buffer": 1, "step_pre": 1, "step_post": 1}
    assert adapted == {**split, "peft_reshard": "wrapped"}
    assert gone == NOTHING


# Two ways a future PEFT may change its resharding function, each with what the refusal says.
CHANGES = {
    "another signature": ("loading._reshard_dtensor_values_for_load = lambda model, state_dict, mesh: state_dict",
                          "takes ('model', 'state_dict', 'mesh')"),
    "gone": ("del loading._reshard_dtensor_values_for_load", "has no such function"),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """Each change of CHANGES in turn in one fresh interpreter (one import of torch and PEFT for both): a model
    parallelized after the change, then PEFT's own call on it, refused before PEFT wraps anything. The first
    change leaves nothing installed (a refused hook stays uninstalled), so the second meets PEFT as it left it."""
    rendezvous = tmp_path_factory.mktemp("refusals") / "rendezvous"
    cases = "".join(f"""
        {change}  # a future peft
        refused({name!r}, {said!r})""" for name, (change, said) in CHANGES.items())
    outcomes = _run(f"""
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        import peft
        import peft.utils.save_and_load as loading
        import tensorshard as tp
        dist.init_process_group("gloo", init_method="file://{rendezvous}", rank=0, world_size=1)

        def refused(name, said):
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
            model = tp.parallelize(model, init_device_mesh("cpu", (1,)),
                                   plan={{"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()}})
            try:
                peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["0", "2"]))
            except NotImplementedError as e:
                assert said in str(e) and "before tp.parallelize" in str(e), e
            else:
                raise AssertionError(f"{{name}}: not refused")
            assert not any("lora" in n for n, _ in model.named_modules()), f"{{name}}: PEFT wrapped layers first"
            print(json.dumps({{"refused": name}}))
        {cases}
        dist.destroy_process_group()
    """)
    return {outcome["refused"]: outcome for outcome in outcomes}


@pytest.mark.timeout(450)
@pytest.mark.parametrize("change", CHANGES)
def test_a_peft_whose_resharding_function_changed_is_refused_before_peft_wraps_anything(refusals, change):
    assert refusals.get(change) == {"refused": change}


class _Owner:  # anything weak-referenceable holds a hook
    pass


def test_a_hook_is_installed_once_for_its_first_holder_and_removed_after_its_last():
    from tensorshard.global_hooks import GlobalHook

    log = []

    class Handle:
        def remove(self):
            log.append("removed")

    def install():
        log.append("installed")
        return [Handle()]

    hook = GlobalHook("a test hook", install)
    a, b = _Owner(), _Owner()
    hook.hold(a)
    hook.hold(a)  # the same holder twice: one hold
    hook.hold(b)
    assert log == ["installed"] and hook.installed and len(hook.holders()) == 2
    del a
    gc.collect()
    assert log == ["installed"] and hook.installed  # b still holds it
    del b
    gc.collect()
    assert log == ["installed", "removed"] and not hook.installed and hook.handles() is None
    c = _Owner()
    hook.hold(c)  # installed again for a new holder
    assert log == ["installed", "removed", "installed"]


def test_a_hook_whose_install_refuses_is_left_uninstalled():
    from tensorshard.global_hooks import GlobalHook

    def install():
        raise NotImplementedError("refused")

    hook = GlobalHook("a refusing hook", install)
    owner = _Owner()
    with pytest.raises(NotImplementedError, match="refused"):
        hook.hold(owner)
    assert not hook.installed and hook.holders() == []


def test_a_patch_puts_the_original_back_unless_someone_replaced_it_since():
    from types import SimpleNamespace

    from tensorshard.global_hooks import Patch

    def original():
        return "original"

    def ours():
        return "ours"

    def theirs():
        return "theirs"

    lib = SimpleNamespace(f=original)
    patch = Patch(lib, "f", ours)
    assert lib.f() == "ours" and patch.original is original
    patch.remove()
    assert lib.f is original
    patch = Patch(lib, "f", ours)
    lib.f = theirs  # another library wrapped it after us: removing ours must not undo theirs
    patch.remove()
    assert lib.f is theirs


def test_a_hook_whose_last_holder_goes_while_torch_loops_over_its_dict_is_removed_after_the_loop():
    """A finalizer runs wherever the object dies, also inside torch's loop over the very hook dict that holds the
    hook (here a later hook of that loop drops the last holder); removing the hook there broke the loop
    ("OrderedDict mutated during iteration" before the next hook). Its removal waits for a safe point."""
    import torch
    from torch.nn.modules import module as torch_module

    from tensorshard.global_hooks import GlobalHook

    seen = []
    hook = GlobalHook("a test module registration hook", lambda: [
        torch_module.register_module_module_registration_hook(lambda module, name, sub: seen.append(name))])
    holders = [_Owner()]
    hook.hold(holders[0])
    (ours,) = hook.handles()

    def drop_the_last_holder(module, name, sub):
        holders.clear()  # its finalizer runs here, inside torch's loop over the registration hooks

    theirs = [torch_module.register_module_module_registration_hook(drop_the_last_holder),
              torch_module.register_module_module_registration_hook(lambda module, name, sub: seen.append("after"))]
    try:
        torch.nn.Module().add_module("first", torch.nn.Identity())  # the loop goes on to the hook after theirs
        assert seen == ["first", "after"] and holders == []
        assert hook.installed and ours.id in torch_module._global_module_registration_hooks  # not inside the loop
        gc.collect()  # a safe point: outside torch
        assert not hook.installed and ours.id not in torch_module._global_module_registration_hooks
        torch.nn.Module().add_module("second", torch.nn.Identity())
        assert seen == ["first", "after", "after"]
    finally:
        for handle in theirs:
            handle.remove()
        gc.collect()
    assert not hook.installed
