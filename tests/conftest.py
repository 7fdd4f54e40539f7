"""Session-wide test settings."""

import os
import sys
import tempfile

# Inductor's on-disk cache can hold graphs compiled against an older signature of this
# library's custom ops (it keys on the graph, not on the op schemas); a private cache per
# run keeps the compile tests hermetic. Spawned ranks inherit the variable.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="dtensor_quant_inductor_"))

# examples/ (the model, the scripts and the custom format the tests run) and tests/distributed/
# (the test-only user formats and case modules) import by name, once for every test module;
# spawned ranks inherit sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.join(_HERE, "distributed"), os.path.join(os.path.dirname(_HERE), "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
