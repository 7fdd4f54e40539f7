"""Session-wide test settings."""

import os
import tempfile

# Inductor's on-disk cache can hold graphs compiled against an older signature of this
# library's custom ops (it keys on the graph, not on the op schemas); a private cache per
# run keeps the compile tests hermetic. Spawned ranks inherit the variable.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="dtensor_quant_inductor_"))
