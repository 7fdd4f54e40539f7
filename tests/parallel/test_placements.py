"""_parallel/placements: which placements a layout can take, decided before any data exists; Partial refused."""

import pytest
from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import dtensor_quant as dq


def test_check_placements_without_data():
    with pytest.raises(dq.LayoutError, match=r"legal with size 1, 2, 4, 8, 16, 32"):
        dq.check_placements((4096, 4096), dq.Int4Groupwise(128), (3,), [Shard(1)])
    dq.check_placements((4096, 4096), dq.Int4Groupwise(128), (4,), [Shard(1)])
    dq.check_placements((4096, 4096), dq.Int4Groupwise(128), (3,), [Shard(0)])
    dq.check_placements((4096, 4096), dq.Int8Rowwise(), (3, 5), [Shard(0), Shard(1)])
    with pytest.raises(dq.LayoutError, match="Partial"):
        dq.check_placements((64, 64), dq.Int8Rowwise(), (2,), [Partial()])
    with pytest.raises(dq.LayoutError, match=r"mesh dim 1"):
        dq.check_placements((64, 256), dq.Int4Groupwise(64), (2, 3), [Shard(0), Shard(1)])
    # _StridedShard cuts inside each of the split_factor pieces
    with pytest.raises(dq.LayoutError):
        dq.check_placements((64, 128), dq.Int4Groupwise(64), (2, 2), [_StridedShard(1, split_factor=2), Shard(1)])
    dq.check_placements((64, 256), dq.Int4Groupwise(64), (2, 2), [_StridedShard(1, split_factor=2), Shard(1)])
    dq.check_placements((64, 512), dq.Int4Groupwise(64), (2, 2), [_StridedShard(1, split_factor=2), Shard(1)])


STYLE = ("dtensor_quant: ", "cannot be Partial", "holds no partial sums", "Reduce the dense tensor first")


def assert_partial_refusal(error: BaseException, what: str) -> None:
    assert type(error) is dq.LayoutError, f"{what}: {type(error).__name__}: {error}"
    assert all(s in str(error) for s in STYLE), f"{what}: {error}"


def test_check_placements_refuses_partial():
    for p in (Partial(), Partial("avg"), Partial("max")):
        with pytest.raises(dq.LayoutError) as info:
            dq.check_placements((64, 64), dq.Int4Groupwise(32), (2, 2), [Shard(0), p])
        assert_partial_refusal(info.value, f"check_placements {p}")
        assert "on mesh dim 1" in str(info.value)
