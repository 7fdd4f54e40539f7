"""What several benchmarks need and none of them measures: the optional plotting and torchao imports, CSV output.

The benchmarks run as scripts (``python bench/<name>.py``), so this directory
is on ``sys.path`` and they ``import common``.
"""

from __future__ import annotations

import csv
from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'dtensor_quant[bench]'); no plot written")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def torchao_nf4():
    """torchao's ``to_nf4`` (0.18's module path, then the older one), or None when torchao is not installed."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import to_nf4
        except ImportError:
            return None
    return to_nf4


def write_csv(rows: list[dict], path: Path) -> None:
    """``rows`` (one dict per measurement, the first one's keys as the header) to ``path``, its folder made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
