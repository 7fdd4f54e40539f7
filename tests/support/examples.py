"""The examples as modules of this one: ``from tests.support.examples import demo`` reads examples/demo.py.

The tests that check an example load it from its file, without putting
examples/ on ``sys.path``: this module's ``__path__`` is the examples folder,
so Python's import system finds ``tests.support.examples.<name>`` there, by
file. The name is an ordinary importable one, so what an example hands to the
ranks of a pool (its functions, the custom format's instances) unpickles there
too, in the ranks the test session keeps and in the fresh ones an example's
``main`` starts alike (they inherit ``sys.path``, which holds the repository
root). An example that imports the examples beside it by their bare names
(``demo.py``) runs as a script instead (:func:`run`), as the README runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
__path__ = [str(ROOT / "examples")]


def run(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python examples/<name>.py *args`` as a user runs it (this checkout's package importable), output captured."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(ROOT / "examples" / f"{name}.py"), *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
