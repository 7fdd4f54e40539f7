"""``session_launcher``: an example's ``main`` starts its ranks on the session's pools instead of fresh ones.

The examples' ``main`` functions start ranks of their own (``rank_pool.run`` / ``run_script``): a pool of
fresh processes per call, about 5-10 s on two cores before the example does anything. Tests that call a
``main`` in this process to check what the example does take this fixture: the same ``main``, the same
functions on the same number of ranks, on the session's ``ranks(n)``. Starting fresh ranks, as a user's
run does, stays covered by the cases that run an example as a script (hf_tp_inference, checkpoint_reshard,
demo) and by tests/distributed/testing/test_rank_pool.py.
"""

import pytest

from dtensor_quant.testing import rank_pool


@pytest.fixture
def session_launcher(ranks, monkeypatch):
    """Point ``rank_pool.run`` and ``rank_pool.run_script`` at ``ranks(world)`` for one test; the launcher."""

    def launch(fn, world, *args, **kwargs):
        return ranks(world).run(fn, *args, **kwargs)

    monkeypatch.setattr(rank_pool, "run", launch)
    monkeypatch.setattr(rank_pool, "run_script", launch)
    return launch
