"""What a format test needs besides the checks: live ranks, meshes, weights, bit comparison.

The project's own tests use these, and so can a test of your format::

    from dtensor_quant.testing import assert_same_bits, mesh, pool, weight

    def gather(fmt):                       # runs on every rank
        q = dq.quantize(weight((64, 256)), fmt)
        dt = distribute_tensor(q, mesh(2), [Shard(1)])
        assert_same_bits(dt.full_tensor(), q, "Shard(1) -> full")

    def test_gather():
        pool(2).run(gather, MyFormat())    # raises, with every rank's traceback, if a rank fails

A rank's failure already raises :class:`~dtensor_quant.testing.rank_pool.RankError` from
``run``: a function run on the ranks asserts inside and returns nothing, or
returns a value the test then checks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from .._core.bits import same_bits
from .._core.format import QuantFormat
from .._core.layout import LayoutError
from .._core.tensor import QuantizedTensor
from .._ops.layout_ops import block_sizes, broadcastable
from .._parallel.placements import check_placements
from .rank_pool import RankPool

# -- the rank pools (in the test process) -----------------------------------------

_pools: dict[int, RankPool] = {}


def pool(world_size: int) -> RankPool:
    """A started pool of ``world_size`` CPU ranks, one per world size, reused until :func:`close_pools`.

    Starting a gloo process group costs seconds; reusing the ranks makes a
    distributed test cost about as much as its own work.
    """
    if world_size not in _pools:
        _pools[world_size] = RankPool(world_size, timeout=120, device="cpu")
    return _pools[world_size].start()


def close_pools() -> None:
    for p in _pools.values():
        p.close()
    _pools.clear()


# -- on the ranks -----------------------------------------------------------------

_meshes: dict[tuple[int, ...], DeviceMesh] = {}


def mesh(*shape: int) -> DeviceMesh:
    """A CPU device mesh of ``shape`` over the ranks, made once per process.

    Every mesh of a shape is the same object, so its process groups are made
    once. One or two dims are named ``("tp",)`` / ``("dp", "tp")``.
    """
    if shape not in _meshes:
        names = ("dp", "tp")[-len(shape) :] if len(shape) <= 2 else None
        _meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _meshes[shape]


def placements(specs: str) -> list[Placement]:
    """``"S0,R"`` -> ``[Shard(0), Replicate()]``: one of ``R``, ``P`` (Partial), ``S<dim>`` or
    ``SS<dim>:<split_factor>`` (the _StridedShard of FSDP2 + TP) per mesh dim."""
    out: list[Placement] = []
    for spec in specs.split(","):
        if spec == "R":
            out.append(Replicate())
        elif spec == "P":
            out.append(Partial())
        elif spec.startswith("SS"):
            dim, split_factor = spec[2:].split(":")
            out.append(_StridedShard(int(dim), split_factor=int(split_factor)))
        elif spec.startswith("S"):
            out.append(Shard(int(spec[1:])))
        else:
            raise ValueError(f"placement {spec!r}: expected R, P, S<dim> or SS<dim>:<split_factor>")
    return out


def legal(fmt: QuantFormat, shape, mesh_shape, specs: str | list[Placement]) -> bool:
    """Whether ``fmt`` can hold a weight of ``shape`` under ``specs`` on a mesh of ``mesh_shape``.

    ``specs`` are placements, or a string such as ``"S0,R"``.
    """
    try:
        check_placements(shape, fmt, mesh_shape, placements(specs) if isinstance(specs, str) else specs)
    except LayoutError:
        return False
    return True


def rank() -> int:
    return dist.get_rank()


def weight(shape, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A Gaussian weight from ``seed``: the same on every rank and in the test process."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- bit comparison ---------------------------------------------------------------


def assert_same_bits(actual, expected: QuantizedTensor, what: str = "") -> None:
    """``actual`` is a QuantizedTensor of ``expected``'s format, shape and dtype whose every inner
    tensor has ``expected``'s bytes (NaN payloads included)."""
    assert isinstance(actual, QuantizedTensor), f"{what}: got a {type(actual).__name__}, not a QuantizedTensor"
    assert actual.fmt == expected.fmt, f"{what}: format {actual.fmt} != {expected.fmt}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    for name in expected.fmt.inner_names:
        a, e = getattr(actual, name), getattr(expected, name)
        assert a.shape == e.shape and a.dtype == e.dtype, (
            f"{what}: inner '{name}' is {tuple(a.shape)} {a.dtype}, expected {tuple(e.shape)} {e.dtype}"
        )
        assert same_bits(a, e), f"{what}: inner '{name}' differs from the reference"


def assert_local_matches(dt: DTensor, dense: torch.Tensor, what: str = "") -> None:
    """``dt``'s local shard is quantized and dequantizes to exactly DTensor's shard of ``dense``."""
    expected = distribute_tensor(dense, dt.device_mesh, dt.placements, src_data_rank=None).to_local()
    local = dt.to_local()
    assert isinstance(local, QuantizedTensor), f"{what}: the local shard is a {type(local).__name__}"
    assert local.shape == expected.shape, f"{what}: local shard {tuple(local.shape)}, expected {tuple(expected.shape)}"
    assert torch.equal(local.dequantize(), expected), f"{what}: the local shard's values differ"


def assert_redistributes_exactly(dt: DTensor, q: QuantizedTensor, targets, what: str = "") -> None:
    """``dt`` (``q`` distributed) and each redistribute of it to ``targets`` hold, on this rank, exactly
    DTensor's shard of ``q``'s dense values, and gather back to ``q``'s bytes.

    ``targets`` are placement lists or strings such as ``"S0,R"`` (:func:`placements`).
    """
    dense = q.dequantize()
    assert_local_matches(dt, dense, f"distribute {what}")
    assert_same_bits(dt.full_tensor(), q, f"full_tensor from {what}")
    for tgt in targets:
        moved = dt.redistribute(dt.device_mesh, placements(tgt) if isinstance(tgt, str) else tgt)
        assert_local_matches(moved, dense, f"{what} -> {tgt}")
        assert_same_bits(moved.full_tensor(), q, f"full_tensor after {what} -> {tgt}")


def reference_dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The format's own ``dequantize`` math on ``q``'s inner tensors, without any fast path.

    ``q`` is a weight in its stored orientation (not transposed, not a stack).
    """
    inner = broadcastable(q.inner, block_sizes(q.rels), q.shape)
    return q.fmt.dequantize(inner, dtype or q.dtype)


__all__ = [
    "assert_local_matches",
    "assert_redistributes_exactly",
    "assert_same_bits",
    "close_pools",
    "legal",
    "mesh",
    "placements",
    "pool",
    "rank",
    "reference_dequantize",
    "same_bits",
    "weight",
]
