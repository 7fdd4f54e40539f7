"""torch.compile of a row-parallel layer whose format quantizes activations per token, at TP 2.

The handler that reduces the per-token maxima runs while DTensor's dispatch is
traced, but the kernel is an opaque custom op whose body runs later; so in a
trace the maxima are computed and all-reduced in the graph and handed to the
op (``dtensor_quant::kernel_linear``'s ``token_absmax``). Checked: compiled ==
eager bit for bit (int8: the same exact integer arithmetic), on the first call
and on a new input, and the reduced scheme's compiled output differs from the
per-rank scheme's (the reduction is really in the graph, not lost to it).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant.testing import mesh, weight


def compiled_row_parallel(backend: str, scheme: str):
    torch._dynamo.reset()
    m, world, rank = mesh(2), dist.get_world_size(), dist.get_rank()
    q = dq.quantize(weight((48, 256), seed=1).float(), dq.Int8Rowwise(activations=scheme))
    module = parallelize_module(torch.nn.Linear(256, 48, bias=False), m, RowwiseParallel())
    module.weight = torch.nn.Parameter(distribute_tensor(q, m, [Shard(1)]), requires_grad=False)
    compiled = torch.compile(module, backend=backend)
    outs = []
    for seed in (2, 3):
        x = weight((5, 256), seed=seed).float()
        x[0, 200:] *= 40  # token 0's largest value in rank 1's slice: a local scale would differ
        x_local = DTensor.from_local(x.chunk(world, -1)[rank], m, [Shard(-1)])
        with torch.no_grad():
            eager, got = module(x_local), compiled(x_local)
        assert torch.equal(got, eager), f"compiled ({backend}) differs from eager, input seed {seed}"
        outs.append(got)
    return outs


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_row_parallel_keeps_the_reduction(ranks, backend):
    reduced = ranks(2).run(compiled_row_parallel, backend, "int8-token")
    per_rank = ranks(2).run(compiled_row_parallel, backend, "int8-token-per-rank")
    for r, p in zip(reduced, per_rank):
        assert not torch.equal(r[0], p[0]), "the compiled reduced scheme computed the per-rank statistic"
