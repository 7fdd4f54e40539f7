"""_parallel/compile_key on live ranks: torch.compile's cache key of a DTensor names its quantized local tensor."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant.testing import mesh, weight


def two_formats_compiled(cache: bool):
    """Int8Rowwise then Int4Groupwise(128) weights in the same module code, each compiled with inductor."""
    torch._dynamo.reset()
    m, x = mesh(1), weight((1, 256), seed=2)
    outs = []
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=cache):
        for fmt in (dq.Int8Rowwise(), dq.Int4Groupwise(128)):
            model = nn.Sequential(nn.Linear(256, 256, bias=False)).to(torch.bfloat16)
            parallelize_module(dq.quantize_(model, fmt), m, {"0": ColwiseParallel()})
            try:
                outs.append(torch.equal(torch.compile(model, backend="inductor")(x), model(x)))
            except Exception as e:  # the collision fails inside the wrong compiled graph
                outs.append(type(e).__name__)
    return outs


@pytest.mark.slow
def test_compiled_formats_each_get_their_own_graph(ranks):
    """Two formats of the same module compiled in one process, with torch's AOT autograd cache on.

    torch 2.13 keys a DTensor input by its spec alone, so without dtensor_quant._parallel.compile_key the second
    model is served the first one's compiled graph (it fails in assert_size_stride, or runs the wrong
    kernel). With the cache off or on, each model must equal its own eager output bit for bit.
    """
    off, on = ranks(1).run(two_formats_compiled, False)[0], ranks(1).run(two_formats_compiled, True)[0]
    assert off == [True, True]
    assert on == [True, True], f"with the AOT autograd cache on: {on}"


def cache_keys():
    """torch.compile's AOT-cache key of a Replicate DTensor holding a dense, an int8 and an int4 weight."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from dtensor_quant._parallel.compile_key import install

    torch_key = install().original(DTensor, "_stable_hash_for_caching")
    m, w = mesh(1), weight((256, 256), seed=3).to(torch.bfloat16)
    ours, torchs = [], []
    for local in (w, dq.quantize(w, dq.Int8Rowwise()), dq.quantize(w, dq.Int4Groupwise(128))):
        spec = DTensorSpec(m, (Replicate(),), tensor_meta=TensorMeta(local.shape, local.stride(), local.dtype))
        dt = DTensor(local, spec, requires_grad=False)
        ours.append(dt._stable_hash_for_caching())
        torchs.append(torch_key(dt))
    return ours, torchs


def test_dtensor_cache_key_names_the_quantized_local(ranks):
    """_parallel/compile_key changes the key of a DTensor holding a QuantizedTensor, and only that key.

    torch's own key (the patch's original) still ignores the local tensor: the day it does not, this
    fails, and the patch can go.
    """
    (dense, int8, int4), (torch_dense, torch_int8, torch_int4) = ranks(1).run(cache_keys)[0]
    assert len({dense, int8, int4}) == 3, "two formats of the same weight share a compile-cache key"
    assert dense == torch_dense, "a dense DTensor's key must stay torch's"
    assert torch_dense == torch_int8 == torch_int4, "torch now keys a DTensor by its local tensor: drop the patch"
