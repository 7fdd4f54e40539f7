"""Pools of live ranks shared by every distributed test (one per world size).

Starting a gloo process group costs seconds; a pool per world size starts
once per session and runs each test's function on all of its ranks.
"""

import pytest

from dtensor_quant.launch import RankPool

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
