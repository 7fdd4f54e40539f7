"""Session-wide test settings, and the checkpoints that tests of both trees read.

The tests mirror the package: ``tests/<layer>/test_<module>.py`` runs on one
process, ``tests/distributed/<layer>/test_<module>.py`` on live ranks (the
``ranks`` fixture of tests/distributed/conftest.py); ``tests/distributed/examples/``
runs the examples. ``tests/support/`` holds what several test modules share.
"""

import os
import shutil
import tempfile

# One scratch folder per run for what compiles, removed when the run ends: inductor's cache (it can hold graphs
# compiled against an older signature of this library's custom ops: it keys on the graph, not on the op schemas)
# and the library's C++ kernels (built once per run, then loaded by every test and by the spawned ranks, which
# inherit both variables and so make no folder of their own). A CI that keeps built kernels across runs sets
# DTENSOR_QUANT_CACHE itself -- the cache keys on the sources, flags, torch and CPU level, so a kept folder never
# serves a stale build -- and a folder the run did not make is left alone.
_SCRATCH = None
if not (os.environ.get("TORCHINDUCTOR_CACHE_DIR") and os.environ.get("DTENSOR_QUANT_CACHE")):
    _SCRATCH = tempfile.mkdtemp(prefix="dtensor_quant_tests_")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_SCRATCH, "inductor"))
    os.environ.setdefault("DTENSOR_QUANT_CACHE", os.path.join(_SCRATCH, "kernels"))


# Hugging Face checkpoints written once per session, on first use, for the one-process and the
# distributed tests of dq.hf alike.
from tests.support.hf_cases import checkpoints, fp8_checkpoints  # noqa: E402, F401
from tests.support.hf_export_cases import sources  # noqa: E402, F401
from tests.support.producers import producer_checkpoints  # noqa: E402, F401


def pytest_unconfigure(config):
    if _SCRATCH is not None:
        shutil.rmtree(_SCRATCH, ignore_errors=True)
