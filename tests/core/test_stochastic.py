"""core/stochastic: noise for stochastic rounding that depends only on (seed, step, global element index)."""

import pytest
import torch

from dtensor_quant._core import stochastic


@pytest.mark.parametrize(
    "shape,offsets,global_shape",
    [
        ((512, 1024), (512, 0), (1024, 1024)),  # a row shard
        ((7, 37), (3, 11), (20, 100)),  # a 2-D block, odd widths (vector body and scalar tail)
        ((3, 40), (107374181, 17), (107374190, 40)),  # the low 32 index bits wrap inside a row
        ((2, 5), (2**31, 0), (2**31 + 4, 5)),  # a weight of more than 2**32 elements: the high bits mix in
    ],
)
def test_native_noise_equals_the_torch_reference(shape, offsets, global_shape):
    native = stochastic.uniform(5, 9, shape, offsets, global_shape)
    reference = stochastic.uniform_reference(5, 9, shape, offsets, global_shape)
    assert torch.equal(native, reference)


def test_noise_depends_only_on_seed_step_and_global_index():
    whole = stochastic.uniform(1, 2, (10, 6), (0, 0), (10, 6))
    assert torch.equal(whole[3:7, 2:5], stochastic.uniform(1, 2, (4, 3), (3, 2), (10, 6)))
    assert not torch.equal(whole, stochastic.uniform(1, 3, (10, 6), (0, 0), (10, 6)))  # another step
    assert not torch.equal(whole, stochastic.uniform(2, 2, (10, 6), (0, 0), (10, 6)))  # another seed
    big = stochastic.uniform(0, 0, (256, 1024), (0, 0), (256, 1024))
    assert 0.0 <= big.min() and big.max() < 1.0
    assert abs(big.mean().item() - 0.5) < 0.005 and abs(big.std().item() - (1 / 12) ** 0.5) < 0.005
    # neighbours are not correlated (a hash, not a smooth function of the index)
    assert abs(torch.corrcoef(torch.stack([big[:, :-1].flatten(), big[:, 1:].flatten()]))[0, 1]) < 0.01
