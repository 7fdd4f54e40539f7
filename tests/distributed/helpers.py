"""Code that runs on the ranks of a test pool: meshes, weights, bit-exact comparisons."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

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


def floor_bytes(unit: torch.nn.Module, shard: int, param_dtype=None) -> int:
    """Bytes one rank sends to all-gather ``unit`` over ``shard`` ranks: the physical floor.

    Quantized weights (frozen, or trainable ones gathered quantized) send the
    stored bytes of their padded shard, except inner tensors constant along
    every dim; dense parameters their padded shard in ``param_dtype``.
    Parameters may already be tensor-parallel DTensors (their local shard counts).
    """
    from dtensor_quant.gather_quantized import GatherQuantized
    from dtensor_quant.layout import Constant

    total = 0
    for p in unit.parameters():
        p = p.to_local() if isinstance(p, DTensor) else p
        rows = -(-p.shape[0] // shard)
        q = p.quantized() if isinstance(p, GatherQuantized) else p
        if isinstance(q, QuantizedTensor):
            for name, rels in zip(q.fmt.inner_names, q.rels):
                if not all(isinstance(r, Constant) for r in rels):
                    inner = getattr(q, name)
                    total += rels[0].inner_len(rows) * inner[0].numel() * inner.element_size()
        else:
            total += rows * p[0].numel() * (param_dtype or p.dtype).itemsize
    return total
