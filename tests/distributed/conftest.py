"""Distributed tests share live ranks: ``ranks(n)`` is a started pool of n gloo ranks per session.

Starting a gloo process group costs seconds; a pool per world size starts
once per session and runs each test's function on all of its ranks.
"""

from dtensor_quant.testing.fixtures import ranks  # noqa: F401
