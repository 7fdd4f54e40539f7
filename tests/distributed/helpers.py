"""Code that runs on the ranks of a test pool: meshes, weights, bit-exact comparisons."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtensor_quant import QuantizedTensor

_meshes: dict[tuple[int, ...], object] = {}


def mesh(*shape: int):
    """A CPU device mesh of ``shape`` over this pool's ranks, built once per process."""
    if shape not in _meshes:
        names = ("dp", "tp")[-len(shape):] if len(shape) <= 2 else None
        _meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _meshes[shape]


def rank() -> int:
    return dist.get_rank()


def weight(shape, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    """The same random weight on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g).to(dtype)


def assert_same_bits(actual: QuantizedTensor, expected: QuantizedTensor, what: str = "") -> None:
    """Every inner tensor of ``actual`` has the bytes of ``expected``'s (NaN patterns included)."""
    assert isinstance(actual, QuantizedTensor), f"{what}: got {type(actual).__name__}"
    assert actual.fmt == expected.fmt, (what, actual.fmt, expected.fmt)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual, expected)
    for name in expected.fmt.inner_names:
        a, e = getattr(actual, name), getattr(expected, name)
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: inner {name} {a.shape} vs {e.shape}"
        assert torch.equal(a.contiguous().view(torch.uint8), e.contiguous().view(torch.uint8)), (
            f"{what}: inner {name} differs"
        )
