"""core/notes: the Bytes record of a tensor lives as long as a tensor over those bytes, and no longer.

Every op that makes new bytes (quantize, clone, cat, a device copy, a
``Replicate -> Shard`` chunk and clone) registers its record where the
compiled kernel op finds it from the first inner tensor. That registry once
held the record strongly while the record held its key, so every such tensor
leaked its largest inner tensor for the life of the process (a redistribute
in a loop grew without bound). These tests delete the result and check that
its inner tensors are freed by reference counting alone (the cyclic
collector switched off), and that the record is found while the tensor lives.
"""

import gc
import weakref

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant._core.notes import bytes_of
from dtensor_quant.testing import FORMATS

MAKERS = {
    "quantize": lambda w, fmt: dq.quantize(w, fmt),
    "clone": lambda w, fmt: dq.quantize(w, fmt).clone(),
    "cat": lambda w, fmt: torch.cat(list(torch.chunk(dq.quantize(w, fmt), 2, 0)), 0),
    "to(copy)": lambda w, fmt: dq.quantize(w, fmt).to("cpu", copy=True),
    "chunk+clone": lambda w, fmt: torch.chunk(dq.quantize(w, fmt), 2, 0)[1].clone(),
}


@pytest.fixture
def no_cyclic_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("name", list(FORMATS))
def test_new_bytes_are_freed_with_their_tensor(name, maker, no_cyclic_gc):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    MAKERS[maker](w, FORMATS[name])  # a kernel's first load keeps the frames of the call that built it
    q = MAKERS[maker](w, FORMATS[name])
    inner = [weakref.ref(t) for t in q.inner.values()]
    assert bytes_of(next(iter(q.inner.values()))) is q.notes.bytes  # found while the tensor lives
    del q
    alive = [n for n, r in zip(FORMATS[name].inner_names, inner) if r() is not None]
    assert not alive, f"{maker} of {name}: inner tensors {alive} outlive their tensor"


def test_repeated_clones_do_not_grow_memory(no_cyclic_gc):
    q = dq.quantize(torch.randn(256, 256).to(torch.bfloat16), FORMATS["int8"])
    first = q.clone()
    ref = weakref.ref(first.qdata)
    del first
    for _ in range(50):
        q.clone()
    assert ref() is None
