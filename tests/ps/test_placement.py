"""Chunking and placement: deterministic, balanced, and frugal when shards change."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from tensorwire import ps
from tensorwire.errors import ConfigError

MiB = 1 << 20

# torchvision's ResNet-50: the shapes of its 161 parameter tensors, in order
# (25,557,032 parameters).
RESNET50 = [
    (64, 3, 7, 7), (64,), (64,), (64, 64, 1, 1), (64,), (64,), (64, 64, 3, 3), (64,), (64,),
    (256, 64, 1, 1), (256,), (256,), (256, 64, 1, 1), (256,), (256,), (64, 256, 1, 1), (64,),
    (64,), (64, 64, 3, 3), (64,), (64,), (256, 64, 1, 1), (256,), (256,), (64, 256, 1, 1),
    (64,), (64,), (64, 64, 3, 3), (64,), (64,), (256, 64, 1, 1), (256,), (256,),
    (128, 256, 1, 1), (128,), (128,), (128, 128, 3, 3), (128,), (128,), (512, 128, 1, 1),
    (512,), (512,), (512, 256, 1, 1), (512,), (512,), (128, 512, 1, 1), (128,), (128,),
    (128, 128, 3, 3), (128,), (128,), (512, 128, 1, 1), (512,), (512,), (128, 512, 1, 1),
    (128,), (128,), (128, 128, 3, 3), (128,), (128,), (512, 128, 1, 1), (512,), (512,),
    (128, 512, 1, 1), (128,), (128,), (128, 128, 3, 3), (128,), (128,), (512, 128, 1, 1),
    (512,), (512,), (256, 512, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,),
    (1024, 256, 1, 1), (1024,), (1024,), (1024, 512, 1, 1), (1024,), (1024,),
    (256, 1024, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1),
    (1024,), (1024,), (256, 1024, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,),
    (1024, 256, 1, 1), (1024,), (1024,), (256, 1024, 1, 1), (256,), (256,), (256, 256, 3, 3),
    (256,), (256,), (1024, 256, 1, 1), (1024,), (1024,), (256, 1024, 1, 1), (256,), (256,),
    (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1), (1024,), (1024,), (256, 1024, 1, 1),
    (256,), (256,), (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1), (1024,), (1024,),
    (512, 1024, 1, 1), (512,), (512,), (512, 512, 3, 3), (512,), (512,), (2048, 512, 1, 1),
    (2048,), (2048,), (2048, 1024, 1, 1), (2048,), (2048,), (512, 2048, 1, 1), (512,),
    (512,), (512, 512, 3, 3), (512,), (512,), (2048, 512, 1, 1), (2048,), (2048,),
    (512, 2048, 1, 1), (512,), (512,), (512, 512, 3, 3), (512,), (512,), (2048, 512, 1, 1),
    (2048,), (2048,), (1000, 2048), (1000,),
]


def resnet50() -> list[ps.TensorSpec]:
    return [ps.TensorSpec(f"p{i:03d}", shape, "<f4") for i, shape in enumerate(RESNET50)]


def test_resnet50_data_is_the_real_parameter_count() -> None:
    assert len(RESNET50) == 161
    assert sum(math.prod(s) for s in RESNET50) == 25_557_032


def test_chunks_cover_each_tensor_exactly_within_the_size_limit() -> None:
    specs = [ps.TensorSpec("big", (1000, 1001), "<f4"), ps.TensorSpec("small", (3,), "<f8"),
             ps.TensorSpec("empty", (0, 5), "<f4")]
    chunks = ps.chunk_tensors(specs, 100_000)
    for spec in specs:
        mine = [c for c in chunks if c.name == spec.name]
        assert [c.index for c in mine] == list(range(len(mine)))
        assert mine[0].start == 0 and mine[-1].stop == spec.size
        assert all(a.stop == b.start for a, b in itertools.pairwise(mine))
        assert all(c.nbytes <= 100_000 for c in mine)
    big = [c for c in chunks if c.name == "big"]
    assert len(big) == math.ceil(1000 * 1001 * 4 / 100_000)
    assert max(c.size for c in big) - min(c.size for c in big) <= 1
    assert len({c.key for c in chunks}) == len(chunks)


def test_chunking_refuses_duplicate_names_and_bad_sizes() -> None:
    with pytest.raises(ConfigError):
        ps.chunk_tensors([ps.TensorSpec("a", (1,), "<f4")] * 2, 10)
    with pytest.raises(ConfigError):
        ps.chunk_tensors([ps.TensorSpec("a", (1,), "<f4")], 0)
    with pytest.raises(ConfigError):
        ps.place([], 0)


def test_placement_is_deterministic_whatever_the_input_order() -> None:
    chunks = ps.chunk_tensors(resnet50(), 4 * MiB)
    shuffled = list(chunks)
    random.Random(7).shuffle(shuffled)
    assert dict(ps.place(chunks, 5).shard_of) == dict(ps.place(shuffled, 5).shard_of)


@pytest.mark.parametrize("shards", range(2, 17))
def test_resnet50_imbalance_is_within_five_percent(shards: int) -> None:
    placement = ps.place(ps.chunk_tensors(resnet50(), 4 * MiB), shards)
    assert placement.imbalance <= 1.05
    assert sum(placement.loads()) == 25_557_032 * 4


@pytest.mark.parametrize("shards", range(2, 17))
def test_adding_a_shard_moves_about_one_share(shards: int) -> None:
    chunks = ps.chunk_tensors(resnet50(), 4 * MiB)
    total = sum(c.nbytes for c in chunks)
    old = ps.place(chunks, shards)
    new = ps.resize(old, shards + 1)
    share = total / (shards + 1)
    moved = old.moved_bytes(new)
    assert 0.6 * share <= moved <= 1.4 * share, moved / share
    assert new.imbalance <= 1.05
    # Every chunk that moved went to the new shard or from an overfull one.
    assert len(new.on_shard(shards)) > 0


def test_a_fresh_placement_would_move_far_more() -> None:
    chunks = ps.chunk_tensors(resnet50(), 4 * MiB)
    old = ps.place(chunks, 8)
    assert old.moved_bytes(ps.place(chunks, 9)) > 2 * old.moved_bytes(ps.resize(old, 9))


def test_removing_a_shard_moves_only_its_chunks_and_rebalances() -> None:
    chunks = ps.chunk_tensors(resnet50(), 1 * MiB)
    old = ps.place(chunks, 6)
    new = ps.resize(old, 5)
    gone = old.loads()[5]
    assert new.imbalance <= 1.05
    assert gone <= old.moved_bytes(new) <= 1.2 * gone
    assert all(shard < 5 for shard in new.shard_of.values())


def test_small_tensors_are_whole_chunks_and_share_one_message_per_shard() -> None:
    specs = [ps.TensorSpec(f"bias{i}", (10,), "<f4") for i in range(100)]
    placement = ps.place(ps.chunk_tensors(specs, 4 * MiB), 4)
    assert len(placement.chunks) == 100
    assert placement.imbalance == 1.0
    assert sum(len(placement.on_shard(s)) for s in range(4)) == 100


def test_spec_of_an_array() -> None:
    spec = ps.TensorSpec.of("w", np.zeros((2, 3), np.float64))
    assert (spec.shape, spec.size, spec.nbytes) == ((2, 3), 6, 48)


def by_address(placement: ps.Placement, addresses: list[str]) -> dict[str, str]:
    return {key: addresses[shard] for key, shard in placement.shard_of.items()}


def test_relocate_by_address_keeps_chunks_on_surviving_shards() -> None:
    chunks = ps.chunk_tensors(resnet50(), 4 * MiB)
    total = sum(c.nbytes for c in chunks)
    old = ps.place(chunks, 4)
    before = by_address(old, ["a", "b", "c", "d"])
    # Shard "b" leaves and "e" joins, in another order than before.
    new = ps.relocate(old, ["a", "b", "c", "d"], ["e", "d", "a", "c"])
    after = by_address(new, ["e", "d", "a", "c"])
    assert new.num_shards == 4 and new.imbalance <= 1.05
    moved = sum(c.nbytes for c in chunks if before[c.key] != after[c.key])
    # What "b" held has to go, and "e" starts empty: about one share moves.
    assert old.loads()[1] <= moved <= 1.3 * total / 4
    assert all(after[c.key] == before[c.key] for c in chunks
               if before[c.key] != "b" and after[c.key] != "e")
    with pytest.raises(ConfigError):
        ps.relocate(old, ["a", "b"], ["a"])
    with pytest.raises(ConfigError):
        ps.relocate(old, ["a", "b", "c", "d"], ["a", "a"])


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_balance_follows_bandwidth_moving_little(shards: int) -> None:
    chunks = ps.chunk_tensors(resnet50(), 1 * MiB)
    total = sum(c.nbytes for c in chunks)
    old = ps.place(chunks, shards)
    # One shard behind a link a quarter as fast as the others.
    bandwidth = [1e9] * (shards - 1) + [0.25e9]
    before = max(ps.predicted_times(old, bandwidth))
    new = ps.balance(old, bandwidth)
    after = ps.predicted_times(new, bandwidth)
    ideal = total / sum(bandwidth)  # every shard done at the same moment
    assert before > 2.4 * ideal  # 4 (k - 0.75) / k times the ideal
    assert max(after) <= 1.03 * ideal, max(after) / ideal
    # Only the slow shard's excess moves: its share was 1/k, it should be
    # 0.25 / (k - 0.75).
    excess = old.loads()[-1] - total * 0.25 / (shards - 0.75)
    assert old.moved_bytes(new) <= 1.15 * excess
    assert all(new.shard_of[c.key] == old.shard_of[c.key] for c in chunks
               if old.shard_of[c.key] == shards - 1 and new.shard_of[c.key] == shards - 1)


def test_balance_leaves_an_even_placement_alone() -> None:
    chunks = ps.chunk_tensors(resnet50(), 4 * MiB)
    old = ps.place(chunks, 4)
    new = ps.balance(old, [1e9] * 4)
    assert old.moved_bytes(new) == 0
    # Twice the bandwidth, twice the share: 1/3 of the bytes instead of 1/4.
    assert ps.balance(old, [2e9, 2e9, 1e9, 1e9]).loads()[0] > 1.25 * old.loads()[0]


def test_predicted_times_refuse_bad_bandwidths() -> None:
    old = ps.place(ps.chunk_tensors(resnet50(), 4 * MiB), 2)
    with pytest.raises(ConfigError):
        ps.predicted_times(old, [1.0])
    with pytest.raises(ConfigError):
        ps.balance(old, [1.0, 0.0])


def test_join_chunks_puts_a_tensor_back_together_from_chunk_values_in_any_order() -> None:
    from tensorwire.ps._placement import join_chunks

    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {"w": rng.standard_normal((30, 70)).astype(np.float32),
                                     "b": rng.standard_normal(5).astype(np.float64)}
    specs = [ps.TensorSpec.of(name, a) for name, a in arrays.items()]
    chunks = ps.chunk_tensors(specs, 1_000)  # w: 8,400 bytes in 9 chunks; b whole
    values = {c.key: arrays[c.name].reshape(-1)[c.start:c.stop].copy() for c in chunks}
    shuffled = dict(random.Random(1).sample(sorted(values.items()), len(values)))
    for spec in specs:
        mine = [c for c in chunks if c.name == spec.name]
        joined = join_chunks(spec, mine, shuffled)
        assert joined.shape == spec.shape and joined.dtype == np.dtype(spec.dtype)
        np.testing.assert_array_equal(joined, arrays[spec.name])
    assert len([c for c in chunks if c.name == "w"]) > 1
