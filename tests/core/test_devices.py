import pytest
import torch

from tensorshard.devices import device_labels, resolve_devices


def test_cpu_slots_may_repeat_and_get_unique_labels():
    devices = resolve_devices(["cpu", "cpu", torch.device("cpu")])
    assert device_labels(devices) == ["cpu[0]", "cpu[1]", "cpu[2]"]


@pytest.mark.parametrize(
    "bad, error, text",
    [
        ([], ValueError, "empty"),
        ("cpu", TypeError, "list of devices"),
        (["tpu:0"], ValueError, "not a device name"),
        ([1.5], TypeError, "has type float"),
        (["cuda:0"], ValueError, "CUDA is not available"),
        ([-1], ValueError, "negative"),
        ({"cpu": 2}, TypeError, r"got a dict \(\{'cpu': 2\}\), whose keys would be taken as the devices"),
        ({"cpu": 1}.keys(), TypeError, "whose keys would be taken"),
        ({"cpu"}, TypeError, r"got a set \(\{'cpu'\}\), which has no order"),
        (frozenset(["cpu"]), TypeError, "frozenset .* which has no order"),
        (b"cpu", TypeError, "list of devices"),
        (object(), TypeError, "got object. Pass a list"),
    ],
)
def test_bad_device_lists_are_rejected(bad, error, text):
    if torch.cuda.is_available() and "CUDA" in text:
        pytest.skip("this machine has a GPU")
    with pytest.raises(error, match=text):
        resolve_devices(bad)


@pytest.mark.parametrize(
    "given",
    [["cpu", "cpu"], ("cpu", "cpu"), (d for d in ["cpu", "cpu"]), iter(["cpu", torch.device("cpu")])],
    ids=["list", "tuple", "generator", "iterator"],
)
def test_ordered_device_lists_are_accepted(given):
    assert resolve_devices(given) == [torch.device("cpu")] * 2
