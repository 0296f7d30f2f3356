import pytest
import torch

from tensorshard.partition import HeadGroups, Partition, block_partition, kv_local_ranges, split_evenly


def test_split_evenly_puts_larger_runs_first():
    assert split_evenly(176, 3) == [59, 59, 58]
    assert split_evenly(9, 2) == [5, 4]
    assert split_evenly(8, 4) == [2, 2, 2, 2]


def test_plain_partition_is_contiguous_and_uneven():
    part = block_partition(176, 3)
    assert [part.local_size(r) for r in range(3)] == [59, 59, 58]
    assert part.ranges == (((0, 59),), ((59, 118),), ((118, 176),))
    assert not part.overlapping


def test_mha_heads_split_unevenly_on_head_boundaries():
    heads = HeadGroups.build(9, 9, 2)
    assert heads.q == ((0, 5), (5, 9))
    part = block_partition(9 * 8, 2, ("q",), heads)
    assert part.ranges == (((0, 40),), ((40, 72),))  # 5 and 4 heads of 8 features, never cut


def test_grouped_heads_keep_query_heads_with_their_kv_head():
    # 3 KV groups of 3 query heads on 2 devices: whole groups, 6 + 3 query heads.
    heads = HeadGroups.build(9, 3, 2)
    assert heads.q == ((0, 6), (6, 9)) and heads.kv == ((0, 2), (2, 3))
    assert heads.local(0) == {"heads": 6, "kv_heads": 2, "groups": 3}
    assert not heads.kv_replicated


def test_fewer_kv_heads_than_devices_replicates_kv_heads():
    heads = HeadGroups.build(8, 2, 4)
    assert heads.q == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert heads.kv == ((0, 1), (0, 1), (1, 2), (1, 2))
    assert heads.kv_sharers() == [[0, 1], [2, 3]]
    kv = block_partition(2 * 16, 4, ("kv",), heads)
    assert kv.overlapping and kv.ranges[1] == ((0, 16),)
    # SmolLM2's geometry on 4 devices: KV head 0 on two devices, its 3 query heads split 2 + 1.
    smol = HeadGroups.build(9, 3, 4)
    assert smol.q == ((0, 2), (2, 3), (3, 6), (6, 9))
    assert [smol.local(r)["groups"] for r in range(4)] == [2, 1, 3, 3]


def test_too_many_devices_for_heads_is_a_clear_error():
    with pytest.raises(ValueError, match="leaving one without a head"):
        HeadGroups.build(2, 1, 4)
    with pytest.raises(ValueError, match="cannot be split over 4 devices"):
        block_partition(3, 4)
    with pytest.raises(ValueError, match="positive multiple"):
        HeadGroups.build(9, 2, 2)


def test_fused_blocks_split_block_by_block():
    # gate|up fused (2 x 6) on 2 devices: each keeps [gate_r | up_r].
    part = block_partition(12, 2, (6, 6))
    assert part.ranges == (((0, 3), (6, 9)), ((3, 6), (9, 12)))
    # q|k|v with GQA (4 q heads, 2 kv heads, head_dim 2).
    heads = HeadGroups.build(4, 2, 2)
    qkv = block_partition((4 + 2 + 2) * 2, 2, ("q", "kv", "kv"), heads)
    assert qkv.ranges[0] == ((0, 4), (8, 10), (12, 14))
    # interleaved per head (bloom / gpt-neox): 3 heads of (q, k, v) x 2 features.
    inter = block_partition(3 * 3 * 2, 2, ("q*3",), HeadGroups.build(3, 3, 2))
    assert inter.ranges == (((0, 12),), ((12, 18),))


def test_take_and_assemble_round_trip(gen):
    heads = HeadGroups.build(4, 2, 2)
    part = block_partition(16, 2, ("q", "kv", "kv"), heads)
    full = torch.randn(5, 16, generator=gen)
    pieces = [part.take(full, 1, r) for r in range(2)]
    assert torch.equal(part.assemble(pieces, 1), full)


def test_kv_local_ranges_locate_the_tied_pieces():
    heads = HeadGroups.build(4, 1, 2)  # one KV head on both devices
    assert kv_local_ranges((4 + 1 + 1) * 2, 2, ("q", "kv", "kv"), heads, 0) == [(4, 8)]


def test_bad_blocks_are_reported():
    with pytest.raises(ValueError, match="unknown block"):
        block_partition(8, 2, ("x",), None)
    with pytest.raises(ValueError, match="no Heads"):
        block_partition(8, 2, ("q",), None)
    with pytest.raises(ValueError, match="add up to"):
        block_partition(8, 2, (3, 3), None)
    with pytest.raises(ValueError, match="do not divide"):
        block_partition(10, 2, ("q",), HeadGroups.build(4, 4, 2))


def test_replicated_partition():
    assert Partition.replicated(4, 2).is_trivial
