"""Session-wide test settings, and the checkpoints that tests of both trees read.

The tests mirror the package: ``tests/<layer>/test_<module>.py`` runs on one
process, ``tests/distributed/<layer>/test_<module>.py`` on live ranks (the
``ranks`` fixture of tests/distributed/conftest.py); ``tests/distributed/examples/``
runs the examples. ``tests/support/`` holds what several test modules share.
"""

import os
import tempfile

# Inductor's on-disk cache can hold graphs compiled against an older signature of this
# library's custom ops (it keys on the graph, not on the op schemas); a private cache per
# run keeps the compile tests hermetic. Spawned ranks inherit the variable.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="dtensor_quant_inductor_"))

# Hugging Face checkpoints written once per session, on first use, for the one-process and the
# distributed tests of dq.hf alike.
from tests.support.hf_cases import checkpoints, fp8_checkpoints  # noqa: F401
from tests.support.hf_export_cases import sources  # noqa: F401
from tests.support.producers import producer_checkpoints  # noqa: F401
