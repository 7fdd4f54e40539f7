"""The pytest fixture of the toolkit; import it into a conftest.py to use it::

from dtensor_quant.testing.fixtures import ranks  # noqa: F401

def test_gather(ranks):
    ranks(2).run(gather, MyFormat())
"""

import pytest

from .tools import close_pools, pool


@pytest.fixture(scope="session")
def ranks():
    """``ranks(n)`` is a started :class:`~dtensor_quant.testing.rank_pool.RankPool` of ``n`` CPU ranks, shared by
    every test of the session and closed at its end."""
    yield pool
    close_pools()
