"""Calls without gradients run their shards at the same time or one at a time, whichever the engine measured to
be faster for that kind of call (engines/inprocess/schedule.py); either way the numbers are the same."""

import threading
import time

import pytest
import torch

from support import plans
from support.helpers import rel_err, split_copy
from support.models import TwoPairs
from tensorshard.engines.inprocess import schedule
from tensorshard.engines.inprocess.schedule import KEEP, PROBES, REPROBE, Schedule, call_key

pytestmark = pytest.mark.timeout(60)


def no_grad_key(*shapes):
    with torch.no_grad():
        return call_key(tuple(torch.zeros(s) for s in shapes), {})


def test_calls_are_grouped_by_grad_mode_and_shapes_rounded_up_to_powers_of_two():
    assert no_grad_key((1, 17)) == no_grad_key((1, 31)) == (False, ((1, 32),))
    assert no_grad_key((1, 17)) != no_grad_key((1, 33))
    assert no_grad_key((2, 1)) != no_grad_key((2, 16))  # a decoding step is not a prefill
    assert call_key((torch.zeros(3),), {"cache": object(), "mask": torch.zeros(2, 5)}) == (True, ((4,), (2, 8)))


def test_both_ways_are_timed_then_the_faster_one_is_kept_and_the_other_retimed_now_and_then():
    s, key = Schedule(), no_grad_key((1, 1))
    ways = []
    for _ in range(2 * PROBES):  # alternate, together first
        serial = s.serial(key)
        ways.append(serial)
        s.record(key, serial, 1.0 if serial else 1.1)  # one at a time is a little faster here
    assert ways == [False, True] * PROBES and s.chosen(key) == "serial"
    later = [s.serial(key) for _ in range(REPROBE * 2)]
    assert later.count(False) == 2  # the other way once every REPROBE calls
    for _ in range(KEEP):
        s.record(key, True, 5.0)  # the machine got busy: serial calls slowed down
    assert s.chosen(key) == "together" and not s.serial(key)


def test_a_clear_difference_is_decided_after_one_call_each():
    s, key = Schedule(), no_grad_key((4, 128))
    s.record(key, s.serial(key), 1.0)  # together
    assert s.chosen(key) is None
    s.record(key, s.serial(key), 2.0)  # one at a time: twice as slow (a compute-bound call)
    assert s.chosen(key) == "together" and not s.serial(key)


def test_a_call_busy_for_long_between_its_collectives_is_never_tried_one_shard_at_a_time():
    s = Schedule()
    with torch.no_grad():
        timing = s.begin((torch.zeros(4, 128),), {})
    assert not timing.serial  # the first call: together
    timing.started -= 1.0  # it took a second, for 13 collectives: arithmetic-bound
    s.end(timing, collectives=13)
    assert s.chosen(timing.key) == "together" and not any(s.serial(timing.key) for _ in range(2 * REPROBE))


def test_a_python_bound_call_over_many_shards_is_not_taken_for_arithmetic():
    s = Schedule()
    with torch.no_grad():
        timing = s.begin((torch.zeros(1, 1),), {})
    timing.started -= 0.134  # a small Llama's decoding step at 8 CPU slots: 134 ms for 17 collectives, all Python
    s.end(timing, collectives=17, shards=8)
    assert not s._kinds[timing.key].get("arithmetic")
    assert s.serial(timing.key)  # so one shard at a time gets its turn to be timed


def test_a_decoding_step_whose_mask_grew_keeps_the_way_chosen_without_probing_again():
    s, short = Schedule(), no_grad_key((1, 1), (1, 32))  # one token, its attention mask of up to 32 positions
    for _ in range(2 * PROBES):
        serial = s.serial(short)
        s.record(short, serial, 1.0 if serial else 2.0)  # one at a time is faster
    longer = no_grad_key((1, 1), (1, 64))
    assert s.chosen(longer) is None  # unseen so far ...
    assert all(s.serial(longer) for _ in range(REPROBE - 1)) and s.chosen(longer) == "serial"  # ... yet not reprobed
    batch = no_grad_key((4, 1), (4, 32))  # another batch size is another kind of call: timed afresh
    assert not s.serial(batch) and s.chosen(batch) is None


def test_calls_that_build_a_graph_always_run_at_the_same_time():
    s = Schedule()
    key = call_key((torch.zeros(2),), {})
    assert key[0] is True
    assert not any(s.serial(key) for _ in range(10))
    with torch.enable_grad():
        assert s.begin((torch.zeros(2),), {}) is None


@pytest.mark.parametrize("n", [2, 3])
def test_serial_calls_run_one_shard_at_a_time_with_the_same_numbers(n, gen, monkeypatch):
    torch.manual_seed(0)
    ref = TwoPairs().eval()
    model = split_copy(ref, n, plan=plans.TWO_BLOCKS)
    active, most, lock = [0], [0], threading.Lock()

    def enter(*_):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.05)  # long enough for shards running at the same time to meet in here

    def leave(*_):
        with lock:
            active[0] -= 1

    for shard in model.module_shards:
        for block in (shard.a1, shard.a2):  # the column layers: no collective inside
            block.register_forward_pre_hook(enter)
            block.register_forward_hook(leave)
    x = torch.randn(4, 8, generator=gen)
    outputs = {}
    for way in (True, False):
        monkeypatch.setattr(schedule.Schedule, "serial", lambda self, key, way=way: way)
        most[0] = 0
        with torch.no_grad():
            outputs[way] = model(x)
        assert most[0] == (1 if way else n)  # one at a time, or all at once
    assert torch.equal(outputs[True], outputs[False])
    with torch.no_grad():
        assert rel_err(outputs[True], ref(x)) < 1e-5


def test_a_decoding_model_tries_both_ways_and_generates_the_unsplit_tokens():
    from support import tiny_llama

    ref = tiny_llama.build()
    model = split_copy(ref, 2)
    prompt = torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=12, do_sample=False)
        assert torch.equal(out, ref.generate(prompt, max_new_tokens=12, do_sample=False))
    # the kind of call most of the tokens were (input_ids of one token): timed, and a way chosen. Its key holds
    # the tensors' shapes; transformers 5.0 also passes cache_position, (1,), ahead of input_ids.
    kinds = model._schedule._kinds
    busiest = max((k for k in kinds if (1, 1) in k[1]), key=lambda k: kinds[k]["calls"])
    assert kinds[busiest]["calls"] >= 4 and model._schedule.chosen(busiest) in ("serial", "together")
