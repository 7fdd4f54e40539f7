"""Pools of live ranks shared by every distributed test (one per world size).

Starting a gloo process group costs seconds; a pool per world size starts
once per session and runs each test's function on all of its ranks.
"""

import os
import sys

import pytest

from dtensor_quant.launch import RankPool

# examples/ holds the model and the custom format the tests exercise; spawned ranks inherit sys.path.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples")))

_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def ranks():
    """``ranks(n)`` is a started :class:`RankPool` of ``n`` ranks."""

    def get(world_size: int) -> RankPool:
        pool = _pools.get(world_size)
        if pool is None:
            pool = _pools[world_size] = RankPool(world_size, timeout=120, device="cpu")
        return pool.start()

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()
