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
